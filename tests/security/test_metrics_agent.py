"""An agent's Prometheus endpoint, end to end (``python -m tslice agent``): as protected
as its gRPC port. One agent serves TLS with ``auth:`` on, another mutual TLS."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import ssl
from collections.abc import Iterator

import httpx
import pytest

from tests.harness.ports import closed_port
from tests.security.conftest import Certs, agent_args, orchestrator_args, serving_all, tls_args

TOKEN = "scraper-token-0123456789"


@dataclasses.dataclass(frozen=True)
class Agents:
    #: The metrics URLs of the agent with TLS and ``auth:``, and of the one with mutual TLS.
    with_auth: str
    mutual: str


@pytest.fixture(scope="module")
def agents(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    state = tmp_path_factory.mktemp("metrics")
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    config = state / "agent.yaml"
    config.write_text(f"auth: {{tokens: [{{name: scraper, roles: [], sha256: {digest}}}]}}\n")
    ports = closed_port(), closed_port()
    servers = [
        (
            "agent",
            agent_args(
                state / name,
                "--metrics-port", str(port),
                *(["--config", str(config)] if name == "auth" else []),
                *tls_args(certs, mutual=name == "mutual"),
            ),
            state / f"{name}.log",
        )
        for name, port in zip(("auth", "mutual"), ports, strict=True)
    ]  # fmt: skip
    with serving_all(servers):
        yield Agents(*(f"https://127.0.0.1:{port}/metrics" for port in ports))


def _client(certs: Certs, identity: str | None = None) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(certs.ca.cert))
    if identity is not None:
        pair = certs.client(identity)
        context.load_cert_chain(str(pair.cert), str(pair.key))
    return httpx.Client(verify=context, timeout=5)


def test_a_scrape_needs_a_token_the_agent_knows(agents: Agents, certs: Certs) -> None:
    with _client(certs) as client:
        anonymous = client.get(agents.with_auth)
        assert anonymous.status_code == 401
        assert "the agent's metrics require authentication" in anonymous.text
        wrong = client.get(agents.with_auth, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        good = client.get(agents.with_auth, headers={"Authorization": f"Bearer {TOKEN}"})
    assert good.status_code == 200
    assert "tslice_agent_jobs" in good.text


def test_metrics_are_not_served_in_plaintext_beside_tls(agents: Agents) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(agents.with_auth.replace("https:", "http:"), timeout=5)


def test_mutual_tls_refuses_a_client_without_a_certificate(agents: Agents, certs: Certs) -> None:
    with _client(certs) as client, pytest.raises(httpx.TransportError):
        client.get(agents.mutual)
    with _client(certs, "admin") as client:
        assert "tslice_agent_jobs" in client.get(agents.mutual).text


def test_orchestrator_metrics_need_a_token(certs: Certs, tmp_path: pathlib.Path) -> None:
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    config = tmp_path / "orchestrator.yaml"
    config.write_text(f"auth: {{tokens: [{{name: scraper, roles: [], sha256: {digest}}}]}}\n")
    port = closed_port()
    args = orchestrator_args(
        tmp_path,
        f"127.0.0.1:{closed_port()}",
        "--config",
        str(config),
        *tls_args(certs, mutual=False),
    )
    args[args.index("--metrics-port") + 1] = str(port)
    url = f"https://127.0.0.1:{port}/metrics"
    with serving_all([("orchestrator", args, tmp_path / "orch.log")]), _client(certs) as client:
        assert client.get(url).status_code == 401
        good = client.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert good.status_code == 200
    assert "tslice_" in good.text
