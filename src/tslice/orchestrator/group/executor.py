"""The one place where a group's decisions become actions: its inbox, its saves, its effects.

Everything that changes a group is a *command* posted here (an RPC, the switch's progress
and outcome, recovery's reads, a timer, the device claim, a set): ``post(command, *args)``.
The commands waiting are applied as one batch, each with the batch's time; a command
changes the lock (and its driver's bookkeeping) and returns the lock's decisions and its
own effects (``group.effects``). Then:

1. *book* (:meth:`Executor.book`, one ``match``): each decision is settled in the command
   that made it: the Acquire RPCs a grant reaches are bound to it (a set's parts are
   answered only with their set), the device claim and the sets are asked (which may
   decide more, booked in turn), and the rest becomes effects;
2. *save*: what the batch changed goes to the store (``LockState.changes``: O(change));
   every group's saves of one loop turn share one commit;
3. *act* (:meth:`Executor._run`, one ``match``), once the save is durable ("write before
   act"): answer the Acquires, launch the switch, publish events, answer Yields...

No task drains the inbox: the first post of a turn schedules the batch, and the store's
callback acts. Commands posted meanwhile wait for the next batch, so a group's changes are
serialised without a lock while groups run in parallel.

**The first-call trick** (its one place): Acquire answers and a switch's launch run first.
When a switch was launched, the batch's other effects (the Yield reply, events) are
scheduled behind the first step of every node's task, so that each node's first agent
call is on its way before the loop spends time on them: every waiter waits on those calls.

A store that says a newer leader wrote the state (:class:`store.Deposed`) stops the
executor for good: nothing of this batch or any later one acts. While a save fails it is
retried with backoff, :class:`persistence.health.StoreHealth` says why (calls are refused
naming it, health goes NOT_SERVING) and :meth:`Executor.ask` answers reads at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import config
from tslice.orchestrator.events import bus
from tslice.orchestrator.group import callers, leases, lock
from tslice.orchestrator.group import effects as fx
from tslice.orchestrator.persistence import health, records, store
from tslice.orchestrator.switch import step

log = logging.getLogger(__name__)

_T = TypeVar("_T")
Kind = opb.OrchestratorEvent
#: A command: ``command(now, *args)`` returns decisions and effects.
Command = Callable[..., Iterable[Any]]

_EMITTED = {
    fx.EventKind.QUEUED: Kind.KIND_QUEUED,
    fx.EventKind.YIELDED: Kind.KIND_YIELDED,
    fx.EventKind.CANCELLED: Kind.KIND_CANCELLED,
    fx.EventKind.ROLLED_BACK: Kind.KIND_SWITCH_FAILED,
}


def _grant_detail(g: fx.Granted) -> str:
    if g.held:
        return "already held"
    if g.zero_cost:
        return "zero-cost"
    return "restored" if g.restored else ""


class Coordination(Protocol):
    """The group among the others (``group.coordination``), asked in the command."""

    #: Whether another group shares the group's devices (see ``group.overlap``).
    shared: bool

    def claim(self, need: fx.NeedClaim, now: float) -> list[fx.Action]:
        """Ask for the device claim; what the lock decides if it is granted at once."""

    def release_claim(self) -> None: ...

    def ready_for_set(self, need: fx.NeedSet, now: float) -> list[fx.Action]:
        """Report the group ready for a set member (or let a waiter pass it)."""

    def not_ready_for_set(self) -> None: ...

    def applied(self) -> None:
        """After a batch's commands, before its save (overlapping groups learn the holder)."""


class Group(Protocol):
    """What the executor asks of its group's driver."""

    def prefetch_after(self, now: float) -> list[fx.Effect]:
        """The prefetch worth starting after a grant or an arrival (none, or one)."""

    def start_prefetch(self, candidate: Any) -> None: ...

    def count_deferred_snapshot(self) -> None: ...

    def settled(self) -> None:
        """After a batch's effects (lease timers, the wake-up, the reported state)."""


class Executor:
    """One group's inbox, saves and effects (see the module docstring)."""

    def __init__(
        self,
        *,
        group_id: str,
        nodes: tuple[config.NodeRef, ...],
        lk: lock.GroupLock,
        group: Group,
        coordination: Coordination,
        switches: step.Switches,
        events: bus.EventBus,
        db: store.LockStore,
        store_health: health.StoreHealth,
        backoff: step.Backoff,
    ) -> None:
        self.group_id = group_id
        self._nodes = [(n.name, n.address) for n in nodes]
        self._lock = lk
        self._group = group
        self._coordination = coordination
        self._switches = switches
        self._bus = events
        self._db = db
        self._health = store_health
        self._backoff = backoff
        #: The Acquire RPCs waiting, by job (only commands change it).
        self.waiting: dict[str, list[callers.Waiter]] = {}
        #: Commands applied so far, and when the last one was (idle collection).
        self.activity = 0
        self.active_at = time.monotonic()
        #: A failed save is being retried (the group waits until it goes through).
        self.waiting_on_store = False
        self._inbox: list[tuple[Command, tuple[Any, ...]]] = []
        self._scheduled = False
        #: A batch's save in flight: (what it saves, its effects, failed attempts).
        self._saving: tuple[records.Changes, list[fx.Effect], int] | None = None
        #: The row last saved (None: none yet; the first save writes it, nodes and all).
        self._saved_row: records.GroupRow | None = None
        self._closed = False
        self._deposed = False

    # ---- the inbox -------------------------------------------------------------------------

    def post(self, command: Command, *args: Any) -> None:
        """Apply ``command(now, *args)`` in the next batch."""
        if self._closed:
            return
        self._inbox.append((command, args))
        if not self._scheduled and self._saving is None:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def ask(self, compute: Callable[[float], _T]) -> asyncio.Future[_T]:
        """``compute(now)`` applied in the next batch, its result as a future. At once
        once the group stopped, and while a failing save holds the group: ``compute``
        only reads the group or changes what is not persisted (a status read, a Hold
        stream), which must not wait for the disk."""
        answer: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        if self._closed or self.waiting_on_store:
            _settle(answer, compute, time.monotonic())
        else:
            self.post(_asked, answer, compute)
        return answer

    def flushed(self) -> asyncio.Future[None]:
        """Resolved once everything posted so far is saved and acted on."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.post(_flushed, done)
        return done

    def close(self) -> None:
        """The group stopped: nothing posted from now on is applied."""
        self._closed = True
        self._inbox.clear()

    # ---- a batch -----------------------------------------------------------------------------

    def _drain(self) -> None:
        self._scheduled = False
        if self._saving is not None or self._deposed or not self._inbox:
            return
        batch, self._inbox = self._inbox, []
        now = time.monotonic()
        effects: list[fx.Effect] = []
        for command, args in batch:
            self.activity += 1
            try:
                effects += self.book(command(now, *args), now)
            except Exception:
                log.exception("group %s: command failed", self.group_id)
        self.active_at = now
        if self._coordination.shared:  # (else nobody needs to know the holder)
            self._coordination.applied()
        changes = self._lock.changes(self._saved_row)
        if changes is not None:
            self._save(changes, effects, 0)
        else:
            self._acted(effects)

    def book(self, decided: Iterable[Any], now: float) -> list[fx.Effect]:
        """Settle each decision now; the effects to run once the batch is saved."""
        out: list[fx.Effect] = []
        gid = self.group_id
        for item in decided:
            match item:
                case fx.Granted():
                    out += self._granted(item, now)
                case fx.Abort(job=job, message=message, code=code):
                    out.append(fx.Refuse(tuple(self.waiting.pop(job, ())), code, message))
                case fx.Emit(kind=kind, job=job, detail=detail):
                    out.append(fx.Publish(bus.Event(_EMITTED[kind], gid, job, detail=detail)))
                case fx.StartSwitch(from_job=from_job, to_job=to_job, epoch=epoch):
                    detail = "recovered" if item.recovered else ""
                    started = bus.Event(
                        Kind.KIND_SWITCH_STARTED,
                        gid,
                        to_job,
                        from_job=from_job or "",
                        detail=detail,
                        grant_epoch=epoch,
                    )
                    out += (fx.Launch(item), fx.Publish(started))
                case fx.NeedClaim():
                    out += self.book(self._coordination.claim(item, now), now)
                case fx.ReleaseClaim():
                    self._coordination.release_claim()
                case fx.NeedSet():
                    out += self.book(self._coordination.ready_for_set(item, now), now)
                case fx.NotReady():
                    self._coordination.not_ready_for_set()
                case _:
                    out.append(item)  # an effect of the command's own
        return out

    def _granted(self, g: fx.Granted, now: float) -> list[fx.Effect]:
        """The job's Acquire RPCs receive the grant; the parts of sets not answered yet
        count as answered only with their set (see ``lock.on_granted_to_set_parts``)."""
        receivers = self.waiting.pop(g.job, [])
        parts = 0
        for w in receivers:
            w.granted_epoch = g.epoch
            parts += w.set_seq is not None
        if parts and not g.held:
            self._lock.on_granted_to_set_parts(g.job, epoch=g.epoch, parts=parts, now=now)
        published = fx.Publish(
            bus.Event(
                Kind.KIND_GRANTED,
                self.group_id,
                g.job,
                detail=_grant_detail(g),
                grant_epoch=g.epoch,
                duration_ms=int(g.waited_s * 1000),
            )
        )
        return [
            fx.Deliver(tuple(receivers), g.epoch, g.restored),
            published,
            *self._group.prefetch_after(now),
        ]

    def _save(self, changes: records.Changes, effects: list[fx.Effect], attempt: int) -> None:
        self._saving = (changes, effects, attempt)
        saved = self._db.save(self.group_id, nodes=self._nodes, changes=changes)
        saved.add_done_callback(self._saved)

    def _saved(self, saved: asyncio.Future[None]) -> None:
        assert self._saving is not None
        changes, effects, attempt = self._saving
        error = saved.exception() if not saved.cancelled() else store.StoreError("cancelled")
        if error is not None and not isinstance(error, store.StoreError):
            log.error("group %s: saving failed", self.group_id, exc_info=error)
            error = store.StoreError(f"saving failed: {type(error).__name__}: {error}")
        if isinstance(error, store.Deposed):
            # Not ours to act on any more: nothing after this may reach an agent.
            log.error("group %s: %s; it stops acting", self.group_id, error)
            self._deposed = True
            return
        if isinstance(error, store.StoreError):
            # Nothing may act on state that is not on disk: hold this group until it
            # is, and say why meanwhile (see persistence.health).
            self.waiting_on_store = True
            self._health.failed(self.group_id, str(error))
            delay = self._backoff.delay(attempt)
            log.error("group %s: %s; retrying in %.2f s", self.group_id, error, delay)
            loop = asyncio.get_running_loop()
            loop.call_later(delay, self._save, changes, effects, attempt + 1)
            return
        if self.waiting_on_store:
            self.waiting_on_store = False
            self._health.saved(self.group_id)
            log.warning(
                "group %s: state saved again after %d failed attempts", self.group_id, attempt
            )
        self._saving = None
        if changes.row is not None:
            self._saved_row = changes.row
        self._acted(effects)

    def _acted(self, effects: list[fx.Effect]) -> None:
        self.act(effects)
        self._group.settled()
        if self._inbox and not self._scheduled:
            self._drain()

    # ---- acting -----------------------------------------------------------------------------

    def act(self, effects: Sequence[fx.Effect]) -> None:
        """Run a saved batch's effects: the urgent first (see the first-call trick)."""
        urgent: list[fx.Effect] = []
        rest: list[fx.Effect] = []
        launched = False
        for effect in effects:
            if isinstance(effect, _URGENT):
                urgent.append(effect)
                launched = launched or isinstance(effect, fx.Launch)
            else:
                rest.append(effect)
        if urgent:
            self._run(urgent)
        if not rest:
            return
        if launched:
            # Behind the first step of every node's task, scheduled as it was launched.
            asyncio.get_running_loop().call_soon(self._run, rest)
        else:
            self._run(rest)

    def _run(self, effects: Sequence[fx.Effect]) -> None:
        """The one place where a group's effects happen."""
        for effect in effects:
            try:
                match effect:
                    case fx.Deliver(waiters=waiters, epoch=epoch, restored=restored):
                        callers.deliver(waiters, epoch, restored)
                    case fx.Launch(switch=switch):
                        if not self._closed:  # (else its intent on disk is recovery's)
                            self._switches.launch(switch)
                    case fx.Refuse(waiters=waiters, code=code, message=message):
                        callers.refuse(waiters, code, message)
                    case fx.Publish(event=event):
                        self._bus.publish(event)
                    case fx.Answer(future=future, value=value):
                        if not future.done():
                            future.set_result(value)
                    case fx.EndHolds(sessions=sessions, lost=lost):
                        leases.end(sessions, lost)
                    case fx.CountDeferredSnapshot():
                        self._group.count_deferred_snapshot()
                    case fx.Prefetch(candidate=candidate):
                        self._group.start_prefetch(candidate)
            except Exception:
                log.exception("group %s: effect %s failed", self.group_id, effect)


#: The effects that run first: every waiter waits on them.
_URGENT = (fx.Deliver, fx.Launch)


def _asked(now: float, answer: asyncio.Future[_T], compute: Callable[[float], _T]) -> list[Any]:
    if not answer.done():  # (else the asker went away: nobody takes the result)
        _settle(answer, compute, now)
    return []


def _settle(answer: asyncio.Future[_T], compute: Callable[[float], _T], now: float) -> None:
    try:
        answer.set_result(compute(now))
    except Exception as err:
        answer.set_exception(err)


def _flushed(now: float, done: asyncio.Future[None]) -> list[Any]:
    return [fx.Answer(done, None)]
