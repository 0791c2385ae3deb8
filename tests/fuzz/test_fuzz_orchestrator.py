"""Fuzzing every RPC of a real orchestrator (TimeSliceOrchestratorService and health)
with random and hostile messages: every call ends with OK or a status a client can act
on, its message is short, and the orchestrator answers health within a second after
each example.

An example may start with the group ``g1`` held by ``job-a`` (ids of the strategies'
shared pool), so that fuzzed calls meet a held group too, and may be aimed at it (their
job and group made the holder's, to reach Hold, Yield and re-Acquire by the holder). An
Acquire by another job then waits by design (in local mode all groups share the agent's
devices), and only then may it reach its (short) deadline. What an example acquired is
yielded after it (and what it drained resumed), so that no example waits for another's holder.
A Session's requests are followed by a cancel of each of them, so that the stream ends
once the server has handled them (a waiting Acquire is cancelled, not waited for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz import calls, methods
from tests.fuzz.conftest import Served
from tests.fuzz.examples import fuzz_settings
from tests.fuzz.methods import ORCHESTRATOR_METHODS
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc

HOLDER, HELD = "job-a", "g1"
#: How long an Acquire that waits for HOLDER by design is given.
WAITING_S = 0.5


def _waits_for_holder(requests: Sequence[Any]) -> bool:
    # Local mode: every group spans the one agent, so they share its devices; while
    # HOLDER holds HELD, another job waits for any group.
    return any(a.job_id != HOLDER for a in methods.acquires(requests))


def _carries_a_deadline(requests: Sequence[Any]) -> bool:
    """Whether an Acquire or AcquireSet carries its own ``timeout_ms``: the orchestrator
    ends it DEADLINE_EXCEEDED at that deadline when it is not granted by then (a fuzzed
    2 ms passes during any switch)."""
    for request in requests:
        call = request
        if isinstance(request, opb.SessionRequest):
            call = getattr(request, str(request.WhichOneof("call")), None)
        if isinstance(call, opb.AcquireRequest | opb.AcquireSetRequest) and call.timeout_ms > 0:
            return True
    return False


def _aimed(request: Any) -> Any:
    """``request`` (or the call of a Session request) as HOLDER's on HELD."""
    aimed = type(request)()
    aimed.CopyFrom(request)
    inner = aimed
    calls_aimed = ("acquire", "release", "acquire_set")
    if isinstance(aimed, opb.SessionRequest) and aimed.WhichOneof("call") in calls_aimed:
        inner = getattr(aimed, str(aimed.WhichOneof("call")))
    fields = type(inner).DESCRIPTOR.fields_by_name
    if "job_id" in fields and "group_id" in fields:
        inner.job_id, inner.group_id = HOLDER, HELD
    elif "job_id" in fields and "group_ids" in fields:  # AcquireSet: the held group alone
        inner.job_id = HOLDER
        inner.group_ids[:] = [HELD]
    return aimed


def _with_cancels(requests: Sequence[opb.SessionRequest]) -> list[opb.SessionRequest]:
    ids = dict.fromkeys(r.request_id for r in requests)
    return [*requests, *(opb.SessionRequest(request_id=i, cancel=True) for i in ids)]


@pytest.mark.parametrize("method", ORCHESTRATOR_METHODS, ids=str)
@given(data=st.data(), held=st.booleans())
@fuzz_settings(25)
def test_every_orchestrator_rpc_answers_fuzzed_messages(
    orchestrator: Served, method: methods.Method, data: st.DataObject, held: bool
) -> None:
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(orchestrator.channel)
    requests = data.draw(methods.requests_for(method), label="requests")
    prelude = [opb.AcquireRequest(job_id=HOLDER, group_id=HELD)] if held else []
    if held and data.draw(st.booleans(), label="aimed at the holder"):
        requests = [_aimed(r) for r in requests]
    try:
        for acquire in prelude:
            stub.Acquire(acquire, timeout=calls.PROMPT_S)
        if method.name == "Session":
            requests = _with_cancels(requests)
        acquiring = method.name in ("Acquire", "AcquireSet")
        waits = held and acquiring and _waits_for_holder(requests)
        answer = methods.call(
            orchestrator.channel, method, requests, timeout=WAITING_S if waits else calls.PROMPT_S
        )
        event(answer.code.name)  # --hypothesis-show-statistics: how deep the examples got
        expected = methods.allowed(method)
        own_deadline = acquiring or method.name == "Session"
        if waits or (own_deadline and _carries_a_deadline(requests)):
            expected = expected | {calls.Code.DEADLINE_EXCEEDED}
        answer.check(expected)
    finally:
        methods.leave_as_found(orchestrator.channel, [*prelude, *requests])
    calls.assert_healthy(orchestrator.channel)
