"""slice() / sliced(): ordering, release on exceptions, nesting, decorators (real
orchestrators: ours, and one as llm-d's, without AcquireSet, where a slice takes its
groups one by one in sorted order)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import tslice
from tests.client.servers import Orchestrator
from tslice.common import errors


def _client(orchestrator: Orchestrator) -> Iterator[tslice.Client]:
    with tslice.Client(orchestrator.address, job_id="me", default_group="g") as client:
        yield client


@pytest.fixture
def client(orchestrator: Orchestrator) -> Iterator[tslice.Client]:
    yield from _client(orchestrator)


@pytest.fixture
def llm_d_client(llm_d_orchestrator: Orchestrator) -> Iterator[tslice.Client]:
    yield from _client(llm_d_orchestrator)


def test_without_acquire_set_groups_are_acquired_sorted_and_yielded_in_reverse(
    llm_d_client: tslice.Client, llm_d_orchestrator: Orchestrator
) -> None:
    with llm_d_client.slice("b", "a", "b") as held:
        assert llm_d_orchestrator.holders() == {"a": "me", "b": "me", "g": ""}
        assert sorted(held) == ["a", "b"] and held["a"].success
    assert llm_d_orchestrator.lock_calls() == [
        ("Acquire", "a"),
        ("Acquire", "b"),
        ("Yield", "b"),
        ("Yield", "a"),
    ]
    assert llm_d_orchestrator.holders() == {"a": "", "b": "", "g": ""}


def test_with_acquire_set_groups_are_taken_together_and_yielded_in_reverse(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    with client.slice("b", "a", "b") as held:
        assert orchestrator.holders() == {"a": "me", "b": "me", "g": ""}
        assert sorted(held) == ["a", "b"]
    assert len(orchestrator.script.calls_of("AcquireSet")) == 1
    assert orchestrator.lock_calls() == [("Yield", "b"), ("Yield", "a")]


def test_groups_are_yielded_when_the_block_raises(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    with pytest.raises(RuntimeError, match="training blew up"), client.slice("a", "b"):
        raise RuntimeError("training blew up")
    assert orchestrator.holders() == {"a": "", "b": "", "g": ""}


def test_a_failed_acquire_releases_the_groups_already_taken(
    llm_d_client: tslice.Client, llm_d_orchestrator: Orchestrator
) -> None:
    # "zzz-missing" is no group of the topology: NOT_FOUND after "a" was granted.
    with pytest.raises(errors.UnknownGroup), llm_d_client.slice("a", "zzz-missing"):
        pytest.fail("the block must not run")
    assert llm_d_orchestrator.lock_calls() == [
        ("Acquire", "a"),
        ("Acquire", "zzz-missing"),
        ("Yield", "a"),
    ]


def test_slice_timeout_raises_acquire_timeout_and_releases(
    llm_d_client: tslice.Client, llm_d_orchestrator: Orchestrator
) -> None:
    with tslice.Client(llm_d_orchestrator.address, job_id="other", lease_s=None) as other:
        other.acquire("b")
        with (
            pytest.raises(tslice.AcquireTimeout) as caught,
            llm_d_client.slice("a", "b", timeout=0.3),
        ):
            pytest.fail("the block must not run")
    assert caught.value.group_id == "b"
    assert llm_d_orchestrator.holder("a") == ""


def test_yield_failure_surfaces_after_a_clean_block(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    orchestrator.script.fail_next("Yield", grpc.StatusCode.INTERNAL, "disk full")
    with pytest.raises(errors.RPCError, match="disk full"), client.slice("a", "b"):
        pass
    # The other group was still yielded.
    assert orchestrator.holder("a") == ""


def test_yield_failure_never_hides_the_blocks_exception(
    client: tslice.Client, orchestrator: Orchestrator, caplog: pytest.LogCaptureFixture
) -> None:
    orchestrator.script.fail_next("Yield", grpc.StatusCode.INTERNAL, "disk full")
    with pytest.raises(KeyError), client.slice("a"):
        raise KeyError("original")
    assert "could not yield group a" in caplog.text


def test_nested_slices_hold_a_group_once(client: tslice.Client, orchestrator: Orchestrator) -> None:
    with client.slice("a") as outer:
        with client.slice("a", "b") as inner:
            assert inner["a"] == outer["a"]
        # Leaving the inner slice yields only what it added.
        assert orchestrator.holders() == {"a": "me", "b": "", "g": ""}
    assert orchestrator.holder("a") == ""
    assert orchestrator.lock_calls().count(("Acquire", "a")) == 1


def test_sliced_decorator_holds_the_group_per_call(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    @client.sliced("a")
    def step(x: int) -> tuple[int, str]:
        return x * 2, orchestrator.holder("a")

    assert step(3) == (6, "me")
    assert step.__name__ == "step"
    assert orchestrator.holder("a") == ""
    assert step(4) == (8, "me")
    assert orchestrator.lock_calls().count(("Acquire", "a")) == 2


def test_slice_object_is_itself_a_decorator_and_reusable(
    client: tslice.Client, orchestrator: Orchestrator
) -> None:
    trainer = client.slice()  # the default group

    @trainer
    def recurse(n: int) -> int:
        assert orchestrator.holder("g") == "me"
        return 0 if n == 0 else 1 + recurse(n - 1)

    assert recurse(3) == 3
    with trainer, trainer:
        pass
    assert orchestrator.lock_calls().count(("Acquire", "g")) == 2


def test_sync_decorator_refuses_coroutine_functions() -> None:
    client = tslice.Client(None)

    async def coroutine() -> None:
        pass

    with pytest.raises(TypeError, match=r"AsyncClient\.sliced"):
        client.sliced("a")(coroutine)


def test_two_threads_of_one_job_share_a_hold(
    client: tslice.Client, orchestrator: Orchestrator, executor: futures.ThreadPoolExecutor
) -> None:
    """The second thread's slice rides on the first's grant; the group is yielded
    only when the last of them leaves."""
    entered = futures.Future[None]()
    leave = futures.Future[None]()

    def first() -> None:
        with client.slice("a"):
            entered.set_result(None)
            leave.result(10)

    running = executor.submit(first)
    entered.result(10)
    with client.slice("a"):
        leave.set_result(None)
        running.result(10)
        assert orchestrator.holder("a") == "me"
    assert orchestrator.holder("a") == ""
    assert orchestrator.lock_calls() == [("Acquire", "a"), ("Yield", "a")]
