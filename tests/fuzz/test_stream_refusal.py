"""The two hand-over streams (``Session``, ``GrantStream``) parse their own requests
(``rpc.multiplex.serve``): a request that does not parse ends the stream with
INVALID_ARGUMENT naming the message to send, after the requests before it are answered,
as the interceptor does for every other method."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import pytest

from tests.fuzz import calls
from tests.fuzz.conftest import Served
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

GARBAGE = b"\xff"  # a field tag with no value: never a valid message


@dataclasses.dataclass(frozen=True)
class Stream:
    server: str  # the fixture serving it
    path: str
    first: Any  # a valid request, answered at once
    reply_type: Any
    type_name: str  # what the refusal tells the caller to send


STREAMS = [
    Stream(
        "orchestrator",
        "/timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService/Session",
        opb.SessionRequest(
            request_id=7, release=opb.YieldRequest(job_id="nobody", group_id="nowhere")
        ),
        opb.SessionResponse,
        "SessionRequest",
    ),
    Stream(
        "agent",
        "/snapshot_agent.v1alpha1.SnapshotAgentService/GrantStream",
        pb.GrantStreamRequest(request_id=7, grant=pb.GrantRequest()),  # no job: refused
        pb.GrantStreamResponse,
        "GrantStreamRequest",
    ),
]


@pytest.mark.parametrize("stream", STREAMS, ids=lambda s: s.path.rsplit("/", 1)[-1])
def test_the_requests_before_an_unparsable_one_are_answered_then_the_stream_is_refused(
    request: pytest.FixtureRequest, stream: Stream
) -> None:
    served: Served = request.getfixturevalue(stream.server)
    stub = served.channel.stream_stream(stream.path, None, stream.reply_type.FromString)
    answer = calls.exchange(stub, stream.path, [stream.first.SerializeToString(), GARBAGE])

    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    # The same words as every other method's refusal (docs/security.md), its path first.
    assert answer.details.startswith(f"{stream.path}: the request is not a valid "), answer
    assert stream.type_name in answer.details, answer
    assert "send a serialized" in answer.details, answer
    assert [reply.request_id for reply in answer.replies] == [7], answer
    calls.assert_healthy(served.channel)
