"""TLS from the job side's own install (the floor venv: oldest grpcio and protobuf, no
``cryptography``): a sync and an async client list the groups of an orchestrator serving
mutual TLS with authentication on, presenting a client certificate and a token; a
workload registers over TCP with an agent serving mutual TLS. Only environment variables
configure them, as in a job process. The certificates are made by ``tslice certs`` in
the server Python (stack.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import tslice
from tests.jobside.stack import Stack, make_certs, running_stack
from tslice.workload import register_workload

JOB = "job-a"
TOKEN = "job-a-token-of-the-tls-stack"
WAIT_S = 30.0
_VARIABLES = ("TSLICE_TLS_CA", "TSLICE_TLS_CERT", "TSLICE_TLS_KEY", "TSLICE_TOKEN")


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Both servers: mutual TLS on TCP, ``auth:`` on, one job token (job-a's)."""
    directory = tmp_path_factory.mktemp("tls-stack")
    certs = make_certs(directory / "certs", clients=[f"job:{JOB}"])
    with running_stack(directory, groups=("trainer",), tls=certs, tokens={JOB: TOKEN}) as running:
        yield running


@pytest.fixture
def job_env(tls_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """What a job process of job-a has: the CA, its certificate and its token."""
    env = tls_stack.env(JOB)
    for name in _VARIABLES:
        monkeypatch.setenv(name, env[name])
    return monkeypatch


def test_sync_and_async_clients_list_groups_over_mutual_tls_with_a_token(
    tls_stack: Stack, job_env: pytest.MonkeyPatch
) -> None:
    with tslice.Client(tls_stack.address, job_id=JOB) as client:
        assert list(client.list_groups()) == ["trainer"], tls_stack.logs()

    async def listed() -> list[str]:
        async with tslice.AsyncClient(tls_stack.address, job_id=JOB) as client:
            return list(await client.list_groups())

    assert asyncio.run(listed()) == ["trainer"], tls_stack.logs()


def test_the_token_is_what_the_orchestrator_checks(
    tls_stack: Stack, job_env: pytest.MonkeyPatch
) -> None:
    """An unknown token is refused although the certificate is good: the token was sent."""
    job_env.setenv("TSLICE_TOKEN", "not-a-token-the-stack-knows")
    with (
        tslice.Client(tls_stack.address, job_id=JOB) as client,
        pytest.raises(tslice.RPCError) as err,
    ):
        client.list_groups()
    assert "token presented is not known" in str(err.value), err.value


def test_a_workload_registers_over_tcp_with_a_mutual_tls_agent(
    tls_stack: Stack, job_env: pytest.MonkeyPatch
) -> None:
    with register_workload(
        tls_stack.agent_address,
        JOB,
        group="trainer",
        on_snapshot=lambda mode, tags: None,
        on_restore=lambda tags: None,
    ) as handle:
        assert handle.wait_registered(WAIT_S), (handle.error, tls_stack.logs())
