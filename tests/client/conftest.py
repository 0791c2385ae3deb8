"""Fixtures of the client tests: a real orchestrator (see servers.py) and, for the
SnapshotAgentClient's tests only, the agent double of client_fakes.py."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from concurrent import futures

import pytest

from tests.client.client_fakes import FakeAgent, ServerThread
from tests.client.servers import Orchestrator, Script, running_orchestrator
from tslice.client import _base

ENV_VARS = (
    "TSLICE_ORCHESTRATOR",
    "TIMESLICE_ORCH_ADDR",
    "TSLICE_JOB_ID",
    "TIMESLICE_JOB_ID",
    "SLURM_JOB_ID",
    "TSLICE_GROUP",
    "TSLICE_DISABLED",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no client configuration unless they set it themselves."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_base, "_noop_announced", set())


@pytest.fixture
def orchestrator(tmp_path: pathlib.Path) -> Iterator[Orchestrator]:
    """A real orchestrator with groups g, a and b, scripted (see servers.Scripted)."""
    yield from running_orchestrator(tmp_path, Script())


@pytest.fixture
def llm_d_orchestrator(tmp_path: pathlib.Path) -> Iterator[Orchestrator]:
    """The same, without the Session RPC (as llm-d's orchestrator, or tslice before it)."""
    yield from running_orchestrator(tmp_path, Script(llm_d=True))


@pytest.fixture
def server_thread() -> Iterator[ServerThread]:
    thread = ServerThread()
    try:
        yield thread
    finally:
        thread.close()


@pytest.fixture
def agent(server_thread: ServerThread) -> ServerThread:
    """A running :class:`FakeAgent` (with WaitOperation and gRPC health)."""
    server_thread.start(FakeAgent())
    return server_thread


@pytest.fixture
def executor() -> Iterator[futures.ThreadPoolExecutor]:
    """Threads for blocking client calls that must run while the test goes on."""
    pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="client-call")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
