"""The llm-d drop-in classes: TimeSliceOrchestratorClient against a real orchestrator
(ours, and one without Session as llm-d's), SnapshotAgentClient against the agent
double (its operations finish when a test says so)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import tslice
from tests.client.client_fakes import FakeAgent, ServerThread
from tests.client.servers import Orchestrator
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.client import compat
from tslice.common import errors

# -- TimeSliceOrchestratorClient ------------------------------------------------------------


@pytest.fixture
def orch_client(orchestrator: Orchestrator) -> Iterator[compat.TimeSliceOrchestratorClient]:
    with compat.TimeSliceOrchestratorClient(orchestrator.address, job_id="me", group_id="g") as c:
        yield c


def test_acquire_release_status_list(
    orch_client: compat.TimeSliceOrchestratorClient, orchestrator: Orchestrator
) -> None:
    acquired = orch_client.acquire()
    assert (acquired.success, acquired.context_restored) == (True, False)
    status = orch_client.get_status()
    assert isinstance(status, compat.OrchestratorGroupStatus)
    assert status.group.group_state is compat.GroupLockState.LOCKED
    assert status.group.locking_job == "me"
    assert [s.job_state for s in status.agent_job_states] == [compat.AgentJobState.RUNNING]
    assert isinstance(status.agent_job_states, list)
    assert orch_client.list_groups() == ["a", "b", "g"]
    released = orch_client.release()
    assert (released.success, released.pending_waiters, released.snapshot_deferred) == (
        True,
        0,
        True,
    )
    assert orchestrator.holder("g") == ""


def test_against_an_llm_d_orchestrator_it_makes_llm_d_s_unary_calls(
    llm_d_orchestrator: Orchestrator,
) -> None:
    with (
        compat.TimeSliceOrchestratorClient(llm_d_orchestrator.address, "me", "g") as client,
        client.on_accelerators() as granted,
    ):
        assert granted.success and llm_d_orchestrator.holder("g") == "me"
    assert llm_d_orchestrator.lock_calls() == [("Acquire", "g"), ("Yield", "g")]
    assert {c.via for c in llm_d_orchestrator.script.calls} == {"unary"}


def test_ids_come_from_the_call_then_the_constructor(
    orch_client: compat.TimeSliceOrchestratorClient, orchestrator: Orchestrator
) -> None:
    orch_client.acquire(job_id="other", group_id="a")
    assert orchestrator.holder("a") == "other"
    orch_client.job_id = "changed"
    orch_client.acquire(group_id="b")
    assert orchestrator.holder("b") == "changed"


def test_missing_ids_are_value_errors(orchestrator: Orchestrator) -> None:
    with compat.TimeSliceOrchestratorClient(orchestrator.address) as client:
        with pytest.raises(ValueError, match="job_id must be given"):
            client.acquire(group_id="g")
        with pytest.raises(ValueError, match="group_id must be given"):
            client.release(job_id="me")


def test_on_accelerators_as_block_and_decorator(
    orch_client: compat.TimeSliceOrchestratorClient, orchestrator: Orchestrator
) -> None:
    with orch_client.on_accelerators() as result:
        assert result.success and orchestrator.holder("g") == "me"
    assert orchestrator.holder("g") == ""

    @orch_client.on_accelerators(group_id="a")
    def work(x: int) -> str:
        return f"{x}:{orchestrator.holder('a')}"

    assert work(1) == "1:me"
    assert work(2) == "2:me"
    assert orchestrator.holder("a") == ""


def test_on_accelerators_releases_when_the_block_raises(
    orch_client: compat.TimeSliceOrchestratorClient, orchestrator: Orchestrator
) -> None:
    with pytest.raises(ZeroDivisionError), orch_client.on_accelerators():
        _ = 1 / 0
    assert orchestrator.holder("g") == ""


def test_acquire_timeout_is_an_llm_d_timeout_error_and_a_tslice_one(
    orch_client: compat.TimeSliceOrchestratorClient, orchestrator: Orchestrator
) -> None:
    with tslice.Client(orchestrator.address, job_id="other", lease_s=None) as other:
        other.acquire("g")
        with pytest.raises(compat.OrchestratorTimeoutError) as caught:
            orch_client.acquire(timeout_sec=0.2)
    err = caught.value
    assert isinstance(err, compat.OrchestratorError)
    assert isinstance(err, tslice.DeadlineExceeded)
    assert isinstance(err.__cause__, tslice.AcquireTimeout)
    assert err.group_id == "g" and err.waited_ms >= 200  # type: ignore[attr-defined]
    assert str(err) == err.message  # llm-d errors print their bare message
    orchestrator.until(lambda: orchestrator.waiting("g") == ())


@pytest.mark.parametrize(
    ("code", "llm_d", "ours"),
    [
        (grpc.StatusCode.NOT_FOUND, compat.OrchestratorNotFoundError, errors.NotFound),
        (
            grpc.StatusCode.PERMISSION_DENIED,
            compat.OrchestratorPermissionDeniedError,
            errors.NotHolder,
        ),
        (grpc.StatusCode.INTERNAL, compat.OrchestratorInternalError, errors.RPCError),
        (grpc.StatusCode.UNKNOWN, compat.OrchestratorInternalError, errors.RPCError),
        (grpc.StatusCode.FAILED_PRECONDITION, compat.OrchestratorError, errors.RPCError),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            compat.OrchestratorInvalidArgumentError,
            errors.InvalidArgument,
        ),
    ],
)
def test_status_codes_map_to_llm_d_error_classes(
    orch_client: compat.TimeSliceOrchestratorClient,
    orchestrator: Orchestrator,
    code: grpc.StatusCode,
    llm_d: type[Exception],
    ours: type[Exception],
) -> None:
    orch_client.acquire()
    orchestrator.script.fail_next("Yield", code, "why")
    with pytest.raises(llm_d) as caught:
        orch_client.release()
    assert type(caught.value) is llm_d
    assert isinstance(caught.value, ours)
    assert caught.value.status == code  # type: ignore[attr-defined]


def test_real_refusals_are_llm_d_errors_too(
    orch_client: compat.TimeSliceOrchestratorClient, orchestrator: Orchestrator
) -> None:
    with tslice.Client(orchestrator.address, job_id="other", lease_s=None) as other:
        other.acquire("g")
        with pytest.raises(compat.OrchestratorPermissionDeniedError, match="held by job"):
            orch_client.release()
        other.yield_("g")
    with pytest.raises(compat.OrchestratorNotFoundError):
        orch_client.acquire(group_id="never-configured")


def test_malformed_id_is_an_invalid_argument_error(
    orch_client: compat.TimeSliceOrchestratorClient,
) -> None:
    with pytest.raises(compat.OrchestratorInvalidArgumentError, match="malformed"):
        orch_client.acquire(job_id="two words")


def test_unreachable_orchestrator_is_a_connection_error(orchestrator: Orchestrator) -> None:
    orchestrator.stop()
    with (
        compat.TimeSliceOrchestratorClient(orchestrator.address, "me", "g") as client,
        pytest.raises(compat.OrchestratorConnectionError) as caught,
    ):
        client.release(timeout_sec=0.3)
    assert isinstance(caught.value, tslice.Unavailable)


def test_unavailable_is_retried_where_llm_d_silently_was_not(
    orch_client: compat.TimeSliceOrchestratorClient, orchestrator: Orchestrator
) -> None:
    orchestrator.script.fail_next("Acquire", grpc.StatusCode.UNAVAILABLE, "restarting")
    assert orch_client.acquire().success
    assert len(orchestrator.script.calls_of("Acquire")) == 2


def test_noop_when_no_target_anywhere() -> None:
    client = compat.TimeSliceOrchestratorClient(None, job_id="me", group_id="g")
    assert not client.client.enabled
    assert client.acquire().success
    with client.on_accelerators() as result:
        assert result.waited_ms == 0


# -- SnapshotAgentClient --------------------------------------------------------------------


def fake_agent(server: ServerThread) -> FakeAgent:
    return server.servicer  # type: ignore[no-any-return]


@pytest.fixture
def agent_client(agent: ServerThread) -> Iterator[compat.SnapshotAgentClient]:
    with compat.SnapshotAgentClient(agent.address) as client:
        yield client


def test_needs_an_endpoint_or_a_channel() -> None:
    with pytest.raises(ValueError, match="'endpoint' or 'channel'"):
        compat.SnapshotAgentClient()


def test_snapshot_then_get_operation(
    agent_client: compat.SnapshotAgentClient, agent: ServerThread
) -> None:
    started = agent_client.snapshot("job-1", "g", backend_config=compat.cuda_config([42]))
    assert started == compat.SnapshotResponse(operation_id="op-1")
    pending = agent_client.get_operation("op-1")
    assert pending == compat.GetOperationResponse(
        status="OPERATION_STATUS_PENDING", elapsed_ms=5, job_id="job-1", kind="snapshot"
    )
    assert pending.storage_bytes is None and pending.error is None
    agent.call(lambda: fake_agent(agent).finish("op-1"))
    done = agent_client.get_operation("op-1")
    assert (done.status, done.storage_bytes, done.error) == (
        "OPERATION_STATUS_COMPLETE",
        1024,
        None,
    )
    kind, request = agent.call(lambda: fake_agent(agent).requests[0])
    assert kind == "snapshot"
    assert request.backend == pb.BACKEND_CUDA  # deprecated field still filled for llm-d agents
    assert list(request.backend_config.cuda.explicit_target.pids) == [42]


def test_restore_with_the_deprecated_backend_keyword(
    agent_client: compat.SnapshotAgentClient, agent: ServerThread
) -> None:
    agent_client.restore("job-1", backend="cuda")
    _, request = agent.call(lambda: fake_agent(agent).requests[0])
    assert request.backend == pb.BACKEND_CUDA and not request.HasField("backend_config")
    with pytest.raises(ValueError, match="unknown backend"):
        agent_client.restore("job-1", backend="tpu")


def test_rpc_errors_are_snapshot_agent_errors(agent_client: compat.SnapshotAgentClient) -> None:
    with pytest.raises(compat.SnapshotAgentError) as caught:
        agent_client.snapshot("missing")
    err = caught.value
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details == "job missing is not RUNNING"
    assert str(err) == (
        "gRPC error calling Snapshot: StatusCode.FAILED_PRECONDITION - job missing is not RUNNING"
    )
    assert isinstance(err, tslice.RPCError) and isinstance(err.__cause__, errors.FailedPrecondition)
    with pytest.raises(compat.SnapshotAgentError) as not_found:
        agent_client.get_operation("nope")
    assert not_found.value.code == grpc.StatusCode.NOT_FOUND


def test_wait_for_operation_long_polls_instead_of_polling(
    agent_client: compat.SnapshotAgentClient,
    agent: ServerThread,
    executor: futures.ThreadPoolExecutor,
) -> None:
    op = agent_client.restore("job-1", "g").operation_id
    waiting = executor.submit(agent_client.wait_for_operation, op, 60.0)
    agent.wait_for(lambda a: any(kind == "wait" for kind, _ in a.requests))
    agent.call(lambda: fake_agent(agent).finish(op))
    result = waiting.result(10)
    assert result.status == "OPERATION_STATUS_COMPLETE"
    kinds = agent.call(lambda: [k for k, _ in fake_agent(agent).requests])
    assert "get" not in kinds  # a 60 s poll interval would have hung the test otherwise


def test_wait_falls_back_to_polling_an_llm_d_agent(server_thread: ServerThread) -> None:
    server_thread.start(FakeAgent(long_poll=False, auto_complete=True))
    with compat.SnapshotAgentClient(server_thread.address) as client:
        result = client.snapshot_and_wait("job-1", poll_interval_sec=0.01)
    assert result.status == "OPERATION_STATUS_COMPLETE"
    kinds = server_thread.call(lambda: [k for k, _ in server_thread.servicer.requests])
    assert kinds == ["snapshot", "get"]


def test_wait_timeout(agent_client: compat.SnapshotAgentClient) -> None:
    op = agent_client.snapshot("job-1").operation_id
    with pytest.raises(compat.SnapshotAgentError, match="still OPERATION_STATUS_PENDING") as caught:
        agent_client.wait_for_operation(op, timeout_sec=0.2)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_failed_operation_is_returned_not_raised(
    agent_client: compat.SnapshotAgentClient, agent: ServerThread
) -> None:
    agent.call(lambda: setattr(fake_agent(agent), "auto_complete", False))
    op = agent_client.snapshot("job-1").operation_id
    agent.call(lambda: fake_agent(agent).finish(op, error="cuda-checkpoint failed"))
    result = agent_client.wait_for_operation(op)
    assert (result.status, result.error) == ("OPERATION_STATUS_FAILED", "cuda-checkpoint failed")


def test_status_health_grant_reset(
    agent_client: compat.SnapshotAgentClient, agent: ServerThread
) -> None:
    assert agent_client.grant("job-2", "g", grant_epoch=3) == "JOB_STATE_RUNNING"
    status = agent_client.status()
    assert status.job_statuses == [
        compat.JobStatus(job_id="job-2", state="JOB_STATE_RUNNING", group="g", backend="noop")
    ]
    assert status.accelerator_statuses == [compat.AcceleratorStatus("gpu-0", 1, 2)]
    assert status.node == "node-a"
    assert agent_client.reset_job("job-2") == "JOB_STATE_IDLE"
    assert agent_client.check_health() == compat.HealthResponse(status="SERVING")
    assert agent_client.check_health("noop").status == "NOT_SERVING"
    with pytest.raises(compat.SnapshotAgentError) as caught:
        agent_client.check_health("no-such-backend")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_a_given_channel_is_not_closed(agent: ServerThread) -> None:
    channel = grpc.insecure_channel(agent.address)
    try:
        with compat.SnapshotAgentClient(channel=channel) as client:
            client.status()
        # Still usable: the client did not own it.
        compat.SnapshotAgentClient(channel=channel).status()
    finally:
        channel.close()


def test_an_owned_channel_is_closed(agent: ServerThread) -> None:
    client = compat.SnapshotAgentClient(agent.address)
    client.status()
    client.close()
    with pytest.raises(compat.SnapshotAgentError, match="Unexpected error in Status"):
        client.status()


# -- BackendConfig builders -------------------------------------------------------------------


def test_backend_config_builders() -> None:
    assert compat.cuda_config().HasField("cuda")
    assert list(compat.direct_memory_config([7]).direct_memory.explicit_target.pids) == [7]
    vllm = compat.vllm_config(["http://e:8000"], mode="discard", tags=["weights"])
    assert vllm.app_endpoint.app == pb.APP_VLLM
    assert vllm.app_endpoint.mode == pb.SUSPEND_MODE_DISCARD
    assert compat.sglang_config(["http://e"]).app_endpoint.app == pb.APP_SGLANG
    assert compat.app_channel_config("offload").app_channel.mode == pb.SUSPEND_MODE_OFFLOAD
    regions = compat.memory_regions_config(["1:0x10:4096", (2, 0, 8)], snapshot_name="s-1")
    assert [(r.pid, r.address, r.size_bytes) for r in regions.memory_regions.regions] == [
        (1, 16, 4096),
        (2, 0, 8),
    ]
    assert compat.sim_config(5).sim.footprint_bytes == 5
    assert compat.noop_config().HasField("noop")


@pytest.mark.parametrize(
    "build",
    [
        lambda: compat.cuda_config([]),
        lambda: compat.cuda_config([0]),
        lambda: compat.app_endpoint_config("triton", ["http://e"]),
        lambda: compat.app_endpoint_config("vllm", "http://e"),
        lambda: compat.app_endpoint_config("vllm", []),
        lambda: compat.app_channel_config("sideways"),
        lambda: compat.app_channel_config(tags="weights"),
        lambda: compat.memory_regions_config([]),
        lambda: compat.memory_regions_config(["1:2"]),
        lambda: compat.memory_regions_config(["1:0:8"], snapshot_name="../x"),
        lambda: compat.sim_config(-1),
    ],
)
def test_backend_config_builders_reject_bad_input(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]
