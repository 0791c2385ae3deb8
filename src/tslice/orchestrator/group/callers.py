"""The RPC callers a group answers later: Acquire waiters and Yield replies.

An Acquire waits on a future that the group's worker resolves when a grant reaches
its job, or fails when the lock aborts it; a Yield waits on a reply the worker
resolves once the yield is persisted. :class:`Callers` keeps those futures (which
job each waiter waits for, which grant it received, so that one that departs
undelivered gives the grant back) and fails them all at shutdown. Also here: the
check that refuses at once an Acquire that could never be granted, and the wait that
answers a caller a fault holds back before its deadline, with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from tslice.orchestrator import config
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import inbox
from tslice.orchestrator.switch import plan as steps
from tslice.orchestrator.switch import pool as agents
from tslice.rpc import refusals

#: How long before an Acquire's deadline a waiter that a fault (or a drain) holds back is answered
#: UNAVAILABLE with the reason, instead of gRPC's DEADLINE_EXCEEDED that names none.
_ANSWER_BEFORE_DEADLINE_S = 0.2


@dataclasses.dataclass(frozen=True)
class Grant:
    epoch: int
    restored: bool


@dataclasses.dataclass(eq=False)
class Waiter:
    job: str
    future: asyncio.Future[Grant]
    granted_epoch: int | None = None
    #: The set it is a part of (AcquireSet), answered only with the whole set.
    set_seq: int | None = None

    @classmethod
    def new(cls, job: str, set_seq: int | None = None) -> Waiter:
        return cls(job, asyncio.get_running_loop().create_future(), set_seq=set_seq)


class Callers:
    """The Acquire waiters and Yield replies of one group; only its worker changes them."""

    def __init__(self) -> None:
        self._waiters: dict[str, list[Waiter]] = {}
        self._replies: set[asyncio.Future[decisions.YieldOutcome]] = set()

    @property
    def busy(self) -> bool:
        return any(self._waiters.values()) or bool(self._replies)

    def add(self, waiter: Waiter) -> None:
        self._waiters.setdefault(waiter.job, []).append(waiter)

    def granted(self, job: str, epoch: int) -> list[Waiter]:
        """The waiters of ``job``, which now hold grant ``epoch`` (no longer waiting)."""
        receivers = self.take(job)
        for w in receivers:
            w.granted_epoch = epoch
        return receivers

    def take(self, job: str) -> list[Waiter]:
        return self._waiters.pop(job, [])

    def withdraw(self, waiter: Waiter) -> bool:
        """Stop waiting; False if it no longer waits (failed elsewhere already)."""
        pending = self._waiters.get(waiter.job, [])
        if waiter not in pending:
            return False
        pending.remove(waiter)
        return True

    def reply(self) -> asyncio.Future[decisions.YieldOutcome]:
        reply: asyncio.Future[decisions.YieldOutcome] = asyncio.get_running_loop().create_future()
        self._replies.add(reply)
        reply.add_done_callback(self._replies.discard)
        return reply

    def fail_all(self, refusal: Callable[[], Exception]) -> None:
        """The worker is gone: every caller still waiting gets ``refusal()``."""
        for waiters in self._waiters.values():
            for w in waiters:
                if not w.future.done():
                    w.future.set_exception(refusal())
        self._waiters.clear()
        for reply in list(self._replies):
            if not reply.done():
                reply.set_exception(refusal())


def resolve_effect(g: decisions.Granted, receivers: list[Waiter]) -> inbox.Effect:
    def resolve() -> None:
        for w in receivers:
            if not w.future.done():
                w.future.set_result(Grant(g.epoch, g.restored))

    return inbox.Urgent(resolve)


def abort_effect(a: decisions.Abort, waiters: list[Waiter]) -> inbox.Effect:
    def effect() -> None:
        for w in waiters:
            if not w.future.done():
                w.future.set_exception(refusals.Refused(a.code, a.message))

    return effect


def drained(group_id: str) -> str:
    """Why a drained group holds its waiters back, and what to do."""
    return (
        f"group {group_id} is drained by an administrator; it grants again after "
        f"`tslice admin resume {group_id}`"
    )


def faulted(group_id: str, detail: str) -> str:
    """Why a fault (``detail``) holds a group's waiters back, and what to do."""
    return f"{detail}; the group retries on its own: call again, or see `tslice status {group_id}`"


async def granted(
    waiter: Waiter,
    time_left: float | None,
    *,
    group_id: str,
    held_back_by: Callable[[], str],
    depart: Callable[[], None],
) -> Grant:
    """The grant of ``waiter``; ``time_left`` is the caller's deadline (None: it has none):
    the nearer of the call's gRPC deadline and the request's ``timeout_ms``.

    Shortly before the deadline, a waiter that a fault or a drain holds back
    (``held_back_by`` names it, and what to do) departs and is refused UNAVAILABLE
    with the reason. At the deadline any other waiter departs, DEADLINE_EXCEEDED: a
    ``timeout_ms`` counts without a gRPC deadline too (with one, gRPC ends the call then).
    """
    if time_left is None:
        return await waiter.future
    answer_in = max(0.0, time_left - _ANSWER_BEFORE_DEADLINE_S)
    try:
        return await asyncio.wait_for(asyncio.shield(waiter.future), answer_in)
    except asyncio.TimeoutError:
        pass
    why = held_back_by()
    if why and not waiter.future.done():
        depart()
        raise refusals.Refused(
            refusals.Code.UNAVAILABLE,
            f"group {group_id}: job {waiter.job} was not granted within the call's deadline: {why}",
        )
    try:
        return await asyncio.wait_for(asyncio.shield(waiter.future), time_left - answer_in)
    except asyncio.TimeoutError:
        pass
    if waiter.future.done():
        return await waiter.future  # granted (or aborted) just now
    depart()
    raise refusals.Refused(
        refusals.Code.DEADLINE_EXCEEDED,
        f"group {group_id}: job {waiter.job} was not granted within its deadline "
        f"({time_left * 1000:.0f} ms: the nearer of timeout_ms and the call's deadline); "
        "it left the queue",
    )


async def check_fits(
    pool: agents.AgentPool,
    nodes: tuple[config.NodeRef, ...],
    *,
    group_id: str,
    job: str,
    footprint_bytes: int,
    status_timeout_s: float,
) -> None:
    """Refuse at once (RESOURCE_EXHAUSTED) a footprint larger than a node's device
    memory in all: such a job can never be resident there, and would otherwise wait
    behind the holder until its deadline. Nodes never read are read once here (a
    short deadline); a node that lists no accelerators is not checked."""
    clients = [(n, pool.get(n.address)) for n in nodes]
    unread = tuple(n for n, c in clients if not c.status_seen)
    if unread:
        timeout_s = min(1.0, status_timeout_s)
        await steps.read_all(pool, unread, group_id, timeout_s=timeout_s)
        for n, c in clients:
            if n in unread:
                c.status_seen = True  # asked once; later reads keep it up to date
    for node, client in clients:
        capacity = client.capacity_bytes
        if capacity is not None and footprint_bytes > capacity:
            raise refusals.Refused(
                refusals.Code.RESOURCE_EXHAUSTED,
                f"job {job!r} declares a footprint of {footprint_bytes} bytes, but node "
                f"{node.name} of group {group_id!r} holds only {capacity} bytes of "
                "device memory in all: it can never be resident there; lower "
                "footprint_bytes or use a group of larger nodes",
            )
