"""slice() / sliced(): ordering, release on exceptions, nesting, decorators."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import tslice
from tests.client.client_fakes import FakeOrchestrator, ServerThread
from tslice.common import errors


@pytest.fixture
def client(orchestrator: ServerThread) -> Iterator[tslice.Client]:
    with tslice.Client(orchestrator.address, job_id="me", default_group="g") as client:
        yield client


def fake(server: ServerThread) -> FakeOrchestrator:
    return server.servicer  # type: ignore[no-any-return]


def sequence(server: ServerThread) -> list[tuple[str, str]]:
    """(method, group) of every Acquire/Yield the orchestrator saw, in order."""
    return server.call(
        lambda: [
            (c.method, c.group_id) for c in fake(server).calls if c.method in {"Acquire", "Yield"}
        ]
    )


def holders(server: ServerThread) -> dict[str, str]:
    return server.call(lambda: {name: g.holder for name, g in fake(server).groups.items()})


def test_groups_are_acquired_sorted_and_yielded_in_reverse(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    with client.slice("b", "a", "b") as held:
        assert holders(orchestrator) == {"a": "me", "b": "me", "g": ""}
        assert sorted(held) == ["a", "b"] and held["a"].success
    assert sequence(orchestrator) == [
        ("Acquire", "a"),
        ("Acquire", "b"),
        ("Yield", "b"),
        ("Yield", "a"),
    ]
    assert holders(orchestrator) == {"a": "", "b": "", "g": ""}


def test_groups_are_yielded_when_the_block_raises(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    with pytest.raises(RuntimeError, match="training blew up"), client.slice("a", "b"):
        raise RuntimeError("training blew up")
    assert holders(orchestrator) == {"a": "", "b": "", "g": ""}


def test_a_failed_acquire_releases_the_groups_already_taken(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    # "zzz-missing" does not exist on the fake: NOT_FOUND after "a" was granted.
    with pytest.raises(errors.UnknownGroup), client.slice("a", "zzz-missing"):
        pytest.fail("the block must not run")
    assert sequence(orchestrator) == [
        ("Acquire", "a"),
        ("Acquire", "zzz-missing"),
        ("Yield", "a"),
    ]


def test_slice_timeout_raises_acquire_timeout_and_releases(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    orchestrator.call(lambda: setattr(fake(orchestrator).groups["b"], "holder", "other"))
    with pytest.raises(tslice.AcquireTimeout) as caught, client.slice("a", "b", timeout=0.3):
        pytest.fail("the block must not run")
    assert caught.value.group_id == "b"
    assert holders(orchestrator)["a"] == ""


def test_yield_failure_surfaces_after_a_clean_block(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    orchestrator.call(
        lambda: fake(orchestrator).failures["Yield"].append((grpc.StatusCode.INTERNAL, "disk full"))
    )
    with pytest.raises(errors.RPCError, match="disk full"), client.slice("a", "b"):
        pass
    # The other group was still yielded.
    assert holders(orchestrator)["a"] == ""


def test_yield_failure_never_hides_the_blocks_exception(
    client: tslice.Client, orchestrator: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    orchestrator.call(
        lambda: fake(orchestrator).failures["Yield"].append((grpc.StatusCode.INTERNAL, "disk full"))
    )
    with pytest.raises(KeyError), client.slice("a"):
        raise KeyError("original")
    assert "could not yield group a" in caplog.text


def test_nested_slices_hold_a_group_once(client: tslice.Client, orchestrator: ServerThread) -> None:
    with client.slice("a") as outer:
        with client.slice("a", "b") as inner:
            assert inner["a"] == outer["a"]
        # Leaving the inner slice yields only what it added.
        assert holders(orchestrator) == {"a": "me", "b": "", "g": ""}
    assert holders(orchestrator)["a"] == ""
    assert sequence(orchestrator).count(("Acquire", "a")) == 1


def test_sliced_decorator_holds_the_group_per_call(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    @client.sliced("a")
    def step(x: int) -> tuple[int, str]:
        return x * 2, holders(orchestrator)["a"]

    assert step(3) == (6, "me")
    assert step.__name__ == "step"
    assert holders(orchestrator)["a"] == ""
    assert step(4) == (8, "me")
    assert sequence(orchestrator).count(("Acquire", "a")) == 2


def test_slice_object_is_itself_a_decorator_and_reusable(
    client: tslice.Client, orchestrator: ServerThread
) -> None:
    trainer = client.slice()  # the default group

    @trainer
    def recurse(n: int) -> int:
        assert holders(orchestrator)["g"] == "me"
        return 0 if n == 0 else 1 + recurse(n - 1)

    assert recurse(3) == 3
    with trainer, trainer:
        pass
    assert sequence(orchestrator).count(("Acquire", "g")) == 2


def test_sync_decorator_refuses_coroutine_functions(client: tslice.Client) -> None:
    async def coroutine() -> None:
        pass

    with pytest.raises(TypeError, match=r"AsyncClient\.sliced"):
        client.sliced("a")(coroutine)


def test_two_threads_of_one_job_share_a_hold(
    client: tslice.Client, orchestrator: ServerThread, executor: futures.ThreadPoolExecutor
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
        assert holders(orchestrator)["a"] == "me"
    assert holders(orchestrator)["a"] == ""
    assert sequence(orchestrator) == [("Acquire", "a"), ("Yield", "a")]
