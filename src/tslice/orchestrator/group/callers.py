"""The RPCs a group answers later (Acquire waiters, Hold streams), the Acquires' deadlines,
and the check that refuses at once an Acquire that could never be granted.

An Acquire is a :class:`Waiter`: a future the group's executor resolves when a grant
reaches its job (``effects.Deliver``) or fails when the lock aborts it
(``effects.Refuse``). Nothing waits in a task for it: a unary RPC awaits the future, a
Session request is answered from the future's callback (``rpc.multiplex.serve``). A
waiter whose future is cancelled (its RPC was cancelled or its Session request withdrawn)
departs: the driver is told once, and the group withdraws it from the queue.

A deadline (the nearer of the call's gRPC deadline and the request's ``timeout_ms``) is
two timers, not a task: shortly before it, a waiter that a fault or a drain holds back
is refused UNAVAILABLE with the reason, so the caller learns why instead of gRPC's bare
DEADLINE_EXCEEDED; at it, any other waiter is refused DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Collection, Sequence
from typing import Protocol

from tslice.orchestrator import config
from tslice.rpc import refusals

#: How long before an Acquire's deadline a waiter that a fault (or a drain) holds back is
#: answered UNAVAILABLE with the reason, instead of gRPC's DEADLINE_EXCEEDED that names none.
ANSWER_BEFORE_DEADLINE_S = 0.2


@dataclasses.dataclass(frozen=True)
class Grant:
    epoch: int
    restored: bool
    #: Seconds from the Acquire to its grant.
    waited_s: float = 0.0


class Group(Protocol):
    """What a waiter's deadline asks of its group."""

    group_id: str

    def held_back_by(self) -> str:
        """What keeps the group from granting, and what to do ("" = nothing: it is busy)."""

    def depart(self, waiter: Waiter) -> None:
        """``waiter`` stops waiting (withdrawn; or, granted, its reply undelivered)."""


@dataclasses.dataclass(eq=False)
class Waiter:
    """One Acquire RPC of ``job`` (``set_seq``: a part of that AcquireSet)."""

    job: str
    future: asyncio.Future[Grant]
    group: Group
    set_seq: int | None = None
    #: When the Acquire arrived (``time.monotonic()``).
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: The grant it received (so that one that departs undelivered gives it back).
    granted_epoch: int | None = None
    #: Its deadline's timers (None: it has none).
    timers: tuple[asyncio.TimerHandle, ...] = ()


@dataclasses.dataclass(eq=False)
class HoldSession:
    """One open Hold stream of the holder: while any is open, its lease cannot expire."""

    job: str
    epoch: int
    lease_ms: int
    #: Resolved when the stream must end: "" = the job yielded, else why the lock was lost.
    ended: asyncio.Future[str]


def new_waiter(group: Group, job: str, *, set_seq: int | None, time_left: float | None) -> Waiter:
    """An Acquire of ``job`` that departs from ``group`` when its future is cancelled, and
    whose deadline (``time_left`` seconds; None: none) is kept by timers."""
    loop = asyncio.get_running_loop()
    waiter = Waiter(job, loop.create_future(), group, set_seq)
    waiter.future.add_done_callback(_Departure(group, waiter))
    if time_left is not None:
        warn_in = max(0.0, time_left - ANSWER_BEFORE_DEADLINE_S)
        waiter.timers = (
            loop.call_later(warn_in, _held_back, group, waiter),
            loop.call_later(time_left, _expired, group, waiter, time_left),
        )
    return waiter


def undelivered(waiter: Waiter) -> None:
    """The RPC went away after its grant, before the reply went out: it departs (the
    grant is given back unless another RPC of the job was answered with it)."""
    waiter.group.depart(waiter)


class _Departure:
    """The future's callback: a cancelled Acquire departs (its timers stop in any case)."""

    __slots__ = ("_group", "_waiter")

    def __init__(self, group: Group, waiter: Waiter) -> None:
        self._group, self._waiter = group, waiter

    def __call__(self, future: asyncio.Future[Grant]) -> None:
        for timer in self._waiter.timers:
            timer.cancel()
        if future.cancelled():
            self._group.depart(self._waiter)


def _held_back(group: Group, waiter: Waiter) -> None:
    why = group.held_back_by()
    if why and not waiter.future.done():
        group.depart(waiter)
        waiter.future.set_exception(
            refusals.Refused(
                refusals.Code.UNAVAILABLE,
                f"group {group.group_id}: job {waiter.job} was not granted within the call's "
                f"deadline: {why}",
            )
        )


def _expired(group: Group, waiter: Waiter, time_left: float) -> None:
    if waiter.future.done():
        return
    group.depart(waiter)
    waiter.future.set_exception(
        refusals.Refused(
            refusals.Code.DEADLINE_EXCEEDED,
            f"group {group.group_id}: job {waiter.job} was not granted within its deadline "
            f"({time_left * 1000:.0f} ms: the nearer of timeout_ms and the call's deadline); "
            "it left the queue",
        )
    )


def deliver(waiters: Sequence[Waiter], epoch: int, restored: bool) -> None:
    now = time.monotonic()
    for w in waiters:
        if not w.future.done():
            w.future.set_result(Grant(epoch, restored, now - w.started))


def refuse(waiters: Sequence[Waiter], code: refusals.Code, message: str) -> None:
    for w in waiters:
        if not w.future.done():
            w.future.set_exception(refusals.Refused(code, message))


def drained(group_id: str) -> str:
    """Why a drained group holds its waiters back, and what to do."""
    return (
        f"group {group_id} is drained by an administrator; it grants again after "
        f"`tslice admin resume {group_id}`"
    )


def faulted(group_id: str, detail: str) -> str:
    """Why a fault (``detail``) holds a group's waiters back, and what to do."""
    return f"{detail}; the group retries on its own: call again, or see `tslice status {group_id}`"


def never_fits(
    nodes: Sequence[tuple[config.NodeRef, Sequence[int]]],
    *,
    group_id: str,
    job: str,
    footprint_bytes: int,
) -> refusals.Refused | None:
    """The refusal (RESOURCE_EXHAUSTED) of a footprint that some device of the group can
    never hold: such a job could never be resident there, and would otherwise wait behind
    the holder until its deadline. ``nodes``: each node with the memory of every device it
    lists (its last Status read); a footprint is per device, so it must fit on each device
    the group uses there (the node's ``devices``, else all of them). A node that lists no
    devices (noop, llm-d's agents) is not checked."""
    for node, totals in nodes:
        used = [totals[i] for i in node.devices if 0 <= i < len(totals)] if node.devices else totals
        if used and footprint_bytes > min(used):
            which = (
                f"device(s) {', '.join(map(str, node.devices))} of node {node.name}"
                if node.devices
                else f"each device of node {node.name}"
            )
            return refusals.Refused(
                refusals.Code.RESOURCE_EXHAUSTED,
                f"job {job!r} declares a footprint of {footprint_bytes} bytes per device, but "
                f"{which} (group {group_id!r}) holds only {min(used)} bytes: it can never be "
                "resident there; lower footprint_bytes or use a group of larger devices",
            )
    return None


def no_room(
    queue: Collection[str], holder: str | None, *, job: str, cap: int, group_id: str
) -> refusals.Refused | None:
    """The refusal (RESOURCE_EXHAUSTED) of a new waiter once ``cap`` jobs wait for the
    group (``limits.max_waiters_per_group``): every waiter costs memory, a row on disk
    and a place in every status read. A job already queued, or the holder, is let in (a
    re-issued Acquire re-attaches to its place)."""
    if len(queue) < cap or job in queue or job == holder:
        return None
    return refusals.Refused(
        refusals.Code.RESOURCE_EXHAUSTED,
        f"group {group_id!r} already has {len(queue)} jobs waiting, its cap "
        f"(limits.max_waiters_per_group = {cap}); retry later, or raise the cap in the "
        "orchestrator's config",
    )
