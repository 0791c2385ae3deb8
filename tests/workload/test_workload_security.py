"""A workload registers over TCP with a real agent process that serves TLS and has
``auth:`` on, with the job side's own settings ($TSLICE_TLS_CA, $TSLICE_TOKEN, or
``security=``): its job's token is admitted, another job's is refused (PERMISSION_DENIED),
none at all is refused (UNAUTHENTICATED); both refusals are final. Over the agent's Unix
socket no TLS is used, whatever the TLS variables say.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import tempfile
from collections.abc import Iterator

import pytest

from tests.security.conftest import Certs, agent_args, make_certs, serving, tls_args
from tslice.security import tls
from tslice.workload import WorkloadHandle, register_workload

TOKENS = {"job-a": "job-a-workload-token-0123", "job-b": "job-b-workload-token-4567"}
#: Generous: the agent answers in milliseconds; a loaded machine may take seconds.
WAIT_S = 20.0


@dataclasses.dataclass(frozen=True)
class TlsAgent:
    address: str
    unix: str
    register_socket: pathlib.Path
    certs: Certs


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsAgent]:
    """An agent serving TLS (not mutual: tokens say who calls) with authentication on."""
    state = tmp_path_factory.mktemp("tls-agent")
    certs = make_certs(state / "certs", identities=())
    tokens = state / "tokens.yaml"
    tokens.write_text(
        "tokens:\n"
        + "".join(
            f"  - {{name: {job}, roles: [job], jobs: [{job}], "
            f"sha256: {hashlib.sha256(token.encode()).hexdigest()}}}\n"
            for job, token in TOKENS.items()
        )
    )
    config = state / "agent.yaml"
    config.write_text(f"auth: {{tokens_file: {tokens}}}\n")
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="tslice-wl-"))  # short Unix socket paths
    args = agent_args(
        state,
        "--config", str(config),
        "--unix-socket", str(sockets / "agent.sock"),
        *tls_args(certs, mutual=False),
    )  # fmt: skip
    with serving("agent", args, state / "agent.log") as agent:
        yield TlsAgent(agent.address, f"unix:{sockets / 'agent.sock'}", state / "r.sock", certs)


@pytest.fixture
def job_env(tls_agent: TlsAgent, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The agent's CA in $TSLICE_TLS_CA, no token yet."""
    for name in (tls.TLS_CERT_ENV, tls.TLS_KEY_ENV, tls.TOKEN_ENV, tls.TOKEN_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(tls.TLS_CA_ENV, str(tls_agent.certs.ca.cert))
    return monkeypatch


def _register(agent: str, job: str, **options: object) -> WorkloadHandle:
    return register_workload(
        agent,
        job,
        on_snapshot=lambda mode, tags: None,
        on_restore=lambda tags: None,
        backoff_initial_s=0.1,
        **options,  # type: ignore[arg-type]
    )


def test_a_workload_with_its_jobs_token_registers_over_tls(
    tls_agent: TlsAgent, job_env: pytest.MonkeyPatch
) -> None:
    job_env.setenv(tls.TOKEN_ENV, TOKENS["job-a"])
    with _register(tls_agent.address, "job-a") as handle:
        assert handle.wait_registered(WAIT_S), handle.error


def test_security_given_to_register_workload_wins_over_the_environment(
    tls_agent: TlsAgent, job_env: pytest.MonkeyPatch
) -> None:
    job_env.delenv(tls.TLS_CA_ENV)  # the environment alone could not even connect
    security = tls.ClientSecurity(
        tls=tls.ClientTLS(ca=tls_agent.certs.ca.cert),
        token=tls.TokenSource(token=TOKENS["job-b"]),
    )
    with _register(tls_agent.address, "job-b", security=security) as handle:
        assert handle.wait_registered(WAIT_S), handle.error


def test_another_jobs_token_is_refused_for_good(
    tls_agent: TlsAgent, job_env: pytest.MonkeyPatch
) -> None:
    job_env.setenv(tls.TOKEN_ENV, TOKENS["job-b"])
    with _register(tls_agent.address, "job-a") as handle:
        assert handle.wait_stopped(WAIT_S)  # final: PERMISSION_DENIED is not retried
        assert not handle.registered
    assert handle.error is not None
    assert "refused the registration of job 'job-a'" in handle.error, handle.error
    assert "not 'job-a'" in handle.error and "job-b" in handle.error, handle.error


def test_no_token_is_refused_naming_how_to_authenticate(
    tls_agent: TlsAgent, job_env: pytest.MonkeyPatch
) -> None:
    with _register(tls_agent.address, "job-a") as handle:
        assert handle.wait_stopped(WAIT_S)  # final: UNAUTHENTICATED is not retried
    assert handle.error is not None
    assert "requires authentication" in handle.error, handle.error
    assert tls.TOKEN_ENV in handle.error, handle.error


def test_over_the_unix_socket_the_tls_variables_are_not_applied(
    tls_agent: TlsAgent, job_env: pytest.MonkeyPatch
) -> None:
    """The socket is plaintext: a TLS channel there would never connect."""
    job_env.setenv(tls.TOKEN_ENV, TOKENS["job-a"])
    with _register(tls_agent.unix, "job-a", register_socket=tls_agent.register_socket) as handle:
        assert handle.wait_registered(WAIT_S), (handle.error, handle.bind_error)
