"""TLS and mutual TLS on real orchestrator and agent processes, with ``tslice certs``'s
certificates: what a client without the right credentials is told, the orchestrator's
mutual-TLS channel to its agent, a renewed certificate served without a restart, and
the refusal of plaintext on a non-loopback address.
"""

from __future__ import annotations

import os
import pathlib

import grpc
import pytest

import tslice
from tests.harness.ports import closed_port
from tests.security.conftest import (
    Certs,
    SecureStack,
    agent_args,
    make_certs,
    orchestrator_args,
    serving,
    tls_args,
)
from tslice.cli import main
from tslice.client.compat import (
    SnapshotAgentClient,
    SnapshotAgentError,
    TimeSliceOrchestratorClient,
)
from tslice.common import errors
from tslice.security import certs as pki
from tslice.security import tls

#: A first connection that cannot happen fails after this (the default waits 5 s).
CONNECT_S = 1.0


@pytest.fixture
def mtls_stack(secure_stack: SecureStack) -> str:
    """The orchestrator's address: mutual TLS, and mutual TLS on to its agent."""
    return secure_stack.orchestrator


def _client(address: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> tslice.Client:
    for name in ("TSLICE_TLS_CA", "TSLICE_TLS_CERT", "TSLICE_TLS_KEY", "TSLICE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return tslice.Client(address, job_id="job-a", connect_timeout=CONNECT_S, lease_s=None)


def test_a_job_with_its_certificate_acquires_through_an_mtls_orchestrator_and_agent(
    mtls_stack: str, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _client(mtls_stack, monkeypatch, certs.env("job:job-a")) as client:
        granted = client.acquire("g")  # the switch called the agent over mutual TLS
        assert granted.success
        assert client.yield_("g").success


def test_a_plaintext_client_of_a_tls_server_is_told_to_set_the_ca(
    mtls_stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _client(mtls_stack, monkeypatch, {}) as client, pytest.raises(errors.Unavailable) as err:
        client.list_groups()
    assert "TSLICE_TLS_CA" in str(err.value), err.value


def test_a_client_without_a_certificate_is_refused_by_an_mtls_server(
    mtls_stack: str, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        _client(mtls_stack, monkeypatch, certs.env(None)) as client,
        pytest.raises(errors.Unavailable) as err,
    ):
        client.list_groups()
    assert "client certificate" in str(err.value) and "TSLICE_TLS_CERT" in str(err.value)


def test_a_certificate_of_another_ca_is_refused(
    mtls_stack: str, certs: Certs, rogue_certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    rogue = rogue_certs.client("admin")
    env = {**certs.env(None), "TSLICE_TLS_CERT": str(rogue.cert), "TSLICE_TLS_KEY": str(rogue.key)}
    with _client(mtls_stack, monkeypatch, env) as client, pytest.raises(errors.Unavailable):
        client.list_groups()


def _install(source: pki.Pair, target: pki.Pair) -> None:
    """As a renewal does: new files written aside, then renamed into place."""
    for src, dst in ((source.cert, target.cert), (source.key, target.key)):
        tmp = dst.with_suffix(".new")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)


def test_a_renewed_certificate_is_served_without_a_restart(
    tmp_path: pathlib.Path, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = pki.Pair(tmp_path / "served.pem", tmp_path / "served.key")
    _install(certs.server, served)
    renewed = make_certs(tmp_path / "renewed", identities=())  # another CA: told apart
    args = orchestrator_args(tmp_path, "127.0.0.1:9")
    tls = ["--tls-cert", str(served.cert), "--tls-key", str(served.key)]
    with serving("orchestrator", [*args, *tls], tmp_path / "o.log") as orch:
        with _client(orch.address, monkeypatch, certs.env(None)) as client:
            assert client.list_groups() == ()
        _install(renewed.server, served)
        with _client(orch.address, monkeypatch, renewed.env(None)) as client:
            assert client.list_groups() == ()  # the new certificate, same process
        old = _client(orch.address, monkeypatch, certs.env(None))
        with old, pytest.raises(errors.Unavailable):
            old.list_groups()  # the old one is no longer served
        assert orch.proc.poll() is None
        assert "TLS certificate reloaded" in orch.logs()


@pytest.mark.parametrize("kind", ["orchestrator", "agent"])
def test_plaintext_on_a_non_loopback_address_is_refused_naming_the_fix(
    kind: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = agent_args(tmp_path) if kind == "agent" else orchestrator_args(tmp_path, "127.0.0.1:9")
    args[args.index("--host") + 1] = "0.0.0.0"
    with pytest.raises(SystemExit) as exited:
        main.main([kind, *args])  # refused before anything starts: in-process is enough
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "without TLS" in lines[0] and "--tls-cert" in lines[0] and "--insecure" in lines[0]
    assert not (tmp_path / "orch").exists() and not (tmp_path / "agent").exists()


def test_insecure_on_a_non_loopback_address_is_served_when_asked_for(
    tmp_path: pathlib.Path,
) -> None:
    args = orchestrator_args(tmp_path, "127.0.0.1:9", "--insecure")
    args[args.index("--host") + 1] = "0.0.0.0"
    with serving("orchestrator", args, tmp_path / "o.log") as orch:
        assert "plaintext" in orch.logs()


def test_the_llm_d_compatible_clients_take_the_same_tls_settings(
    secure_stack: SecureStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in secure_stack.certs.env("job:job-a").items():
        monkeypatch.setenv(name, value)
    orchestrator = TimeSliceOrchestratorClient(secure_stack.orchestrator, job_id="job-a")
    with orchestrator:
        assert orchestrator.acquire(group_id="compat").success
        assert orchestrator.release(group_id="compat").success
    agent = SnapshotAgentClient(secure_stack.agent)
    try:
        assert any(job.job_id == "job-a" for job in agent.status().job_statuses)
        with pytest.raises(SnapshotAgentError) as err:  # a job's certificate moves nothing
            agent.snapshot(job_id="job-a", group="compat")
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        agent.close()


def test_the_orchestrator_takes_a_renewed_client_certificate_up_without_a_restart(
    tmp_path: pathlib.Path, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agents' trust moves to a new CA; the orchestrator's certificate is renewed under it.
    renewed = make_certs(tmp_path / "renewed", identities=("orchestrator",))
    trusted = tmp_path / "client-ca.pem"
    trusted.write_bytes(certs.ca.cert.read_bytes())
    mine = pki.Pair(tmp_path / "me.pem", tmp_path / "me.key")
    _install(certs.client("orchestrator"), mine)
    agent = agent_args(tmp_path, *tls_args(certs, mutual=False), "--tls-client-ca", str(trusted))
    agent[agent.index("--port") + 1] = port = str(closed_port())
    config = tmp_path / "orchestrator.yaml"
    config.write_text(
        f"agent_client: {{ca: {certs.ca.cert}, cert: {mine.cert}, key: {mine.key}}}\n"
    )
    orch = orchestrator_args(tmp_path, f"127.0.0.1:{port}", "--config", str(config))
    monkeypatch.delenv("TSLICE_TLS_CA", raising=False)
    with serving("orchestrator", orch, tmp_path / "o.log") as orchestrator:
        client = tslice.Client(orchestrator.address, job_id=None, lease_s=None)
        with serving("agent", agent, tmp_path / "a1.log"):
            client.acquire("g", job_id="job-a", timeout=30)
            client.yield_("g", job_id="job-a")
        trusted.write_bytes(renewed.ca.cert.read_bytes())  # the agent trusts the new CA only
        _install(renewed.client("orchestrator"), mine)
        with client, serving("agent", agent, tmp_path / "a2.log"):
            # The reconnect with the old certificate is refused: a new channel, new files.
            assert client.acquire("g", job_id="job-b", timeout=30).success
        assert "TLS files renewed" in orchestrator.logs()


async def test_a_client_given_its_security_needs_no_environment(
    secure_stack: SecureStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TSLICE_TLS_CA", "TSLICE_TLS_CERT", "TSLICE_TLS_KEY", "TSLICE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    pair, ca = secure_stack.certs.client("job:job-a"), secure_stack.certs.ca.cert
    security = tls.ClientSecurity(tls=tls.ClientTLS(ca=ca, cert=pair.cert, key=pair.key))
    async with tslice.AsyncClient(
        secure_stack.orchestrator, job_id="job-a", lease_s=None, security=security
    ) as client:
        assert (await client.acquire("given")).success
        assert (await client.yield_("given")).success
