"""AcquireSet through both clients, against a real orchestrator and sim agents (processes
on loopback): a set is granted all or nothing, ``slice()`` of several groups and the RL
``weight_sync`` phase use it, leases are kept per group, a cancelled or failed set
leaves the job queued nowhere, and a re-issued set after a restart keeps its places.

Two groups on two nodes (``g1`` on node-1, ``g2`` on node-2: they share no device, so
two jobs may hold one each). Every test ends with every group free and no job queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent import futures
from typing import Any

import pytest

import tslice
from tslice.common import errors
from tslice.rl import Phases
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster, SimAgent

GiB = 1024**3
GROUPS = ("g1", "g2")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    agents = [
        SimAgent(
            name=name,
            capacity_bytes=8 * GiB,
            footprint_bytes=GiB,
            bandwidth_bytes_per_s=4000 * 10**9,
            latency_s=0.001,
        )
        for name in ("node-1", "node-2")
    ]
    with LocalCluster(agents=agents, groups={"g1": ("node-1",), "g2": ("node-2",)}) as local:
        yield local


@pytest.fixture
def address(cluster: LocalCluster) -> Iterator[str]:
    """The orchestrator; after the test, every group must be free and nobody queued
    (what is left is evicted first, so that one failure does not fail the next tests)."""
    yield cluster.orchestrator_address
    with tslice.Client(cluster.orchestrator_address, job_id=None) as observer:
        left = {}
        for group in GROUPS:
            status = observer.status(group)
            left[group] = (status.locking_job, status.waiting_jobs)
            for job in {status.locking_job, *status.waiting_jobs} - {""}:
                observer.evict(group, job, reason="left behind by a failed test")
    assert left == dict.fromkeys(GROUPS, ("", ()))


def _until(condition: Callable[[], bool], *, within_s: float = 30.0) -> None:
    """Read ``condition`` again and again until it holds (fail after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "the orchestrator never got there"
        time.sleep(0.01)


async def _until_async(condition: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + 30.0
    while not await condition():
        assert time.monotonic() < deadline, "the orchestrator never got there"
        await asyncio.sleep(0.01)


async def _statuses(observer: tslice.AsyncClient) -> list[tslice.GroupStatus]:
    return [await observer.status(group) for group in GROUPS]


def _waiting(observer: tslice.Client, job: str, *groups: str) -> Callable[[], bool]:
    return lambda: all(job in observer.status(g).waiting_jobs for g in groups)


def _holders(observer: tslice.Client) -> dict[str, str]:
    return {group: observer.status(group).locking_job for group in GROUPS}


def _interrupt(thread: threading.Thread) -> None:
    """Ctrl-C in ``thread`` (as the main thread gets it)."""
    assert thread.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
    )


@contextlib.contextmanager
def clients(address: str, *jobs: str) -> Iterator[list[tslice.Client]]:
    """A client of each job (no lease: a test's blocked thread cannot lose a group),
    then an observer."""
    with contextlib.ExitStack() as stack:
        made = [tslice.Client(address, job_id=job, lease_s=None) for job in jobs]
        made.append(tslice.Client(address, job_id=None))
        yield [stack.enter_context(client) for client in made]


@contextlib.asynccontextmanager
async def async_clients(address: str, *jobs: str) -> AsyncIterator[list[tslice.AsyncClient]]:
    """:func:`clients` of AsyncClient."""
    async with contextlib.AsyncExitStack() as stack:
        made = [tslice.AsyncClient(address, job_id=job, lease_s=None) for job in jobs]
        made.append(tslice.AsyncClient(address, job_id=None))
        yield [await stack.enter_async_context(client) for client in made]


def test_a_set_waits_holding_no_group_and_is_granted_once_every_group_is_free(
    address: str, executor: futures.ThreadPoolExecutor
) -> None:
    with clients(address, "a", "b", "c") as (a, b, c, observer):
        a.acquire("g2")
        pending = executor.submit(b.acquire_set, ["g2", "g1"])
        _until(_waiting(observer, "b", "g1", "g2"))
        # g1 is free, yet b holds nothing of its set while g2 is taken...
        assert _holders(observer) == {"g1": "", "g2": "a"}
        # ...and g1 keeps itself for b's set (set_gate): a single Acquire of it waits.
        alone = executor.submit(c.acquire, "g1")
        _until(_waiting(observer, "c", "g1"))
        assert _holders(observer) == {"g1": "", "g2": "a"}

        a.yield_("g2")
        granted = pending.result(30)
        assert list(granted) == ["g2", "g1"]  # the order asked for
        assert _holders(observer) == {"g1": "b", "g2": "b"}
        for group, result in granted.items():
            assert result.success
            assert result.grant_epoch == observer.status(group).grant_epoch
        assert "c" in observer.status("g1").waiting_jobs  # the set came first

        b.yield_("g1")
        assert alone.result(30).success
        b.yield_("g2")
        c.yield_("g1")


async def test_async_slice_of_two_groups_takes_them_in_one_set(address: str) -> None:
    async with async_clients(address, "a", "b") as (a, b, observer):
        await a.acquire("g2")
        inside = asyncio.Event()
        leave = asyncio.Event()

        async def job_b() -> dict[str, tslice.AcquireResult]:
            async with b.slice("g2", "g1") as grants:
                inside.set()
                await leave.wait()
                return dict(grants)

        task = asyncio.create_task(job_b())

        async def queued_in_both() -> bool:
            return all("b" in s.waiting_jobs for s in await _statuses(observer))

        await _until_async(queued_in_both)
        # One by one, in sorted order, b would hold g1 by now while it waits for g2.
        assert (await observer.status("g1")).locking_job == ""
        await a.yield_("g2")
        await asyncio.wait_for(inside.wait(), 30)
        assert [s.locking_job for s in await _statuses(observer)] == ["b", "b"]
        leave.set()
        grants = await task
        assert sorted(grants) == ["g1", "g2"] and all(r.success for r in grants.values())
        assert [s.locking_job for s in await _statuses(observer)] == ["", ""]


def test_a_sets_leases_are_kept_and_run_out_per_group(address: str) -> None:
    lease_s = 0.5
    with tslice.Client(address, job_id=None) as observer:
        client = tslice.Client(address, job_id="leased", lease_s=lease_s)
        granted = client.acquire_set(["g1", "g2"])
        # One keeper (Hold stream) per group, for that group's grant.
        keepers = {group: client._keepers[("leased", group)] for group in GROUPS}
        assert {g: k._request.grant_epoch for g, k in keepers.items()} == {
            g: r.grant_epoch for g, r in granted.items()
        }
        # Held well past the lease: each keeper kept its group.
        threading.Event().wait(3 * lease_s)
        assert _holders(observer) == {"g1": "leased", "g2": "leased"}
        assert client.lost_leases == {}
        # Gone without a yield (the keepers stop): each group runs out on its own lease.
        client.close()
        _until(lambda: _holders(observer) == {"g1": "", "g2": ""})


async def test_a_cancelled_async_set_leaves_the_job_queued_nowhere(address: str) -> None:
    async with async_clients(address, "a", "b", "c") as (a, b, c, observer):
        await a.acquire("g2")
        task = asyncio.create_task(b.acquire_set(["g1", "g2"]))

        async def b_waits(where: bool) -> bool:
            return all(("b" in s.waiting_jobs) is where for s in await _statuses(observer))

        await _until_async(lambda: b_waits(True))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until_async(lambda: b_waits(False))
        # g1 no longer keeps itself for the set that left.
        assert (await c.acquire("g1", timeout=30)).success
        await c.yield_("g1")
        await a.yield_("g2")


@pytest.mark.parametrize("moment", ["waiting", "sending"])
def test_ctrl_c_during_a_set_leaves_the_job_queued_nowhere(address: str, moment: str) -> None:
    """Ctrl-C while the set waits, or while the call is still on its way (the stub's
    ``future()`` has sent it but not returned it: the interrupt must not lose the call)."""
    with clients(address, "a", "b") as (a, b, observer):
        a.acquire("g2")
        interrupted = threading.Event()
        if moment == "sending":
            fallback = b._orchestrator("acquire a set of groups")._acquire_set
            sent = fallback._unary

            class SlowToReturn:
                def future(self, request: object, **options: Any) -> Any:
                    outcome = sent.future(request, **options)
                    while not interrupted.wait(0.01):  # until the caller has given up
                        pass
                    return outcome

            fallback._unary = SlowToReturn()
        outcome: list[BaseException] = []

        def waiter() -> None:
            try:
                with b.slice("g1", "g2"):
                    pass
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        _until(_waiting(observer, "b", "g1", "g2"))
        _interrupt(thread)
        thread.join(30)
        interrupted.set()
        assert outcome and isinstance(outcome[0], KeyboardInterrupt)
        _until(lambda: not any("b" in observer.status(g).waiting_jobs for g in GROUPS))
        assert _holders(observer) == {"g1": "", "g2": "a"}
        a.yield_("g2")


def test_refused_and_timed_out_sets_raise_the_acquire_errors(address: str) -> None:
    with clients(address, "a", "b") as (a, b, observer):
        epoch = observer.status("g1").grant_epoch
        with pytest.raises(errors.UnknownGroup, match="nope"):
            b.acquire_set(["g1", "nope"])
        with pytest.raises(errors.UnknownGroup, match="nope"), b.slice("g1", "nope"):
            pass
        # g1 was not asked for (no grant and yield in between): checked before any group.
        assert observer.status("g1").grant_epoch == epoch
        with pytest.raises(errors.InvalidArgument, match="at most 16"):
            b.acquire_set([f"x{i}" for i in range(17)])
        with pytest.raises(TypeError, match="not one string"):
            b.acquire_set("g1")
        with pytest.raises(ValueError, match="empty"):
            b.acquire_set([])

        a.acquire("g2")
        with pytest.raises(errors.AcquireTimeout) as timed_out:
            b.acquire_set(["g1", "g2"], timeout=0.5)
        assert "groups 'g1', 'g2' together" in str(timed_out.value)
        assert "no longer queued" in str(timed_out.value)
        assert timed_out.value.job_id == "b"
        _until(lambda: not any("b" in observer.status(g).waiting_jobs for g in GROUPS))
        assert _holders(observer) == {"g1": "", "g2": "a"}
        a.yield_("g2")


def test_a_set_evicted_from_one_group_is_aborted_and_queued_nowhere(
    address: str, executor: futures.ThreadPoolExecutor
) -> None:
    with clients(address, "a", "b") as (a, b, observer):
        a.acquire("g2")
        pending = executor.submit(b.acquire_set, ["g1", "g2"])
        _until(_waiting(observer, "b", "g1", "g2"))
        observer.evict("g2", "b", reason="maintenance")
        with pytest.raises(errors.Aborted, match="maintenance"):
            pending.result(30)
        _until(lambda: not any("b" in observer.status(g).waiting_jobs for g in GROUPS))
        assert _holders(observer) == {"g1": "", "g2": "a"}
        a.yield_("g2")


def test_nested_slices_take_only_the_groups_not_held_yet(address: str) -> None:
    with clients(address, "n") as (client, observer):
        with client.slice("g1") as outer:
            with client.slice("g2", "g1") as inner:
                assert inner["g1"] == outer["g1"]  # shared, not acquired again
                assert _holders(observer) == {"g1": "n", "g2": "n"}
            assert _holders(observer) == {"g1": "n", "g2": ""}
        assert _holders(observer) == {"g1": "", "g2": ""}


def test_weight_sync_takes_both_pools_in_one_set(
    address: str, executor: futures.ThreadPoolExecutor
) -> None:
    with (
        clients(address, "other", "rl") as (other, client, observer),
        Phases(trainer_group="g1", sampler_group="g2", client=client) as phases,
    ):
        other.acquire("g2")  # the sampler pool is busy
        begun = executor.submit(phases.begin, "weight_sync")
        _until(_waiting(observer, "rl", "g1", "g2"))
        # One by one (trainer group first) the job would hold the trainer pool by now.
        assert _holders(observer) == {"g1": "", "g2": "other"}
        other.yield_("g2")
        assert sorted(begun.result(30)) == ["g1", "g2"]
        assert _holders(observer) == {"g1": "rl", "g2": "rl"}
        phases.end("weight_sync")
        assert _holders(observer) == {"g1": "", "g2": ""}


def test_a_set_reissued_after_an_orchestrator_restart_keeps_its_places(
    cluster: LocalCluster, address: str, executor: futures.ThreadPoolExecutor
) -> None:
    with clients(address, "a", "b") as (a, b, observer):
        a.acquire("g2")
        pending = executor.submit(b.acquire_set, ["g1", "g2"])
        _until(_waiting(observer, "b", "g1", "g2"))
        cluster.restart(ORCHESTRATOR)
        _until(_waiting(observer, "b", "g1", "g2"))  # re-issued, re-attached
        assert not pending.done()
        assert _holders(observer) == {"g1": "", "g2": "a"}
        a.yield_("g2")
        assert sorted(pending.result(30)) == ["g1", "g2"]
        assert _holders(observer) == {"g1": "b", "g2": "b"}
        b.yield_("g1")
        b.yield_("g2")
