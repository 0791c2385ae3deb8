"""The metrics endpoint's server (tslice.server.metrics_http) on real loopback sockets:
HTTPS with the server's certificate, mutual TLS, tokens, renewed certificates, and the
refusal of plaintext where other machines reach it."""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import shutil
import socket
import ssl
from collections.abc import Iterator

import httpx
import prometheus_client
import pytest

from tests.security.conftest import Certs
from tslice.common import errors
from tslice.security import identities, tls
from tslice.server import metrics_http

TOKEN = "scraper-token-0123456789"


def _app() -> metrics_http.WSGIApp:
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("probe", "A counter to see.", registry=registry).inc()
    return prometheus_client.make_wsgi_app(registry)


def _auth() -> identities.AuthSettings:
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    settings = identities.AuthSettings.from_mapping(
        {"tokens": [{"name": "scraper", "roles": [], "sha256": digest}]}
    )
    assert settings is not None
    return settings


@contextlib.contextmanager
def _serving(
    *, server_tls: tls.ServerTLS | None = None, auth_settings: identities.AuthSettings | None = None
) -> Iterator[str]:
    """The endpoint's URL while it serves."""
    server = metrics_http.serve(
        _app(),
        host="127.0.0.1",
        port=0,
        server="agent",
        server_tls=server_tls,
        auth_settings=auth_settings,
    )
    try:
        yield f"{server.scheme}://127.0.0.1:{server.port}/metrics"
    finally:
        server.stop()


def _client(
    ca: pathlib.Path, pair: tuple[pathlib.Path, pathlib.Path] | None = None
) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(ca))
    if pair is not None:
        context.load_cert_chain(str(pair[0]), str(pair[1]))
    return httpx.Client(verify=context, timeout=5)


def test_plaintext_on_loopback_serves_metrics_as_before() -> None:
    with _serving() as url:
        assert url.startswith("http://")
        assert "probe_total 1.0" in httpx.get(url, timeout=5).text


def test_plaintext_on_other_hosts_is_refused_unless_insecure() -> None:
    with pytest.raises(errors.ConfigError, match=r"agent's metrics on 0\.0\.0\.0 without TLS"):
        metrics_http.serve(_app(), host="0.0.0.0", port=0, server="agent")
    server = metrics_http.serve(_app(), host="0.0.0.0", port=0, server="agent", insecure=True)
    server.stop()


def test_https_with_the_server_certificate(certs: Certs) -> None:
    server_tls = tls.ServerTLS(cert=certs.server.cert, key=certs.server.key)
    with _serving(server_tls=server_tls) as url, _client(certs.ca.cert) as client:
        assert url.startswith("https://")
        assert "probe_total 1.0" in client.get(url).text
    with (
        _serving(server_tls=server_tls) as url,
        pytest.raises(httpx.ConnectError),
        httpx.Client(timeout=5) as untrusting,  # the system's roots do not know our CA
    ):
        untrusting.get(url)


def test_mutual_tls_requires_a_certificate_of_the_client_ca(
    certs: Certs, rogue_certs: Certs
) -> None:
    server_tls = tls.ServerTLS(
        cert=certs.server.cert, key=certs.server.key, client_ca=certs.ca.cert
    )
    admin, rogue = certs.client("admin"), rogue_certs.client("admin")
    with _serving(server_tls=server_tls, auth_settings=_auth()) as url:
        # The certificate's identity is a verified caller: no token needed.
        with _client(certs.ca.cert, (admin.cert, admin.key)) as client:
            assert client.get(url).status_code == 200
        for pair in (None, (rogue.cert, rogue.key)):
            with _client(certs.ca.cert, pair) as client, pytest.raises(httpx.TransportError):
                client.get(url)


def test_with_auth_a_scrape_needs_a_known_token() -> None:
    with _serving(auth_settings=_auth()) as url, httpx.Client(timeout=5) as client:
        anonymous = client.get(url)
        assert anonymous.status_code == 401
        assert "send 'Authorization: Bearer <token>'" in anonymous.text
        assert anonymous.headers["www-authenticate"].startswith("Bearer")
        wrong = client.get(url, headers={"Authorization": "Bearer not-the-token"})
        assert wrong.status_code == 401
        assert "the token presented is not known" in wrong.text
        good = client.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert good.status_code == 200
        assert "probe_total 1.0" in good.text


def test_renewed_certificate_files_are_served_to_new_connections(
    certs: Certs, rogue_certs: Certs, tmp_path: pathlib.Path
) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copy(certs.server.cert, cert)
    shutil.copy(certs.server.key, key)
    with _serving(server_tls=tls.ServerTLS(cert=cert, key=key)) as url:
        with _client(certs.ca.cert) as client:
            assert client.get(url).status_code == 200
        # Renewed as cert-manager does: new files renamed into place.
        for source, target in ((rogue_certs.server.cert, cert), (rogue_certs.server.key, key)):
            shutil.copy(source, target.with_suffix(".new"))
            target.with_suffix(".new").replace(target)
        with _client(rogue_certs.ca.cert) as client:
            assert client.get(url).status_code == 200


def test_a_silent_client_holds_up_no_other_scrape(certs: Certs) -> None:
    server_tls = tls.ServerTLS(cert=certs.server.cert, key=certs.server.key)
    with _serving(server_tls=server_tls) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)), _client(certs.ca.cert) as client:
            # Connected, no TLS hello sent: the handshake waits in that connection's thread.
            assert client.get(url).status_code == 200
