"""Every RPC of a service, called generically from its descriptor.

A method's call style follows its streaming flags: unary; server streaming (its first
reply, or its headers for a subscription, then cancelled: those streams stay open by
design); bidirectional (requests sent, half-closed, read to the end).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor, message, message_factory
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from tests.fuzz import calls, strategies
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc

#: Server streams that send their headers once set up and then only events.
SUBSCRIPTIONS = frozenset({"WatchEvents"})
#: The field the first message of a stream sets, often, to get past "first say who you are".
FIRST_FIELD = {"WorkloadChannel": "register"}


@dataclasses.dataclass(frozen=True)
class Method:
    """One RPC: its path, request type and streaming flags."""

    service: str
    name: str
    request: descriptor.Descriptor
    reply: descriptor.Descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    def __str__(self) -> str:  # pytest ids
        return self.name


def methods_of(service: descriptor.ServiceDescriptor) -> list[Method]:
    return [
        Method(
            service.full_name,
            m.name,
            m.input_type,
            m.output_type,
            m.client_streaming,
            m.server_streaming,
        )
        for m in service.methods
    ]


#: grpc.health.v1.Health (Check, Watch, and List where grpcio-health-checking has it).
HEALTH_METHODS = methods_of(health_pb2.DESCRIPTOR.services_by_name["Health"])


@functools.cache
def requests_for(method: Method) -> st.SearchStrategy[list[Any]]:
    """One request (unary and server-streaming methods) or up to six (client streams)."""
    one = strategies.messages(method.request)
    if not method.client_streaming:
        return st.lists(one, min_size=1, max_size=1)
    first = one
    if method.name in FIRST_FIELD:
        usual = strategies.messages(method.request, with_field=FIRST_FIELD[method.name])
        first = st.one_of(one, usual)
    return st.builds(lambda head, rest: [head, *rest], first, st.lists(one, max_size=5))


def call(
    channel: grpc.Channel,
    method: Method,
    requests: Sequence[Any],
    *,
    timeout: float = calls.PROMPT_S,
) -> calls.Answer:
    """Call ``method`` with ``requests`` (a unary or server-streaming method takes the
    first) in the style its flags call for."""
    serialize = message_factory.GetMessageClass(method.request).SerializeToString
    parse = message_factory.GetMessageClass(method.reply).FromString
    return _called(channel, method, requests, timeout=timeout, codec=(serialize, parse))


def call_raw(channel: grpc.Channel, method: Method, payloads: Sequence[bytes]) -> calls.Answer:
    """``payloads`` as the serialized requests of ``method`` (no parsing on our side)."""
    return _called(channel, method, payloads, timeout=calls.PROMPT_S, codec=(None, None))


def _called(
    channel: grpc.Channel,
    method: Method,
    requests: Sequence[Any],
    *,
    timeout: float,
    codec: tuple[Callable[[Any], bytes] | None, Callable[[bytes], Any] | None],
) -> calls.Answer:
    serialize, parse = codec
    stub: Any
    if method.client_streaming:
        stub = channel.stream_stream(method.path, serialize, parse)
        return calls.exchange(stub, method.path, requests, timeout=timeout)
    if method.server_streaming:
        stub = channel.unary_stream(method.path, serialize, parse)
        follow = calls.subscribed if method.name in SUBSCRIPTIONS else calls.first_reply
        return follow(stub, method.path, requests[0], timeout=timeout)
    stub = channel.unary_unary(method.path, serialize, parse)
    return calls.unary(stub, method.path, requests[0], timeout=timeout)


def allowed(method: Method) -> frozenset[grpc.StatusCode]:
    """The statuses ``method`` may end with."""
    if method.service == "grpc.health.v1.Health" and method.name == "List":
        # grpcio-health-checking's servicer has no List: UNIMPLEMENTED.
        return calls.EXPECTED | {grpc.StatusCode.UNIMPLEMENTED}
    if method.name == "WorkloadChannel":
        # A workload without keepalive whose stream ends after the agent wrote to it is
        # counted as lost (it cannot be probed), and told so with UNAVAILABLE.
        return calls.EXPECTED | {grpc.StatusCode.UNAVAILABLE}
    return calls.EXPECTED


def read_requests(method: Method, payloads: Sequence[bytes]) -> list[Any] | None:
    """The requests the server reads from ``payloads`` (None: one does not parse)."""
    cls = message_factory.GetMessageClass(method.request)
    try:
        return [cls.FromString(p) for p in (payloads if method.client_streaming else payloads[:1])]
    except message.DecodeError:
        return None


def check_raw(channel: grpc.Channel, method: Method, payloads: Sequence[bytes]) -> calls.Answer:
    """Random bytes as requests: what parses is answered as any request would be; what
    does not is refused with INVALID_ARGUMENT (a request the server cannot read is the
    caller's error, never UNKNOWN, and never a stream that ends OK as if all went well)."""
    answer = call_raw(channel, method, payloads)
    if read_requests(method, payloads) is not None:
        answer.check(allowed(method))
    else:
        answer.check({grpc.StatusCode.INVALID_ARGUMENT})
    return answer


def acquires(requests: Sequence[Any]) -> Iterator[opb.AcquireRequest]:
    """The Acquire requests among ``requests`` (unary, or inside Session requests); an
    AcquireSet counts as an Acquire of each of its groups."""
    for request in requests:
        call = request
        if isinstance(request, opb.SessionRequest):
            call = getattr(request, str(request.WhichOneof("call")), None)
        if isinstance(call, opb.AcquireRequest):
            yield call
        elif isinstance(call, opb.AcquireSetRequest):
            for gid in call.group_ids:
                yield opb.AcquireRequest(job_id=call.job_id, group_id=gid)


def leave_as_found(channel: grpc.Channel, requests: Sequence[Any]) -> None:
    """Yield whatever ``requests`` may have acquired on the orchestrator at ``channel``
    and resume what they drained (refusals are fine: not held, no such group), so that
    no example waits for another's holder or drain."""
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
    undo: list[tuple[Any, Any]] = [
        (stub.Yield, opb.YieldRequest(job_id=job, group_id=gid))
        for job, gid in dict.fromkeys((a.job_id, a.group_id) for a in acquires(requests))
    ]
    drained = dict.fromkeys(r.group_id for r in requests if isinstance(r, opb.DrainRequest))
    undo += [(stub.Drain, opb.DrainRequest(group_id=gid, drain=False)) for gid in drained]
    for call, request in undo:
        try:
            call(request, timeout=calls.PROMPT_S)
        except grpc.RpcError as err:
            assert err.code() in calls.EXPECTED, (request, err)


#: Every method of the agent's and of the orchestrator's services, health included.
AGENT_METHODS = [
    *methods_of(pb.DESCRIPTOR.services_by_name["SnapshotAgentService"]),
    *HEALTH_METHODS,
]
ORCHESTRATOR_METHODS = [
    *methods_of(opb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"]),
    *HEALTH_METHODS,
]
