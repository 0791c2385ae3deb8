"""The public surface: pinned exports, sync/async parity, one wrapper per RPC."""

from __future__ import annotations

import inspect
import re

import pytest

import tslice
import tslice.client
import tslice.client.compat
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _services, _streams


def test_tslice_exports_are_pinned() -> None:
    assert tslice.__all__ == [
        "AcquireResult",
        "AcquireTimeout",
        "AgentJobState",
        "AgentJobStatus",
        "AsyncClient",
        "Cancelled",
        "Client",
        "ConfigError",
        "DeadlineExceeded",
        "GroupState",
        "GroupStatus",
        "InvalidArgument",
        "NotFound",
        "NotHolder",
        "OrchestratorEvent",
        "RPCError",
        "RetryPolicy",
        "SnapshotAgentClient",
        "SnapshotAgentError",
        "TimeSliceOrchestratorClient",
        "TsliceError",
        "Unavailable",
        "UnknownGroup",
        "YieldResult",
        "__version__",
    ]
    for name in tslice.__all__:
        assert hasattr(tslice, name), name


def test_client_package_exports_are_pinned() -> None:
    assert tslice.client.__all__ == [
        "DEFAULT_CHANNEL_OPTIONS",
        "DEFAULT_RETRY",
        "NO_RETRY",
        "USE_CLIENT_DEFAULT",
        "AcquireResult",
        "AgentJobState",
        "AgentJobStatus",
        "AsyncClient",
        "AsyncSliceContext",
        "Client",
        "ClientConfig",
        "DegradedNode",
        "DrainState",
        "EventKind",
        "EvictedRole",
        "Eviction",
        "GroupState",
        "GroupStatus",
        "OrchestratorEvent",
        "RetryPolicy",
        "SliceContext",
        "SnapshotAgentClient",
        "SnapshotAgentError",
        "StoredEvents",
        "TimeSliceOrchestratorClient",
        "YieldResult",
        "compat",
    ]
    for name in tslice.client.__all__:
        assert hasattr(tslice.client, name), name


def test_compat_exports_carry_llm_d_names() -> None:
    llm_d_orchestrator = {
        "TimeSliceOrchestratorClient",
        "OrchestratorError",
        "OrchestratorConnectionError",
        "OrchestratorTimeoutError",
        "OrchestratorInvalidArgumentError",
        "OrchestratorInternalError",
        "AgentJobState",
        "AcquireResult",
        "GroupLockState",
        "GroupStatus",
        "OrchestratorGroupStatus",
        "SnapshotAgentJobState",
        "YieldResult",
    }
    llm_d_agent = {
        "SnapshotAgentClient",
        "SnapshotAgentError",
        "MemoryRegion",
        "app_channel_config",
        "app_endpoint_config",
        "cuda_config",
        "direct_memory_config",
        "memory_regions_config",
        "sglang_config",
        "vllm_config",
    }
    exported = set(tslice.client.compat.__all__)
    assert llm_d_orchestrator <= exported
    assert llm_d_agent <= exported
    assert tslice.client.compat.__all__ == sorted(tslice.client.compat.__all__, key=_isort_key)
    for name in exported:
        assert hasattr(tslice.client.compat, name), name


def _isort_key(name: str) -> tuple[int, str]:
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_register_workload_is_reexported_lazily_when_available() -> None:
    workload = pytest.importorskip("tslice.workload")
    if not hasattr(workload, "register_workload"):
        pytest.skip("tslice.workload does not provide register_workload yet")
    assert tslice.register_workload is workload.register_workload
    from tslice import register_workload

    assert register_workload is workload.register_workload


def test_unknown_attribute_still_raises() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tslice.nope  # type: ignore[attr-defined]  # noqa: B018


def _public(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }


# Methods that return an object rather than doing I/O, in both clients.
_NOT_COROUTINES = {"slice", "sliced", "watch_events"}


def test_sync_and_async_clients_have_the_same_surface() -> None:
    sync, asynchronous = _public(tslice.Client), _public(tslice.AsyncClient)
    assert sorted(sync) == sorted(asynchronous)
    for name, member in sync.items():
        twin = asynchronous[name]
        if isinstance(member, property):
            assert isinstance(twin, property), name
            continue
        # Same parameters; return types differ (AsyncSliceContext, AsyncIterator...).
        assert (
            inspect.signature(member).parameters  # type: ignore[arg-type]
            == inspect.signature(twin).parameters  # type: ignore[arg-type]
        ), name
        assert not inspect.iscoroutinefunction(member), name
        expected = name not in _NOT_COROUTINES
        assert inspect.iscoroutinefunction(twin) is expected, name
    assert inspect.signature(tslice.Client.__init__) == inspect.signature(
        tslice.AsyncClient.__init__
    )


def test_constructor_takes_only_the_address_positionally() -> None:
    parameters = inspect.signature(tslice.Client.__init__).parameters.values()
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["self", "address"]


def _snake(name: str) -> str:
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    return "yield_" if snake == "yield" else snake


_SERVICES = [
    (opb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"], "ORCHESTRATOR"),
    (pb.DESCRIPTOR.services_by_name["SnapshotAgentService"], "AGENT"),
]


@pytest.mark.parametrize(("service", "kind"), _SERVICES, ids=["orchestrator", "agent"])
def test_every_rpc_has_a_wrapper_method(service: object, kind: str) -> None:
    methods = service.methods  # type: ignore[attr-defined]
    table = getattr(_services, f"{kind}_METHODS")
    assert sorted(table) == sorted(m.name for m in methods)
    classes = {
        "ORCHESTRATOR": (_services.OrchestratorCalls, _services.AsyncOrchestratorCalls),
        "AGENT": (_services.AgentCalls, _services.AsyncAgentCalls),
    }[kind]
    for method in methods:
        assert table[method.name].service == service.full_name  # type: ignore[attr-defined]
        for cls in classes:
            rpc = getattr(cls, _snake(method.name), None)
            assert isinstance(rpc, _services._Rpc), (cls, method.name)
            assert rpc.method is table[method.name]
            # The declared request and reply types are the proto's (mypy checks callers
            # against the declaration, this checks the declaration against the wire).
            request, reply = rpc.__orig_class__.__args__  # type: ignore[attr-defined]
            assert request.DESCRIPTOR is method.input_type, method.name
            assert reply.DESCRIPTOR is method.output_type, method.name
            streaming = (method.client_streaming, method.server_streaming)
            kind_of = {
                (False, False): _services.Unary,
                (False, True): _services.ServerStream,
                (True, True): _services.BidiStream,
            }
            assert type(rpc) is kind_of[streaming], method.name


def test_the_health_check_is_grpc_health_v1_on_the_wire() -> None:
    """The job side speaks grpc.health.v1 without grpcio-health-checking: protobuf's
    StringValue and Int32Value encode exactly as HealthCheckRequest and -Response."""
    from grpc_health.v1 import health_pb2

    request = _streams.HealthCheckRequest(value="trainer")
    assert request.SerializeToString() == (
        health_pb2.HealthCheckRequest(service="trainer").SerializeToString()
    )
    for number, name in _streams.SERVING_STATUS.items():
        wire = health_pb2.HealthCheckResponse(status=number).SerializeToString()
        assert _streams.HealthCheckResponse.FromString(wire).value == number
        assert health_pb2.HealthCheckResponse.ServingStatus.Name(number) == name
    assert _services.AgentCalls.check_health.method.service == "grpc.health.v1.Health"


def test_only_safe_rpcs_are_retried() -> None:
    retried = {
        name
        for table in (_services.ORCHESTRATOR_METHODS, _services.AGENT_METHODS)
        for name, method in table.items()
        if method.retryable
    }
    assert retried == {
        "Acquire",
        "AcquireSet",
        "Yield",
        "ListGroups",
        "GetGroupStatus",
        "GetOperation",
        "Status",
        "WaitOperation",
        "Grant",
        "ResetJob",
    }


def test_event_kind_filter_maps_to_wire_names() -> None:
    from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
    from tslice.client import EventKind, _types

    request = opb.WatchEventsRequest(
        kinds=_types.event_kinds([EventKind.QUEUED, EventKind.SWITCH_DONE])
    )
    assert list(request.kinds) == [
        opb.OrchestratorEvent.KIND_QUEUED,
        opb.OrchestratorEvent.KIND_SWITCH_DONE,
    ]
