"""The blocking Client against a real gRPC orchestrator double."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

import tslice
from tests.client.client_fakes import FakeOrchestrator, ServerThread
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _channel
from tslice.common import errors


@pytest.fixture
def client(orchestrator: ServerThread) -> Iterator[tslice.Client]:
    with tslice.Client(orchestrator.address, job_id="me", default_group="g") as client:
        yield client


def fake(server: ServerThread) -> FakeOrchestrator:
    return server.servicer  # type: ignore[no-any-return]


def hold(server: ServerThread, group: str, job: str) -> None:
    server.call(lambda: setattr(fake(server).groups[group], "holder", job))


def test_acquire_and_yield_round_trip(client: tslice.Client, orchestrator: ServerThread) -> None:
    acquired = client.acquire()
    assert acquired.success and acquired.grant_epoch == 1
    assert orchestrator.call(lambda: fake(orchestrator).groups["g"].holder) == "me"
    released = client.release()
    assert released == tslice.YieldResult(success=True, pending_waiters=0, snapshot_deferred=True)
    assert orchestrator.call(lambda: fake(orchestrator).groups["g"].holder) == ""


def test_every_call_carries_job_and_version_metadata(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    client.acquire("a", footprint_bytes=123)
    client.acquire("b", job_id="other-job")
    calls = orchestrator.call(lambda: list(fake(orchestrator).calls))
    assert [c.metadata[_channel.JOB_ID_HEADER] for c in calls] == ["me", "other-job"]
    assert {c.metadata[_channel.CLIENT_VERSION_HEADER] for c in calls} == {tslice.__version__}


def test_footprint_is_sent_with_acquire(orchestrator: ServerThread) -> None:
    with tslice.Client(orchestrator.address, job_id="me", footprint_bytes=7) as client:
        client.acquire("g")
        client.acquire("a", footprint_bytes=9)
    calls = orchestrator.call(lambda: fake(orchestrator).calls_of("Acquire"))
    assert [c.footprint_bytes for c in calls] == [7, 9]


def test_status_and_list_groups(client: tslice.Client, orchestrator: ServerThread) -> None:
    client.acquire("b")
    status = client.status("b")
    assert status.group_id == "b" and status.group_state is tslice.GroupState.LOCKED
    assert status.locking_job == status.loaded_job == "me"
    assert status.nodes == ("node-a", "node-b") and status.detail == "fake"
    assert status.state_timestamp is not None and status.state_timestamp.year == 2023
    assert [s.job_state for s in status.agent_job_states] == [tslice.AgentJobState.RUNNING] * 2
    assert client.list_groups() == ("a", "b", "g")


def test_watch_events_are_typed_and_filtered(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    events = [
        opb.OrchestratorEvent(kind=opb.OrchestratorEvent.KIND_GRANTED, group_id="g", job_id="x"),
        opb.OrchestratorEvent(kind=opb.OrchestratorEvent.KIND_YIELDED, group_id="a", job_id="y"),
    ]
    orchestrator.call(lambda: fake(orchestrator).events.extend(events))
    seen = list(client.watch_events("g"))
    assert [(e.kind, e.job_id) for e in seen] == [(tslice.client.EventKind.GRANTED, "x")]
    assert len(list(client.watch_events())) == 2


def test_a_waiting_acquire_is_granted_when_the_holder_yields(
    client: tslice.Client, orchestrator: ServerThread, executor: futures.ThreadPoolExecutor
) -> None:
    hold(orchestrator, "g", "other")
    pending = executor.submit(client.acquire, "g")
    orchestrator.wait_for(lambda f: "me" in f.groups["g"].waiters)
    assert not pending.done()
    with tslice.Client(orchestrator.address, job_id="other") as other:
        assert other.yield_("g").pending_waiters == 1
    result = pending.result(timeout=10)
    assert result.success and result.context_restored


def test_acquire_timeout_raises_and_leaves_the_queue(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    hold(orchestrator, "g", "other")
    with pytest.raises(tslice.AcquireTimeout) as caught:
        client.acquire("g", timeout=0.3)
    err = caught.value
    assert (err.job_id, err.group_id) == ("me", "g")
    assert err.waited_ms >= 300
    assert err.status == grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(err.__cause__, errors.DeadlineExceeded)
    # The server saw the deadline pass and dropped the waiter: no ghost in the queue.
    orchestrator.wait_for(lambda f: not f.groups["g"].waiters)
    assert len(fake_calls(orchestrator, "Acquire")) == 1  # never re-issued


def test_client_default_timeout_applies_to_acquire(orchestrator: ServerThread) -> None:
    hold(orchestrator, "g", "other")
    with (
        tslice.Client(orchestrator.address, job_id="me", timeout=0.2) as client,
        pytest.raises(tslice.AcquireTimeout),
    ):
        client.acquire("g")


def fake_calls(server: ServerThread, method: str) -> list[object]:
    return server.call(lambda: fake(server).calls_of(method))  # type: ignore[arg-type]


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
    orchestrator: ServerThread,
    code: grpc.StatusCode,
    details: str,
    expected: type[errors.RPCError],
) -> None:
    orchestrator.call(lambda: fake(orchestrator).failures["Yield"].append((code, details)))
    with pytest.raises(expected) as caught:
        client.yield_("g")
    err = caught.value
    assert type(err) is expected
    assert err.status == code and err.message == details
    assert isinstance(err.__cause__, grpc.RpcError)
    assert len(fake_calls(orchestrator, "Yield")) == 1  # not retried


def test_unavailable_is_retried_until_it_succeeds(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    for _ in range(3):
        orchestrator.call(
            lambda: (
                fake(orchestrator)
                .failures["Acquire"]
                .append((grpc.StatusCode.UNAVAILABLE, "shutting down; retry"))
            )
        )
    assert client.acquire("g").success
    assert len(fake_calls(orchestrator, "Acquire")) == 4


def test_unavailable_gives_up_at_the_deadline(orchestrator: ServerThread) -> None:
    with tslice.Client(orchestrator.address, job_id="me") as client:
        client.list_groups()  # connected once: from now on UNAVAILABLE is retried
        orchestrator.stop()
        with pytest.raises(tslice.Unavailable, match="gave up on Yield") as caught:
            client.yield_("g", timeout=2.0)
        assert isinstance(caught.value.__cause__, grpc.RpcError)


def test_no_retry_policy_fails_at_once(orchestrator: ServerThread) -> None:
    orchestrator.call(
        lambda: fake(orchestrator).failures["Acquire"].append((grpc.StatusCode.UNAVAILABLE, "x"))
    )
    no_retry = tslice.client.NO_RETRY
    with (
        tslice.Client(orchestrator.address, job_id="me", retry=no_retry) as c,
        pytest.raises(tslice.Unavailable),
    ):
        c.acquire("g")
    assert len(fake_calls(orchestrator, "Acquire")) == 1


def test_a_yield_whose_reply_was_lost_is_not_reported_as_a_failure(
    client: tslice.Client, orchestrator: ServerThread, executor: futures.ThreadPoolExecutor
) -> None:
    """The first Yield hands the group to the waiter but its reply is lost; the
    re-issued Yield meets PERMISSION_DENIED, which here means "already let go"."""
    client.acquire("g")
    with tslice.Client(orchestrator.address, job_id="other") as other:
        pending = executor.submit(other.acquire, "g")
        orchestrator.wait_for(lambda f: "other" in f.groups["g"].waiters)
        orchestrator.call(lambda: fake(orchestrator).lost_replies.update(["Yield"]))
        assert client.yield_("g").success
        assert pending.result(10).success
    assert [c.method for c in fake_calls(orchestrator, "Yield")] == ["Yield", "Yield"]


def test_permission_denied_without_a_retry_is_still_an_error(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    hold(orchestrator, "g", "other")
    with pytest.raises(errors.NotHolder):
        client.yield_("g")


def test_acquire_survives_an_orchestrator_restart(
    orchestrator: ServerThread, executor: futures.ThreadPoolExecutor
) -> None:
    """The acquire is queued, the orchestrator dies, a new one comes up on the same
    port: the client re-issues Acquire and completes without the caller noticing."""
    hold(orchestrator, "g", "other")
    port = orchestrator.port
    with tslice.Client(orchestrator.address, job_id="me") as client:
        pending = executor.submit(client.acquire, "g")
        orchestrator.wait_for(lambda f: "me" in f.groups["g"].waiters)
        orchestrator.stop()  # in-flight Acquire fails with UNAVAILABLE
        restarted = FakeOrchestrator()
        orchestrator.start(restarted, port=port)
        result = pending.result(timeout=30)
    assert result.success
    assert orchestrator.call(lambda: restarted.groups["g"].holder) == "me"


def test_ctrl_c_while_waiting_cancels_the_server_side_waiter(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    """A KeyboardInterrupt in the blocked thread cancels the RPC, so the job leaves
    the queue at once instead of becoming a ghost waiter."""
    _interrupt_a_waiting_acquire(client, orchestrator)


def test_ctrl_c_while_the_unary_acquire_is_being_sent_still_cancels_it(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    """An interrupt that lands while the Acquire is on its way (the stub's ``future()``
    has sent it but not returned it yet) still cancels it: the call must not be lost
    between leaving and being held by what the interrupt cancels."""
    calls = client._orchestrator("acquire")
    calls.take_unary_calls()  # the fake has no Session: what its first call would find
    fallback = calls._acquire
    sent = fallback._unary
    interrupted = threading.Event()

    class SlowToReturn:
        def future(self, request: opb.AcquireRequest, **options: Any) -> Any:
            outcome = sent.future(request, **options)
            # Returns only once the caller was interrupted (and has given up on the call).
            while not interrupted.wait(0.01):
                pass
            return outcome

    fallback._unary = SlowToReturn()
    _interrupt_a_waiting_acquire(client, orchestrator, after=interrupted.set)


def _interrupt_a_waiting_acquire(
    client: tslice.Client, orchestrator: ServerThread, *, after: Callable[[], object] = list
) -> None:
    """Ctrl-C in a thread whose acquire("g") waits (another job holds g): the thread gets
    the KeyboardInterrupt (``after`` runs once it has), and the job leaves the queue."""
    hold(orchestrator, "g", "other")
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            client.acquire("g")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    orchestrator.wait_for(lambda f: "me" in f.groups["g"].waiters)
    _interrupt(thread)
    thread.join(10)
    after()
    assert outcome and isinstance(outcome[0], KeyboardInterrupt)
    orchestrator.wait_for(lambda f: not f.groups["g"].waiters)


def _interrupt(thread: threading.Thread) -> None:
    import ctypes

    assert thread.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
    )


def test_closed_client_refuses_calls(orchestrator: ServerThread) -> None:
    client = tslice.Client(orchestrator.address, job_id="me")
    client.acquire("g")
    client.close()
    client.close()
    with pytest.raises(errors.TsliceError, match="closed"):
        client.yield_("g")


def test_raw_stub_is_reachable(client: tslice.Client) -> None:
    response = client.orchestrator_stub.ListGroups(opb.ListGroupsRequest(), timeout=5)
    assert list(response.group_ids) == ["a", "b", "g"]
