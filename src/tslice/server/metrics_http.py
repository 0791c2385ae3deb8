"""The Prometheus endpoint of a server (``--metrics-port``), as protected as its gRPC port.

Standard library only (the job side imports ``tslice.common``): the caller passes the
WSGI app that renders its metrics (prometheus-client's ``make_wsgi_app``), served here
by a threaded WSGI server.

- TLS: with the server's ``--tls-cert``/``--tls-key`` the endpoint serves HTTPS with the
  same certificate; with ``--tls-client-ca`` a client must present a certificate signed
  by that CA (mutual TLS). Renewed files are picked up at the next connection, as on the
  gRPC port (the SSL context is rebuilt when a file changed).
- Authentication: with ``auth:`` a scrape needs a caller the server's verifier accepts
  (any role may read, as for the gRPC reads): a bearer token
  (``Authorization: Bearer <token>``) or, with mutual TLS, the client certificate's
  identity. Otherwise 401 with a one-line body naming what to send.
- Plaintext on a non-loopback host is refused unless ``--insecure``, as for gRPC.

The TLS handshake runs in the connection's own thread, under a timeout, so that a client
that connects and says nothing holds up no one else.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from tslice.common import errors
from tslice.security import identities, tls
from tslice.server import serving

log = logging.getLogger(__name__)

#: (environ, start_response) -> body: what prometheus-client's make_wsgi_app returns.
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: How long a connection may take over its TLS handshake, and over each read after it.
CONNECTION_TIMEOUT_S = 10.0
#: How often the serving loop looks for a stop request (how long a stop may take).
_STOP_POLL_S = 0.1
#: Where the handler leaves the identities of a verified client certificate.
_IDENTITIES = "tslice.identities"


class MetricsServer:
    """A running endpoint: :attr:`port` (the one bound), :meth:`stop`."""

    def __init__(self, httpd: _HTTPServer) -> None:
        self._httpd = httpd
        self.port = int(httpd.server_address[1])
        self._thread = threading.Thread(
            target=httpd.serve_forever, args=(_STOP_POLL_S,), name="metrics-http", daemon=True
        )
        self._thread.start()

    @property
    def scheme(self) -> str:
        return "http" if self._httpd.certificates is None else "https"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve(
    app: WSGIApp,
    *,
    host: str,
    port: int,
    server: str,
    server_tls: tls.ServerTLS | None = None,
    auth_settings: identities.AuthSettings | None = None,
    insecure: bool = False,
) -> MetricsServer:
    """Serve ``app`` on ``host:port`` (0: any free port) until :meth:`MetricsServer.stop`.

    ``server`` names the server in errors ("agent", "orchestrator"). Raises ConfigError
    (plaintext refused, unreadable certificate files, a bad tokens file) or InUseError.
    """
    tls.check_listen(host, tls=server_tls, insecure=insecure, what=f"{server}'s metrics")
    certificates = _Certificates(server_tls) if server_tls is not None else None
    if auth_settings is not None:
        app = _authenticated(app, auth_settings.build(), server)
    try:
        httpd = _HTTPServer((host, port), app, certificates)
    except OSError as err:
        raise serving.metrics_bind_error(host, port, err) from err
    return MetricsServer(httpd)


class _Certificates:
    """The SSL context of a :class:`tls.ServerTLS`, rebuilt when one of its files changed."""

    def __init__(self, server_tls: tls.ServerTLS) -> None:
        self._tls = server_tls
        self._paths = [p for p in (server_tls.cert, server_tls.key, server_tls.client_ca) if p]
        self._guard = threading.Lock()
        try:
            self._stamp = self._stamp_now()
            self._context = self._build()
        except (OSError, ssl.SSLError) as err:
            raise errors.ConfigError(
                f"cannot serve metrics over TLS: {err}; fix --tls-cert, --tls-key or "
                "--tls-client-ca (tls.cert, tls.key, tls.client_ca)"
            ) from err

    def _stamp_now(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in map(os.stat, self._paths))

    def _build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(certfile=self._tls.cert, keyfile=self._tls.key)
        if self._tls.client_ca is not None:
            context.load_verify_locations(cafile=self._tls.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def current(self) -> ssl.SSLContext:
        with self._guard:
            try:
                stamp = self._stamp_now()
                if stamp != self._stamp:
                    self._context, self._stamp = self._build(), stamp
                    log.info("metrics TLS certificate reloaded from %s", self._tls.cert)
            except (OSError, ssl.SSLError) as err:
                # Caught mid-renewal (a file missing for a moment): serve what we have.
                log.warning("metrics TLS files not reloaded, the current ones stay: %s", err)
            return self._context


def _identities(cert: dict[str, Any]) -> tuple[str, ...]:
    """The identities a verified client certificate names, as the gRPC port reads them:
    URI SANs ``tslice:<identity>``, else the common name."""
    prefix = identities.IDENTITY_SCHEME
    uris = tuple(
        value[len(prefix) :]
        for kind, value in cert.get("subjectAltName", ())
        if kind == "URI" and value.startswith(prefix)
    )
    if uris:
        return uris
    return tuple(v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName")


def _bearer(header: str) -> str | None:
    scheme, _, rest = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return rest.strip() or None


def _authenticated(app: WSGIApp, verifier: identities.Verifier, server: str) -> WSGIApp:
    """``app`` behind ``verifier``: any verified caller may read the metrics."""

    def refuse(start_response: Callable[..., Any], message: str) -> Iterable[bytes]:
        body = (message + "\n").encode()
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
                ("WWW-Authenticate", 'Bearer realm="tslice"'),
            ],
        )
        return [body]

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        presented = identities.Presented(
            token=_bearer(environ.get("HTTP_AUTHORIZATION", "")),
            identities=environ.get(_IDENTITIES, ()),
            peer=f"http:{environ.get('REMOTE_ADDR', '')}",
        )
        try:
            principal = verifier.verify(presented)
        except identities.Unauthenticated as err:
            log.warning("refused a metrics scrape from %s: %s", presented.peer, err)
            return refuse(
                start_response,
                f"{err} by the {server}: check the scraper's token (its bearer token "
                "file), or have its sha256 added to the server's auth.tokens",
            )
        if principal is None:
            return refuse(
                start_response,
                f"the {server}'s metrics require authentication: send 'Authorization: "
                "Bearer <token>' with a token of the server's auth.tokens, or a client "
                "certificate signed by its client CA",
            )
        return app(environ, start_response)

    return guarded


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        if isinstance(self.connection, ssl.SSLSocket):
            environ[_IDENTITIES] = _identities(self.connection.getpeercert() or {})
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class _HTTPServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scrape does not hold up the server's exit

    def __init__(
        self, address: tuple[str, int], app: WSGIApp, certificates: _Certificates | None
    ) -> None:
        host, port = address
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        self.address_family, _, _, _, sockaddr = infos[0]
        self.certificates = certificates
        super().__init__((str(sockaddr[0]), int(sockaddr[1])), _Handler)
        self.set_app(app)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = self.socket.accept()
        if self.certificates is not None:
            conn = self.certificates.current().wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
        return conn, address

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's thread: the handshake first, then the request."""
        request.settimeout(CONNECTION_TIMEOUT_S)
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except OSError as err:  # ssl.SSLError included: no certificate, a wrong CA...
                log.debug("metrics: TLS handshake with %s failed: %s", client_address, err)
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: a request from %s failed", client_address, exc_info=True)
