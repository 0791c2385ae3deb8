"""What the AcquireSet end-to-end tests share: a process stack, raw stubs, the checks.

Real ``python -m tslice orchestrator|agent`` processes on loopback
(``tests/faults/processes.Stack``: groups on device subsets of two sim agents, so each
test has groups of its own that never contend with another test's), raw grpc.aio stubs
(what a user of the wire sees: status codes and messages, no client-side retries), and
two checks: the device journals against the windows the jobs saw (``tslice.sim.checker``)
and, from the orchestrator's own events, that every set was granted all-or-nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from tests.faults.processes import GroupNodes, Process, Stack
from tests.faults.stack import WAIT_S, K, Orchestrator
from tslice.agent.backends import simdevice
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.sim import checker
from tslice.sim.checker import Window

NODES = ("node-a", "node-b")
#: Fast copies (1 GiB at 1 TB/s): a switch is over in milliseconds; scenarios that need
#: one in flight freeze its agent (SIGSTOP) instead of relying on a slow copy.
AGENT_FLAGS = [
    "--backend", "sim", "--sim-devices", "16", "--sim-capacity", "80GiB",
    "--sim-footprint", "1GiB", "--sim-bandwidth", "1TB/s", "--sim-latency", "0",
]  # fmt: skip
SETTINGS = {
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.25,
    # An agent frozen for a few seconds is not given up on meanwhile.
    "agent_rpc_timeout_s": 20.0,
    "status_timeout_s": 1.0,
    "shutdown_grace_s": 1.0,
}


@contextlib.contextmanager
def running_stack(
    groups: Mapping[str, GroupNodes], settings: Mapping[str, Any] | None = None
) -> Iterator[Stack]:
    """The stack (``settings``: orchestrator settings besides :data:`SETTINGS`)."""
    base = Path(tempfile.mkdtemp(prefix="ts-set-"))
    merged = {**SETTINGS, **(settings or {})}
    stack = Stack(base, {n: AGENT_FLAGS for n in NODES}, groups, orchestrator_settings=merged)
    try:
        yield stack.start()
    finally:
        stack.stop()
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def frozen(*agents: Process) -> Iterator[None]:
    """The agents stopped (SIGSTOP): every call to them is in flight until the block ends."""
    for agent in agents:
        agent.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for agent in agents:
            agent.signal(signal.SIGCONT)


class SetOrchestrator(Orchestrator):
    """The fault tests' raw stubs, with AcquireSet and Hold."""

    async def acquire_set(
        self, job: str, *groups: str, timeout: float = WAIT_S, lease_ms: int = 0
    ) -> opb.AcquireSetResponse:
        request = opb.AcquireSetRequest(job_id=job, group_ids=groups, lease_ms=lease_ms)
        reply: opb.AcquireSetResponse = await self.stub.AcquireSet(
            request, timeout=timeout, wait_for_ready=True
        )
        assert reply.success and [g.group_id for g in reply.grants] == list(groups), reply
        return reply

    def acquiring_set(
        self, job: str, *groups: str, timeout: float = WAIT_S, lease_ms: int = 0
    ) -> asyncio.Task[opb.AcquireSetResponse]:
        return asyncio.ensure_future(
            self.acquire_set(job, *groups, timeout=timeout, lease_ms=lease_ms)
        )

    async def refusal(self, request: opb.AcquireSetRequest) -> grpc.aio.AioRpcError:
        """The error an AcquireSet that must be refused ends with."""
        try:
            reply = await self.stub.AcquireSet(request, timeout=WAIT_S, wait_for_ready=True)
        except grpc.aio.AioRpcError as err:
            return err
        raise AssertionError(f"AcquireSet {request} was not refused: {reply}")

    def hold(self, job: str, group: str, epoch: int) -> Any:
        request = opb.HoldRequest(job_id=job, group_id=group, grant_epoch=epoch)
        return self.stub.Hold(request, timeout=WAIT_S * 2, wait_for_ready=True)

    async def waiting(self, group: str) -> tuple[str, list[str]]:
        """``(locking_job, waiting_jobs)`` of a group."""
        status = await self.status(group)
        return status.locking_job, list(status.waiting_jobs)


@contextlib.asynccontextmanager
async def connected(stack: Stack) -> AsyncIterator[SetOrchestrator]:
    o = SetOrchestrator(stack.orchestrator.address)
    try:
        yield o
    finally:
        await o.close()


@contextlib.asynccontextmanager
async def held_by(
    stack: Stack,
    holders: Mapping[str, str],
    *,
    windows: Windows | None = None,
    kinds: Sequence[int] = (),
) -> AsyncIterator[tuple[SetOrchestrator, Recorder]]:
    """Connected, each group of ``holders`` (group -> job) held by its job (its window
    in ``windows``), then the events (of ``kinds``; none: all) recorded from there on."""
    async with connected(stack) as o:
        for group, job in holders.items():
            await (o.acquire(job, group) if windows is None else windows.take(o, job, group))
        async with Recorder(o.stub, kinds) as events:
            yield o, events


# ---- the orchestrator's events, every group ---------------------------------------------


def at(event: opb.OrchestratorEvent) -> float:
    return event.time.seconds + event.time.nanos / 1e9


class Recorder:
    """Every event of every group (of ``kinds``; none: all), read in the background."""

    def __init__(self, stub: Any, kinds: Sequence[int] = ()) -> None:
        request = opb.WatchEventsRequest(kinds=kinds)
        self.call = stub.WatchEvents(request, wait_for_ready=True)
        self.seen: list[opb.OrchestratorEvent] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Recorder:
        await self.call.initial_metadata()  # subscribed from here on
        self._task = asyncio.ensure_future(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.call.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._task

    async def _read(self) -> None:
        async for event in self.call:
            self.seen.append(event)
            self._changed.set()

    async def until(self, count: int, kind: int, groups: Collection[str], job: str = "") -> None:
        """Until ``count`` events of ``kind`` on ``groups`` (of ``job``, if given) were seen."""

        async def wait() -> None:
            while self.count(kind, groups, job) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), WAIT_S)

    async def wait_for(self, kind: int, group: str, job: str) -> opb.OrchestratorEvent:
        """The first event of ``kind`` on ``group`` about ``job`` (waiting for it)."""
        await self.until(1, kind, (group,), job)
        return next(e for e in self.seen if _is(e, kind, (group,), job))

    def count(self, kind: int, groups: Collection[str], job: str = "") -> int:
        return sum(1 for e in self.seen if _is(e, kind, groups, job))


def _is(event: opb.OrchestratorEvent, kind: int, groups: Collection[str], job: str) -> bool:
    return event.kind == kind and event.group_id in groups and (not job or event.job_id == job)


async def queued_set(
    o: SetOrchestrator, events: Recorder, job: str, *groups: str
) -> asyncio.Task[opb.AcquireSetResponse]:
    """``job``'s AcquireSet of ``groups`` (the call), once it waits in each group's queue."""
    call = o.acquiring_set(job, *groups)
    for group in groups:
        await events.wait_for(K.KIND_QUEUED, group, job)
    return call


async def queued(o: SetOrchestrator, events: Recorder, job: str, group: str) -> asyncio.Task[Any]:
    """``job``'s Acquire of ``group`` (the call), once it waits in the queue."""
    call = o.acquiring(job, group)
    await events.wait_for(K.KIND_QUEUED, group, job)
    return call


async def kept_for_a_set(
    o: SetOrchestrator,
    events: Recorder,
    job: str,
    groups: Sequence[str],
    *,
    kept: str,
    holder: str,
    late: str,
    windows: Windows | None = None,
) -> tuple[asyncio.Task[opb.AcquireSetResponse], asyncio.Task[Any]]:
    """``job`` asks for ``groups`` as a set, ``late`` for ``kept`` alone, then ``kept``'s
    holder yields: the group is free but kept for the set (the yield's decision is taken
    before its reply, so a grant would show in the status read here). The two calls.
    ``windows``: where the holder's window is closed."""
    its_set = await queued_set(o, events, job, *groups)
    alone = await queued(o, events, late, kept)
    await (o.yield_(holder, kept) if windows is None else windows.give(o, holder, kept))
    assert (await o.waiting(kept)) == ("", [job, late])
    return its_set, alone


@dataclasses.dataclass(frozen=True)
class Taken:
    """One grant a job saw: the epoch of each group it got (one group: an Acquire)."""

    job: str
    epochs: Mapping[str, int]


@dataclasses.dataclass
class _Tenure:
    job: str
    start: float
    end: float = float("inf")


def _tenures(events: Sequence[opb.OrchestratorEvent]) -> dict[tuple[str, int], _Tenure]:
    """Per (group, epoch): who held it from when (the switch's start, or the grant without
    one) until its yield or the grant's cancellation."""
    tenures: dict[tuple[str, int], _Tenure] = {}
    open_now: dict[tuple[str, str], _Tenure] = {}
    for e in sorted(events, key=at):
        key = (e.group_id, e.job_id)
        if e.kind in (K.KIND_SWITCH_STARTED, K.KIND_GRANTED) and e.grant_epoch > 0:
            if (e.group_id, e.grant_epoch) not in tenures:
                tenure = _Tenure(e.job_id, at(e))
                tenures[(e.group_id, e.grant_epoch)] = open_now[key] = tenure
        elif e.kind in (K.KIND_YIELDED, K.KIND_CANCELLED) and key in open_now:
            open_now.pop(key).end = at(e)
    return tenures


def all_or_nothing_violations(
    events: Sequence[opb.OrchestratorEvent], taken: Sequence[Taken]
) -> list[str]:
    """Where a set was not granted all-or-nothing: when the first group of a job's set was
    granted to it (its switch started), another job still held one of the set's groups,
    or took one before the job's own grant of it."""
    tenures = _tenures(events)
    found: list[str] = []
    for t in taken:
        if len(t.epochs) < 2:
            continue
        mine = {g: tenures.get((g, e)) for g, e in t.epochs.items()}
        missing = sorted(g for g, tenure in mine.items() if tenure is None)
        if missing:
            found.append(f"job {t.job}: no event of its grant of {missing} ({dict(t.epochs)})")
            continue
        first = min(tenure.start for tenure in mine.values() if tenure is not None)
        for (group, epoch), other in tenures.items():
            own = mine.get(group)
            if own is None or epoch == t.epochs[group] or other.job == t.job:
                continue
            if other.start < own.start and other.end > first:
                found.append(
                    f"job {t.job}'s set {dict(t.epochs)} got its first group at {first:.6f} "
                    f"while job {other.job} held {group} (epoch {epoch}, "
                    f"{other.start:.6f}..{other.end:.6f})"
                )
    return found


def kept_free(events: Sequence[opb.OrchestratorEvent], taken: Sequence[Taken]) -> int:
    """Sets for which a group was free (its last holder gone) before the set was granted:
    the group was kept for the set meanwhile (not vacuous: sets did wait for each other)."""
    tenures = _tenures(events)
    count = 0
    for t in taken:
        mine = [tenures.get((g, e)) for g, e in t.epochs.items()]
        if len(mine) < 2 or None in mine:
            continue
        first = min(x.start for x in mine if x is not None)
        freed = [
            max((o.end for (g2, e2), o in tenures.items() if g2 == g and e2 < e), default=0.0)
            for g, e in t.epochs.items()
        ]
        count += min(freed) < max(freed) <= first
    return count


class Windows:
    """The windows the jobs saw (for the journal checker) and the grants they got."""

    def __init__(self) -> None:
        self.seen: list[Window] = []
        self.taken: list[Taken] = []

    async def take(self, o: SetOrchestrator, job: str, *groups: str) -> Mapping[str, int]:
        """Acquire one group, or several as a set; the grant epoch of each."""
        asked = time.time()
        if len(groups) == 1:
            epochs = {groups[0]: (await o.acquire(job, groups[0])).grant_epoch}
        else:
            reply = await o.acquire_set(job, *groups)
            epochs = {g.group_id: g.grant_epoch for g in reply.grants}
        self.granted(job, epochs, asked)
        return epochs

    def granted(self, job: str, epochs: Mapping[str, int], asked: float) -> None:
        now = time.time()
        self.seen += [Window(job=job, group=g, requested=asked, acquired=now) for g in epochs]
        self.taken.append(Taken(job, epochs))

    async def give(self, o: SetOrchestrator, job: str, group: str) -> None:
        window = next(w for w in reversed(self.seen) if (w.job, w.group) == (job, group))
        # The window closes before the Yield RPC (the state may move right after).
        window.yielded = time.time()
        await o.yield_(job, group)


async def cut_by_the_kill(call: asyncio.Future[Any]) -> None:
    """A call cut by the orchestrator's death fails UNAVAILABLE (a client re-issues it)."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        return
    raise AssertionError("a call outlived the orchestrator it was made to")


# ---- random jobs ----------------------------------------------------------------------------


async def random_job(
    o: SetOrchestrator, job: str, groups: Sequence[str], *, cycles: int, windows: Windows
) -> None:
    rng = random.Random(job)
    for _ in range(cycles):
        # A single group, or a set of 2-3 named in a random order.
        names = rng.sample(groups, rng.choice([1, 2, 2, 3]))
        await windows.take(o, job, *names)
        await asyncio.sleep(rng.uniform(0, 0.01))  # the job's work on its groups
        for group in rng.sample(names, len(names)):
            await windows.give(o, job, group)
        await asyncio.sleep(rng.uniform(0, 0.01))


async def random_jobs(
    address: str, groups: Sequence[str], *, jobs: int = 6, cycles: int = 8
) -> Windows:
    """``jobs`` random jobs over ``groups`` until each did ``cycles`` turns; checks that
    none deadlocked and, from the orchestrator's events, that every set was granted
    all-or-nothing. The windows, for the journal checker."""
    windows = Windows()
    o = SetOrchestrator(address)
    try:
        async with Recorder(o.stub) as events:
            runs = [random_job(o, f"job-{i}", groups, cycles=cycles, windows=windows)
                    for i in range(jobs)]  # fmt: skip
            # The bound only turns a deadlock into a failure (each call has its own too).
            await asyncio.wait_for(asyncio.gather(*runs), WAIT_S * 3)
            await events.until(len(windows.seen), K.KIND_YIELDED, groups)  # all delivered
    finally:
        await o.close()
    assert all(w.acquired and w.yielded for w in windows.seen)
    assert all_or_nothing_violations(events.seen, windows.taken) == []
    # Not vacuous: sets of 2 and 3, and some set found a group free before the rest.
    assert {len(t.epochs) for t in windows.taken} == {1, 2, 3}
    assert kept_free(events.seen, windows.taken) > 0
    return windows


# ---- the device journals ------------------------------------------------------------------


def journal_violations(
    stack: Stack,
    windows: Sequence[Window],
    groups: Mapping[str, GroupNodes],
    conflicts: Mapping[str, Collection[str]] | None = None,
) -> list[checker.Violation]:
    """The checker over this test's groups' journal lines and windows (``conflicts``: the
    groups that share devices with each; default none)."""
    journal = [
        e
        for name in NODES
        for e in simdevice.read_journal(stack.agents[name].state_dir / simdevice.JOURNAL_FILE)
        if e.group in groups
    ]
    return checker.check(
        journal=journal,
        windows=windows,
        group_nodes={g: list(nodes) for g, nodes in groups.items()},
        conflicts=conflicts or {g: () for g in groups},
    )


def no_violations(violations: Sequence[object]) -> str:
    return "\n".join(map(str, violations))
