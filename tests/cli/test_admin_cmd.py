"""``tslice admin evict|drain|resume`` against a real local cluster (orchestrator and a
noop agent, processes on loopback): what they print, --json, and their exit codes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

import tslice.client as tsclient
from tests.cli.support import run_cli
from tests.orchestrator.admin_calls import acquire, orchestrator, status, waiting
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.cli import admin_cmd
from tslice.client import _admin
from tslice.sim import cluster

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def local() -> Iterator[cluster.LocalCluster]:
    with cluster.LocalCluster(agents=[cluster.SimAgent(name="node-1", backend="noop")]) as running:
        yield running


@pytest.fixture
def stub(local: cluster.LocalCluster) -> Iterator[opb_grpc.TimeSliceOrchestratorServiceStub]:
    with orchestrator(local) as made:
        yield made


def test_evict_prints_what_happened_and_refuses_a_job_that_is_nowhere(
    local: cluster.LocalCluster,
    stub: opb_grpc.TimeSliceOrchestratorServiceStub,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = local.orchestrator_address
    acquire(stub, "job-a", "cli-evict")
    pending = waiting(stub, "job-b", "cli-evict")
    code, out, _ = run_cli(
        capsys, "admin", "evict", "cli-evict", "job-a", "--reason", "hung", "--addr", address
    )
    assert code == 0, out
    assert (
        " ".join(out.split())
        == "job job-a evicted from group cli-evict (it held it; job-b is next)"
    )
    assert pending.result(timeout=TIMEOUT_S).success
    code, out, _ = run_cli(
        capsys, "admin", "evict", "cli-evict", "job-b", "--addr", address, "--json"
    )
    assert code == 0
    assert json.loads(out) == {
        "group_id": "cli-evict",
        "job_id": "job-b",
        "reason": "",
        "evictions": [{"group_id": "cli-evict", "role": "HOLDER", "next_job": ""}],
    }
    code, _, err = run_cli(capsys, "admin", "evict", "cli-evict", "job-b", "--addr", address)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1
    assert "job 'job-b' neither holds nor waits for group 'cli-evict'" in lines[0]
    code, _, err = run_cli(capsys, "admin", "evict", "cli-evict", "bad id!", "--addr", address)
    assert code == 2 and "job_id" in err


def test_drain_wait_exits_1_while_held_and_0_once_idle_and_resume_grants_the_waiter(
    local: cluster.LocalCluster,
    stub: opb_grpc.TimeSliceOrchestratorServiceStub,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = local.orchestrator_address
    acquire(stub, "job-a", "cli-drain")
    code, out, err = run_cli(
        capsys, "admin", "drain", "cli-drain", "--addr", address, "--wait", "--timeout", "0.5"
    )
    assert code == 1, out
    assert "group cli-drain is drained but still held by job-a after 0.5 s" in err
    # A waiting `drain --wait` returns once the holder yields.
    finished: list[tuple[int, str, str]] = []
    waiter = threading.Thread(
        target=lambda: finished.append(
            run_cli(capsys, "admin", "drain", "cli-drain", "--addr", address, "--wait", "--json")
        )
    )
    waiter.start()
    pending = waiting(stub, "job-b", "cli-drain")
    stub.Yield(opb.YieldRequest(job_id="job-a", group_id="cli-drain"), timeout=TIMEOUT_S)
    waiter.join(timeout=TIMEOUT_S)
    ((code, out, _),) = finished
    assert code == 0, out
    document = json.loads(out)
    assert document["idle"] and document["draining"] and document["was_draining"]
    assert document["locking_job"] == "" and not document["switching"]
    # Drained: the waiter stays queued, and `tslice status` says why.
    assert status(stub, "cli-drain").waiting_jobs == ["job-b"]
    code, out, _ = run_cli(capsys, "status", "cli-drain", "--addr", address)
    assert code == 0 and "draining" in out
    code, out, _ = run_cli(capsys, "admin", "resume", "cli-drain", "--addr", address)
    assert (
        code == 0
        and out.strip()
        == "group cli-drain resumed: grants turns again (held by job-b; 0 job(s) waiting)"
    )
    assert pending.result(timeout=TIMEOUT_S).success
    code, out, _ = run_cli(capsys, "admin", "resume", "cli-drain", "--addr", address)
    assert out.strip() == "group cli-drain was not drained; nothing changed"
    stub.Yield(opb.YieldRequest(job_id="job-b", group_id="cli-drain"), timeout=TIMEOUT_S)
    code, _, err = run_cli(capsys, "admin", "drain", "no-such-group", "--addr", address)
    assert code == 1 and "no-such-group" in err


def test_the_admin_commands_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "admin", "--help")
    assert code == 0
    for command in ("evict", "drain", "resume", "reset-fault"):
        assert command in out


def test_the_drain_wait_line_names_who_still_holds_the_group() -> None:
    line = admin_cmd._Line("g")
    assert line.view().plain.startswith("group g draining; waited ")
    line.latest = tsclient.GroupStatus(
        group_id="g",
        group_state=tsclient.GroupState.LOCKED,
        state_timestamp=None,
        locking_job="job-a",
        active_job="job-a",
        waiter_queue_depth=2,
        loaded_job="job-a",
    )
    assert line.view().plain.startswith(
        "group g draining: held by job-a; 2 job(s) waiting; waited "
    )
    busy = _admin.DrainState(True, False, "job-a", False, 2)
    assert "held by job-a until it yields" in admin_cmd.drained_view("g", busy, waited=False).plain
    waiter = _admin.Eviction("g", _admin.EvictedRole.WAITER)
    assert admin_cmd.evicted_view("j", [waiter]).plain == (
        "job j evicted from group g (it was waiting; its Acquire ended)"
    )
