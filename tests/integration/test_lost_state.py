"""Lost or damaged state, with real processes: ``python -m tslice orchestrator|agent``.

An orchestrator whose database was truncated to zero bytes (or deleted) starts again at
epoch 0 while the agents remember the grant epochs they saw; it must learn their marks
and go on past them instead of being refused as stale for ever. A database that is
garbage is refused at start with a message that names the file.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest

from tests.harness.servers import STOP_TIMEOUT_S, Server
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc


def _agent(tmp_path: pathlib.Path) -> Server:
    return Server(
        "agent",
        [
            "--node-name", "node-a",
            "--host", "127.0.0.1",
            "--port", "0",
            "--state-dir", str(tmp_path / "agent"),
            "--register-socket", str(tmp_path / "r.sock"),
            "--backend", "sim",
            "--sim-bandwidth", "1TB/s",
            "--sim-latency", "0",
        ],
        tmp_path / "agent.log",
    )  # fmt: skip


def _orchestrator(tmp_path: pathlib.Path, agent: str) -> Server:
    return Server(
        "orchestrator",
        [
            "--local-agent", f"node-a={agent}",
            "--host", "127.0.0.1",
            "--port", "0",
            "--metrics-port", "0",
            "--state-dir", str(tmp_path / "orch"),
            "--shutdown-grace", "1",
        ],
        tmp_path / "orchestrator.log",
    )  # fmt: skip


@pytest.fixture
def agent(tmp_path: pathlib.Path) -> Iterator[Server]:
    server = _agent(tmp_path)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _acquire(stub: opb_grpc.TimeSliceOrchestratorServiceStub, job: str) -> int:
    reply = stub.Acquire(opb.AcquireRequest(job_id=job, group_id="g"), timeout=30)
    assert reply.success
    return int(reply.grant_epoch)


def _yield(stub: opb_grpc.TimeSliceOrchestratorServiceStub, job: str) -> None:
    assert stub.Yield(opb.YieldRequest(job_id=job, group_id="g"), timeout=10).success


def _run_a_while(tmp_path: pathlib.Path, agent: Server) -> int:
    """An orchestrator that grants a few times and stops; the last grant epoch."""
    orch = _orchestrator(tmp_path, agent.address)
    try:
        with grpc.insecure_channel(orch.wait_ready()) as channel:
            stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
            epoch = 0
            for _ in range(3):
                for job in ("a", "b"):  # each grant switches: the agent records its epoch
                    epoch = _acquire(stub, job)
                    _yield(stub, job)
        assert orch.terminate() == 0, orch.logs()
        return epoch
    finally:
        orch.stop()


@pytest.mark.parametrize("loss", ["truncated", "deleted"])
def test_an_orchestrator_that_lost_its_database_grants_past_the_agents_marks(
    tmp_path: pathlib.Path, agent: Server, loss: str
) -> None:
    last = _run_a_while(tmp_path, agent)
    assert last >= 6
    db = tmp_path / "orch" / "orchestrator.db"
    if loss == "truncated":
        db.write_bytes(b"")
    else:
        for path in db.parent.glob("orchestrator.db*"):
            path.unlink()
    orch = _orchestrator(tmp_path, agent.address)
    try:
        with grpc.insecure_channel(orch.wait_ready()) as channel:
            stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
            epoch = _acquire(stub, "c")  # refused as stale first, then granted past the mark
            assert epoch > last, orch.logs()
            _yield(stub, "c")
            assert _acquire(stub, "a") == epoch + 1  # and the group goes on as usual
            status = stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"), timeout=10)
            assert status.group.locking_job == "a" and not status.group.degraded
        assert orch.terminate() == 0
    finally:
        orch.stop()


def _refused_at_start(server: Server) -> str:
    try:
        code = server.proc.wait(timeout=STOP_TIMEOUT_S * 4)
    finally:
        server.stop()
    assert code != 0, server.logs()
    return server.logs()


def test_a_corrupt_orchestrator_database_is_refused_at_start(
    tmp_path: pathlib.Path, agent: Server
) -> None:
    _run_a_while(tmp_path, agent)
    db = tmp_path / "orch" / "orchestrator.db"
    garbage = b"this is not a database\n" * 512
    db.write_bytes(garbage)
    logs = _refused_at_start(_orchestrator(tmp_path, agent.address))
    assert f"state database {db} is corrupt" in logs, logs
    assert db.read_bytes() == garbage  # nothing was overwritten


def test_a_corrupt_agent_database_is_refused_at_start(tmp_path: pathlib.Path) -> None:
    db = tmp_path / "agent" / "agent.sqlite3"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"\x00garbage" * 1000)
    logs = _refused_at_start(_agent(tmp_path))
    assert f"agent state database {db} is corrupt" in logs, logs
