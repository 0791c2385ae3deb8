"""The blocking Client against a real orchestrator (its Session stream, its lock)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import tslice
from tests.client.helpers import interrupt
from tests.client.servers import QUEUED, Orchestrator, wait_for_event, watching
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _channel
from tslice.common import errors


@pytest.fixture
def client(orchestrator: Orchestrator) -> Iterator[tslice.Client]:
    with tslice.Client(orchestrator.address, job_id="me", default_group="g") as client:
        yield client


@pytest.fixture
def other(orchestrator: Orchestrator) -> Iterator[tslice.Client]:
    """Another job, without a lease (a holder the tests control)."""
    with tslice.Client(orchestrator.address, job_id="other", lease_s=None) as client:
        yield client


def test_acquire_and_yield_round_trip(client: tslice.Client, orchestrator: Orchestrator) -> None:
    acquired = client.acquire()
    assert acquired.success and acquired.grant_epoch >= 1
    assert orchestrator.holder("g") == "me"
    released = client.release()
    assert released == tslice.YieldResult(success=True, pending_waiters=0, snapshot_deferred=True)
    assert orchestrator.holder("g") == ""
    # Both went over the client's one Session stream.
    assert {call.via for call in orchestrator.script.calls_of("Acquire")} == {"session"}
    assert orchestrator.script.sessions == 1


def test_every_call_carries_the_version_and_unary_calls_the_job(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    client.acquire("a", footprint_bytes=123)
    client.status(
        "a",
    )
    client.list_groups()
    seen = orchestrator.script.metadata
    assert {m[_channel.CLIENT_VERSION_HEADER] for m in seen} == {tslice.__version__}
    # The observer's reads name no job; this client's name "me" (a stream names none).
    mine = [m for m in seen if m.get(_channel.JOB_ID_HEADER)]
    assert [m[_channel.JOB_ID_HEADER] for m in mine] == ["me", "me"]


def test_footprint_is_sent_with_acquire(orchestrator: Orchestrator) -> None:
    with tslice.Client(orchestrator.address, job_id="me", footprint_bytes=7) as client:
        client.acquire("g")
        client.acquire("a", footprint_bytes=9)
    calls = orchestrator.script.calls_of("Acquire")
    assert [c.footprint_bytes for c in calls] == [7, 9]


def test_status_and_list_groups(client: tslice.Client, orchestrator: Orchestrator) -> None:
    client.acquire("b")
    status = client.status("b")
    assert status.group_id == "b" and status.group_state is tslice.GroupState.LOCKED
    assert status.locking_job == status.loaded_job == "me"
    assert status.nodes == ("node-a",)
    assert status.state_timestamp is not None and status.state_timestamp.year >= 2024
    assert [(s.agent, s.job_id) for s in status.agent_job_states] == [("node-a", "me")]
    assert [s.job_state for s in status.agent_job_states] == [tslice.AgentJobState.RUNNING]
    assert client.list_groups() == ("a", "b", "g")


def test_watch_events_are_typed_and_filtered(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    events = client.watch_events("g", kinds=[tslice.client.EventKind.GRANTED])
    client.acquire("a")
    client.acquire("g")
    first = next(events)
    events.close()  # type: ignore[attr-defined]
    assert (first.kind, first.group_id, first.job_id) == (
        tslice.client.EventKind.GRANTED,
        "g",
        "me",
    )


def test_a_waiting_acquire_is_granted_when_the_holder_yields(
    client: tslice.Client,
    other: tslice.Client,
    orchestrator: Orchestrator,
    executor: futures.ThreadPoolExecutor,
) -> None:
    other.acquire("g")
    with watching(orchestrator.address, "g") as events:
        pending = executor.submit(client.acquire, "g")
        wait_for_event(events, QUEUED, "me")
    assert not pending.done()
    assert other.yield_("g").pending_waiters == 1
    result = pending.result(timeout=30)
    assert result.success and result.grant_epoch == 2


def test_acquire_timeout_raises_and_leaves_the_queue(
    client: tslice.Client, other: tslice.Client, orchestrator: Orchestrator
) -> None:
    other.acquire("g")
    with pytest.raises(tslice.AcquireTimeout) as caught:
        client.acquire("g", timeout=0.3)
    err = caught.value
    assert (err.job_id, err.group_id) == ("me", "g")
    assert err.waited_ms >= 300
    assert err.status == grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(err.__cause__, errors.DeadlineExceeded)
    # The client sent its cancel: no ghost in the queue.
    orchestrator.until(lambda: orchestrator.waiting("g") == ())
    assert len(orchestrator.script.calls_of("Acquire")) == 2  # never re-issued


def test_client_default_timeout_applies_to_acquire(
    other: tslice.Client, orchestrator: Orchestrator
) -> None:
    other.acquire("g")
    with (
        tslice.Client(orchestrator.address, job_id="me", timeout=0.2) as client,
        pytest.raises(tslice.AcquireTimeout),
    ):
        client.acquire("g")


def test_real_refusals_map_to_specific_errors(
    client: tslice.Client, other: tslice.Client, orchestrator: Orchestrator
) -> None:
    with pytest.raises(errors.InvalidArgument, match="malformed"):
        client.acquire("g", job_id="two words")
    with pytest.raises(errors.UnknownGroup) as unknown:
        client.acquire("nope")
    assert "nope" in unknown.value.message and isinstance(unknown.value.__cause__, grpc.RpcError)
    other.acquire("g")
    with pytest.raises(errors.NotHolder, match="held by job 'other'"):
        client.yield_("g")
    client.evict("g", "other", reason="maintenance")
    with pytest.raises(errors.FailedPrecondition, match="no longer holds"):
        other.yield_("g")


STATUS_CASES = [
    (grpc.StatusCode.INVALID_ARGUMENT, "job_id is malformed", errors.InvalidArgument),
    (grpc.StatusCode.NOT_FOUND, "unknown group 'g'", errors.UnknownGroup),
    # A call about a group: NOT_FOUND is the unknown group, whatever the text says.
    (grpc.StatusCode.NOT_FOUND, "no such thing", errors.UnknownGroup),
    (grpc.StatusCode.PERMISSION_DENIED, "held by x", errors.NotHolder),
    (grpc.StatusCode.FAILED_PRECONDITION, "nope", errors.FailedPrecondition),
    (grpc.StatusCode.ABORTED, "busy", errors.Aborted),
    (grpc.StatusCode.CANCELLED, "cancelled", errors.Cancelled),
    (grpc.StatusCode.INTERNAL, "boom", errors.RPCError),
]


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    STATUS_CASES,
    ids=[f"{c[0].name}-{c[2].__name__}" for c in STATUS_CASES],
)
def test_status_codes_map_to_specific_errors(
    client: tslice.Client,
    orchestrator: Orchestrator,
    code: grpc.StatusCode,
    details: str,
    expected: type[errors.RPCError],
) -> None:
    client.acquire("g")
    orchestrator.script.fail_next("Yield", code, details)
    with pytest.raises(expected) as caught:
        client.yield_("g")
    err = caught.value
    assert type(err) is expected
    assert err.status == code and err.message == details
    assert isinstance(err.__cause__, grpc.RpcError)
    assert len(orchestrator.script.calls_of("Yield")) == 1  # not retried


def test_unavailable_is_retried_until_it_succeeds(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    orchestrator.script.fail_next("Acquire", grpc.StatusCode.UNAVAILABLE, "restarting", times=3)
    assert client.acquire("g").success
    assert len(orchestrator.script.calls_of("Acquire")) == 4
    assert orchestrator.holder("g") == "me"


def test_unavailable_gives_up_at_the_deadline(orchestrator: Orchestrator) -> None:
    with tslice.Client(orchestrator.address, job_id="me") as client:
        client.list_groups()  # connected once: from now on UNAVAILABLE is retried
        orchestrator.stop()
        with pytest.raises(tslice.Unavailable, match="gave up on Yield") as caught:
            client.yield_("g", timeout=2.0)
        assert isinstance(caught.value.__cause__, grpc.RpcError)


def test_no_retry_policy_fails_at_once(orchestrator: Orchestrator) -> None:
    orchestrator.script.fail_next("Acquire", grpc.StatusCode.UNAVAILABLE, "x")
    no_retry = tslice.client.NO_RETRY
    with (
        tslice.Client(orchestrator.address, job_id="me", retry=no_retry) as c,
        pytest.raises(tslice.Unavailable),
    ):
        c.acquire("g")
    assert len(orchestrator.script.calls_of("Acquire")) == 1


@pytest.mark.parametrize("broken_with", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
def test_a_yield_whose_reply_was_lost_is_not_reported_as_a_failure(
    broken_with: grpc.StatusCode,
    client: tslice.Client,
    other: tslice.Client,
    orchestrator: Orchestrator,
    executor: futures.ThreadPoolExecutor,
) -> None:
    """The first Yield hands the group to the waiter but its reply is lost (the stream
    breaks); the re-issued Yield meets PERMISSION_DENIED, and the job no longer holds the
    group: it did let go. A stream that breaks is retried whatever code its end came with
    (a connection reset under a SIGKILL may end it INTERNAL)."""
    client.acquire("g")
    with watching(orchestrator.address, "g") as events:
        pending = executor.submit(other.acquire, "g")
        wait_for_event(events, QUEUED, "other")
    orchestrator.script.lose_reply("Yield", broken_with)
    assert client.yield_("g").success
    assert pending.result(30).success
    assert [c.method for c in orchestrator.script.calls_of("Yield")] == ["Yield", "Yield"]
    assert orchestrator.holder("g") == "other"


def test_permission_denied_without_a_retry_is_still_an_error(
    client: tslice.Client, other: tslice.Client
) -> None:
    other.acquire("g")
    with pytest.raises(errors.NotHolder):
        client.yield_("g")


def test_acquire_survives_an_orchestrator_restart(
    other: tslice.Client, orchestrator: Orchestrator, executor: futures.ThreadPoolExecutor
) -> None:
    """The acquire is queued, the orchestrator stops and comes back on the same port and
    state: the client re-issues Acquire on a new stream and is granted when the holder
    yields, without the caller noticing."""
    other.acquire("g")
    with tslice.Client(orchestrator.address, job_id="me") as client:
        with watching(orchestrator.address, "g") as events:
            pending = executor.submit(client.acquire, "g")
            wait_for_event(events, QUEUED, "me")
        orchestrator.restart()  # the Acquire in flight fails with UNAVAILABLE, re-issued
        orchestrator.until(lambda: orchestrator.waiting("g") == ("me",))
        other.yield_("g")
        result = pending.result(timeout=30)
    assert result.success
    assert orchestrator.holder("g") == "me"


def test_ctrl_c_while_waiting_cancels_the_server_side_waiter(
    client: tslice.Client, other: tslice.Client, orchestrator: Orchestrator
) -> None:
    """A KeyboardInterrupt in the blocked thread sends the Session's cancel, so the job
    leaves the queue at once instead of becoming a ghost waiter."""
    _interrupt_a_waiting_acquire(client, other, orchestrator)


def _interrupt_a_waiting_acquire(
    client: tslice.Client, other: tslice.Client, orchestrator: Orchestrator
) -> None:
    """Ctrl-C in a thread whose acquire("g") waits (``other`` holds g): the thread gets
    the KeyboardInterrupt, and the job leaves the queue."""
    other.acquire("g")
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            client.acquire("g")
        except BaseException as exc:
            outcome.append(exc)

    with watching(orchestrator.address, "g") as events:
        thread = threading.Thread(target=waiter)
        thread.start()
        wait_for_event(events, QUEUED, "me")
    interrupt(thread)
    thread.join(10)
    assert outcome and isinstance(outcome[0], KeyboardInterrupt)
    orchestrator.until(lambda: orchestrator.waiting("g") == ())


def test_closed_client_refuses_calls(orchestrator: Orchestrator) -> None:
    client = tslice.Client(orchestrator.address, job_id="me")
    client.acquire("g")
    client.close()
    client.close()
    with pytest.raises(errors.TsliceError, match="closed"):
        client.yield_("g")


def test_raw_stub_is_reachable(client: tslice.Client) -> None:
    response = client.orchestrator_stub.ListGroups(opb.ListGroupsRequest(), timeout=5)
    assert list(response.group_ids) == ["a", "b", "g"]
