"""The agent over real gRPC: transitions, status codes, bytes, long-poll, grants, faults."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.agent.agent_doubles import BrokenBackend, FlakyBackend, GatedBackend, PickyBackend
from tests.agent.conftest import DEFAULT_FOOTPRINT, Agent, AgentRunner, GiB
from tslice.agent.backends import base, sim
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

COMPLETE = pb.OPERATION_STATUS_COMPLETE
FAILED = pb.OPERATION_STATUS_FAILED
PENDING = pb.OPERATION_STATUS_PENDING
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


# ---- the happy path, with real byte counts ------------------------------------------------------


async def test_grant_snapshot_restore_cycle_reports_measured_bytes(agent: Agent) -> None:
    assert await agent.grant("job-a", epoch=1) == pb.JOB_STATE_RUNNING
    status = await agent.stub.Status(pb.StatusRequest())
    assert status.node == "node-a"
    assert [(a.id, a.memory_used_bytes) for a in status.accelerator_statuses] == [
        ("sim0", DEFAULT_FOOTPRINT)
    ]
    assert status.accelerator_statuses[0].memory_total_bytes == 10 * GiB

    snap = await agent.snapshot("job-a")
    assert snap.status == COMPLETE
    assert snap.HasField("storage_bytes") and snap.HasField("snapshot_device_bytes")
    assert snap.storage_bytes == DEFAULT_FOOTPRINT
    assert snap.snapshot_device_bytes == DEFAULT_FOOTPRINT
    assert not snap.HasField("error")
    assert (snap.job_id, snap.kind) == ("job-a", "snapshot")
    job = (await agent.jobs())["job-a"]
    assert job.state == pb.JOB_STATE_SAVED
    assert (job.device_bytes, job.host_bytes, job.backend, job.group) == (
        0,
        DEFAULT_FOOTPRINT,
        "sim",
        "g",
    )

    back = await agent.restore("job-a")
    assert back.status == COMPLETE
    assert back.snapshot_device_bytes == DEFAULT_FOOTPRINT
    assert back.storage_bytes == 0
    job = (await agent.jobs())["job-a"]
    assert job.state == pb.JOB_STATE_RUNNING
    assert job.device_bytes == DEFAULT_FOOTPRINT
    assert job.operation_id  # the last operation stays visible for a restarted orchestrator


async def test_footprint_declared_at_grant_is_what_moves(agent: Agent) -> None:
    await agent.grant("job-a", footprint_bytes=GiB)
    snap = await agent.snapshot(
        "job-a",
        backend_config=pb.BackendConfig(sim=pb.SimBackendConfig()),
    )
    assert snap.snapshot_device_bytes == GiB
    assert snap.storage_bytes == GiB


async def test_restore_of_running_job_returns_a_pollable_complete_operation(agent: Agent) -> None:
    await agent.grant("job-a")
    reply = await agent.stub.Restore(pb.RestoreRequest(job_id="job-a", group="g"))
    assert reply.operation_id and reply.operation_id != "already-running"
    op = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=reply.operation_id))
    assert op.status == COMPLETE
    assert op.HasField("storage_bytes") and op.storage_bytes == 0
    assert op.HasField("snapshot_device_bytes") and op.snapshot_device_bytes == 0
    assert (await agent.jobs())["job-a"].operation_id == reply.operation_id


# ---- one operation per job, long-poll --------------------------------------------------------


async def test_concurrent_requests_are_aborted_and_wait_returns_on_completion(
    agents: AgentRunner,
) -> None:
    gated = GatedBackend()
    agent = await agents.start(default_backend="gated", instances={"gated": gated})
    assert await agent.grant("job-a") == pb.JOB_STATE_RUNNING
    first = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    await gated.started.wait()

    for call in (
        agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a")),
        agent.stub.Restore(pb.RestoreRequest(job_id="job-a")),
    ):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.ABORTED
        assert f"operation {first.operation_id} already running for job job-a" in err.details()
    # A Grant waits on the operation running on the job instead (here: until its wait_ms).
    busy = await agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g", wait_ms=20))
    assert not busy.granted and list(busy.operation_ids) == [first.operation_id]

    pending = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=first.operation_id))
    assert pending.status == PENDING
    assert not pending.HasField("storage_bytes") and not pending.HasField("error")
    assert pending.elapsed_ms >= 0
    assert await agent.state("job-a") == pb.JOB_STATE_TRANSITIONING

    short = await agent.wait(first.operation_id, timeout_ms=20)
    assert short.status == PENDING
    assert short.elapsed_ms >= 20  # live while pending

    started = time.monotonic()
    waiter = asyncio.ensure_future(agent.wait(first.operation_id, timeout_ms=30_000))
    gated.release()
    done = await waiter
    assert done.status == COMPLETE
    assert time.monotonic() - started < 10  # woken by the completion, not by its 30 s timeout
    assert await agent.state("job-a") == pb.JOB_STATE_SAVED


async def test_wait_on_a_finished_operation_returns_at_once(agent: Agent) -> None:
    await agent.grant("job-a")
    snap = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a"))
    first = await agent.wait(snap.operation_id)
    again = await agent.wait(snap.operation_id, timeout_ms=0)
    assert first.status == again.status == COMPLETE
    assert first.elapsed_ms == again.elapsed_ms  # frozen once finished


# ---- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "has space", "-leading", "x" * 300])
async def test_bad_job_ids_are_invalid_arguments(agent: Agent, bad: str) -> None:
    for call in (
        agent.stub.Snapshot(pb.SnapshotRequest(job_id=bad)),
        agent.stub.Restore(pb.RestoreRequest(job_id=bad)),
        agent.stub.Grant(pb.GrantRequest(job_id=bad, group="g")),
        agent.stub.ResetJob(pb.ResetJobRequest(job_id=bad)),
    ):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "job_id" in err.details()
    assert await agent.jobs() == {}


async def test_other_invalid_arguments(agent: Agent) -> None:
    cases = [
        agent.stub.Snapshot(pb.SnapshotRequest(job_id="a", group="bad group")),
        agent.stub.GetOperation(pb.GetOperationRequest()),
        agent.stub.WaitOperation(pb.WaitOperationRequest(operation_id="x", timeout_ms=-1)),
        agent.stub.Grant(pb.GrantRequest(job_id="a", group="g", grant_epoch=-1)),
        agent.stub.Grant(
            pb.GrantRequest(
                job_id="a",
                backend_config=pb.BackendConfig(sim=pb.SimBackendConfig(footprint_bytes=-5)),
            )
        ),
    ]
    for call in cases:
        assert (await rpc_error(call)).code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_operation_is_not_found_and_says_how_long_ops_are_kept(agent: Agent) -> None:
    for call in (
        agent.stub.GetOperation(pb.GetOperationRequest(operation_id="nope")),
        agent.stub.WaitOperation(pb.WaitOperationRequest(operation_id="nope", timeout_ms=10)),
    ):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert "kept for 24 hours" in err.details()


async def test_state_refusals_create_nothing(agent: Agent) -> None:
    err = await rpc_error(agent.stub.Snapshot(pb.SnapshotRequest(job_id="ghost", group="g")))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "job ghost (group g) is not known on node node-a" in err.details()
    # A typo with a backend named explicitly creates no phantom either.
    sim = pb.BackendConfig(sim=pb.SimBackendConfig())
    err = await rpc_error(
        agent.stub.Snapshot(pb.SnapshotRequest(job_id="ghost", group="g", backend_config=sim))
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = await rpc_error(agent.stub.Restore(pb.RestoreRequest(job_id="ghost")))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = await rpc_error(agent.stub.ResetJob(pb.ResetJobRequest(job_id="ghost")))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert await agent.jobs() == {}

    await agent.grant("job-a")
    await agent.snapshot("job-a")
    err = await rpc_error(agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already SAVED" in err.details()
    err = await rpc_error(agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "restore it first" in err.details()
    err = await rpc_error(agent.stub.ResetJob(pb.ResetJobRequest(job_id="job-a")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not FAULTED" in err.details()


# ---- backend choice -----------------------------------------------------------------------------


async def test_backend_not_enabled_or_not_supported(agent: Agent) -> None:
    cases = {
        "--backend cuda": pb.SnapshotRequest(
            job_id="a", backend_config=pb.BackendConfig(cuda=pb.CudaBackendConfig())
        ),
        "--backend cuda ": pb.SnapshotRequest(job_id="a", backend=pb.BACKEND_CUDA),
        "not supported by this agent": pb.SnapshotRequest(
            job_id="a",
            backend_config=pb.BackendConfig(direct_memory=pb.DirectMemoryBackendConfig()),
        ),
    }
    for words, request in cases.items():
        err = await rpc_error(agent.stub.Snapshot(request))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert words.strip() in err.details()
    assert await agent.jobs() == {}


async def test_explicit_config_is_recorded_and_restore_must_use_the_same_backend(
    agents: AgentRunner,
) -> None:
    agent = await agents.start(backends=["noop", "sim"], default_backend="sim")
    noop = pb.BackendConfig(noop=pb.NoopBackendConfig())
    await agent.grant("outside", backend_config=noop)
    snap = await agent.snapshot("outside", backend_config=noop)
    assert snap.status == COMPLETE
    assert (snap.storage_bytes, snap.snapshot_device_bytes) == (0, 0)
    job = (await agent.jobs())["outside"]
    assert (job.state, job.backend) == (pb.JOB_STATE_SAVED, "noop")

    # Restore must go to the backend that saved; no config reuses it.
    err = await rpc_error(
        agent.stub.Restore(
            pb.RestoreRequest(
                job_id="outside", backend_config=pb.BackendConfig(sim=pb.SimBackendConfig())
            )
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "held by backend noop" in err.details()
    assert (await agent.restore("outside")).status == COMPLETE
    assert (await agent.jobs())["outside"].backend == "noop"


async def test_a_job_the_backend_holds_is_adopted_by_a_snapshot(agents: AgentRunner) -> None:
    # The device holds the job although the agent has no record (a lost agent database).
    backend = sim.SimBackend(node="node-a", capacity_bytes=10 * GiB, latency_s=0.0)
    backend.node.allocate(job="stray", group="g", bytes_per_device=GiB)
    agent = await agents.start(default_backend="sim", instances={"sim": backend})
    snap = await agent.snapshot("stray", group="g")
    assert snap.status == COMPLETE
    assert snap.snapshot_device_bytes == GiB
    job = (await agent.jobs())["stray"]
    assert (job.state, job.group) == (pb.JOB_STATE_SAVED, "g")


async def test_backend_validation_refuses_before_anything_changes(agents: AgentRunner) -> None:
    picky = PickyBackend()
    agent = await agents.start(default_backend="picky", instances={"picky": picky})
    picky.refusal = base.InvalidBackendConfigError("pid 7 is not a process of this node")
    err = await rpc_error(agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "pid 7 is not a process of this node"
    assert await agent.jobs() == {}

    picky.refusal = None
    await agent.grant("job-a")
    picky.refusal = base.BackendConfigRefusedError("endpoint host not in the allow-list")
    err = await rpc_error(agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "allow-list" in err.details()
    picky.refusal = RuntimeError("bug")
    err = await rpc_error(agent.stub.Restore(pb.RestoreRequest(job_id="job-a")))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "nothing was changed" in err.details()
    job = (await agent.jobs())["job-a"]
    assert job.state == pb.JOB_STATE_RUNNING


# ---- grants -------------------------------------------------------------------------------------


async def test_grant_epochs_and_the_same_group_safety_net(agent: Agent) -> None:
    assert await agent.grant("job-a", epoch=3) == pb.JOB_STATE_RUNNING
    assert await agent.grant("job-a", epoch=3) == pb.JOB_STATE_RUNNING  # retried grant: no-op

    err = await rpc_error(
        agent.stub.Grant(pb.GrantRequest(job_id="job-b", group="g", grant_epoch=2))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale" in err.details()

    err = await rpc_error(
        agent.stub.Grant(pb.GrantRequest(job_id="job-b", group="g", grant_epoch=4))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "job job-a of group g is RUNNING" in err.details()
    assert "job-b" not in await agent.jobs()

    await agent.snapshot("job-a")
    assert await agent.grant("job-b", epoch=4) == pb.JOB_STATE_RUNNING
    err = await rpc_error(agent.stub.Restore(pb.RestoreRequest(job_id="job-a", group="g")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "job job-b of group g is RUNNING" in err.details()
    assert await agent.state("job-a") == pb.JOB_STATE_SAVED


async def test_capacity_overflow_is_a_clear_error_and_changes_nothing(agent: Agent) -> None:
    # Different groups, so the safety net does not apply: the device itself refuses.
    six = 6 * GiB
    await agent.grant("job-a", group="g1", footprint_bytes=six)
    # The Grant replies not granted, with the FAILED activation and its reason.
    reply = await agent.stub.Grant(pb.GrantRequest(job_id="job-b", group="g2", footprint_bytes=six))
    assert not reply.granted
    (failed,) = reply.operations
    assert failed.status == FAILED
    assert "activation of job job-b (group g2) on sim0" in failed.error
    assert f"{six} of {10 * GiB} in use by job job-a of group g1" in failed.error
    assert "nothing was changed" in failed.error
    # Nothing landed, so nothing is FAULTED: the grant can simply be retried later.
    assert await agent.state("job-b") == pb.JOB_STATE_IDLE

    await agent.snapshot("job-a", group="g1")
    assert await agent.grant("job-b", group="g2", footprint_bytes=six) == pb.JOB_STATE_RUNNING
    back = await agent.restore("job-a", group="g1")
    assert back.status == FAILED
    assert "restore of job job-a (group g1) on sim0" in back.error
    assert "in use by job job-b" in back.error
    # The saved copy is intact and the job still SAVED: it restores once there is room.
    assert await agent.state("job-a") == pb.JOB_STATE_SAVED
    await agent.snapshot("job-b", group="g2")
    assert (await agent.restore("job-a", group="g1")).status == COMPLETE


async def test_a_footprint_that_can_never_fit_is_refused_at_once(agent: Agent) -> None:
    err = await rpc_error(
        agent.stub.Grant(pb.GrantRequest(job_id="huge", group="g", footprint_bytes=11 * GiB))
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"each device of node node-a holds only {10 * GiB}" in err.details()
    assert await agent.jobs() == {}


# ---- failures -----------------------------------------------------------------------------------


async def test_injected_failure_faults_then_reset_and_snapshot_work(agents: AgentRunner) -> None:
    backend = sim.SimBackend(
        node="node-a",
        capacity_bytes=10 * GiB,
        bandwidth_bytes_per_s=10**12,
        latency_s=0.0,
        fail_probability=1.0,
    )
    agent = await agents.start(instances={"sim": backend})
    await agent.grant("job-a")
    snap = await agent.snapshot("job-a")
    assert snap.status == FAILED
    assert "injected failure" in snap.error
    job = (await agent.jobs())["job-a"]
    assert job.state == pb.JOB_STATE_FAULTED
    assert "injected failure" in job.error

    backend.fail_probability = 0.0
    reset = await agent.stub.ResetJob(pb.ResetJobRequest(job_id="job-a"))
    assert reset.state == pb.JOB_STATE_RUNNING  # a failed snapshot moved nothing
    assert (await agent.jobs())["job-a"].error == ""
    assert (await agent.snapshot("job-a")).status == COMPLETE


async def test_faulted_job_can_be_retried_when_the_backend_says_it_runs(
    agents: AgentRunner,
) -> None:
    backend = sim.SimBackend(
        node="node-a", capacity_bytes=10 * GiB, bandwidth_bytes_per_s=10**12, fail_probability=1.0
    )
    agent = await agents.start(instances={"sim": backend})
    await agent.grant("job-a")
    assert (await agent.snapshot("job-a")).status == FAILED
    backend.fail_probability = 0.0
    assert (await agent.snapshot("job-a")).status == COMPLETE  # no ResetJob needed
    assert await agent.state("job-a") == pb.JOB_STATE_SAVED


async def test_hang_hits_the_operation_deadline(agents: AgentRunner) -> None:
    agent = await agents.start(operation_timeout_s=0.3, sim={"hang_probability": 1.0})
    await agent.grant("job-a")
    snap = await agent.snapshot("job-a")
    assert snap.status == FAILED
    assert "did not finish within 0.3 s" in snap.error
    assert await agent.state("job-a") == pb.JOB_STATE_FAULTED
    reset = await agent.stub.ResetJob(pb.ResetJobRequest(job_id="job-a"))
    assert reset.state == pb.JOB_STATE_RUNNING


async def test_transient_errors_are_retried_inside_the_deadline(agents: AgentRunner) -> None:
    flaky = FlakyBackend(failures=2)
    agent = await agents.start(
        default_backend="flaky", instances={"flaky": flaky}, operation_timeout_s=5
    )
    await agent.grant("job-a")
    assert (await agent.snapshot("job-a")).status == COMPLETE
    assert flaky.attempts == 3


async def test_transient_errors_past_the_deadline_change_nothing(agents: AgentRunner) -> None:
    agent = await agents.start(
        default_backend="flaky",
        instances={"flaky": FlakyBackend(failures=10**6)},
        operation_timeout_s=0.2,
    )
    await agent.grant("job-a")
    snap = await agent.snapshot("job-a")
    assert snap.status == FAILED
    assert "nothing was changed" in snap.error
    job = (await agent.jobs())["job-a"]
    assert (job.state, job.error) == (pb.JOB_STATE_RUNNING, "")


# ---- health, channel ----------------------------------------------------------------------------


async def test_health_for_default_backends_and_unknown(agents: AgentRunner) -> None:
    broken = BrokenBackend(error=KeyError("bug"), healthy=False)
    agent = await agents.start(instances={"broken": broken})
    for service in ("", "sim"):
        reply = await agent.health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == SERVING
    reply = await agent.health.Check(health_pb2.HealthCheckRequest(service="broken"))
    assert reply.status == NOT_SERVING
    err = await rpc_error(agent.health.Check(health_pb2.HealthCheckRequest(service="nope")))
    assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_backend_crash_faults_the_job_with_a_readable_error(agents: AgentRunner) -> None:
    agent = await agents.start(
        default_backend="broken", instances={"broken": BrokenBackend(error=KeyError("bug"))}
    )
    await agent.grant("job-a")
    snap = await agent.snapshot("job-a")
    assert snap.status == FAILED
    assert snap.error == "snapshot of job job-a by backend broken crashed: KeyError: 'bug'"
    assert await agent.state("job-a") == pb.JOB_STATE_FAULTED
    # The backend cannot tell what happened, so reset makes the job IDLE.
    assert (
        await agent.stub.ResetJob(pb.ResetJobRequest(job_id="job-a"))
    ).state == pb.JOB_STATE_IDLE


async def test_unavailable_backend_flips_its_health(agents: AgentRunner) -> None:
    error = base.BackendUnavailableError("driver unloaded")
    agent = await agents.start(
        default_backend="broken", instances={"broken": BrokenBackend(error=error)}
    )
    check = health_pb2.HealthCheckRequest(service="broken")
    assert (await agent.health.Check(check)).status == SERVING
    await agent.grant("job-a")
    snap = await agent.snapshot("job-a")
    assert "driver unloaded" in snap.error
    assert (await agent.health.Check(check)).status == NOT_SERVING
    assert (await agent.health.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
