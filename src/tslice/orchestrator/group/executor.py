"""The worker of one group: its inbox (``tslice.orchestrator.group.inbox``), drained by one task.

The worker takes every command waiting in the inbox as one batch and handles it in
two phases:

1. *apply*: run each command with the batch's time (it mutates the pure lock and the
   driver's bookkeeping, and returns effects);
2. *persist*, then *effect*: write the lock's new state to the store (one SQLite
   transaction, or the API server in HA mode; retried until it is durable) and only
   then run the effects ("write before act"). A store that says a newer leader wrote
   the state (:class:`store.Deposed`) stops the worker for good: no effect of this
   batch or any later one runs (the HA controller stops the group). While a save
   fails, :class:`store_health.StoreHealth` says why (calls are refused naming it,
   health goes NOT_SERVING) and :meth:`Worker.ask` answers reads at once.

Urgent effects run first; while a switch that one of them started has not sent its
first agent calls, the other effects are held back (see :meth:`Worker.hold_back`).
The worker also counts the commands applied: the group's activity, for idle collection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from tslice.orchestrator import config
from tslice.orchestrator.group import inbox
from tslice.orchestrator.persistence import health as store_health
from tslice.orchestrator.persistence import records, store
from tslice.orchestrator.switch import step as switch

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclasses.dataclass(eq=False, kw_only=True)
class Worker:
    """Serialises one group's changes; the driver starts :meth:`run` as its task."""

    group_id: str
    nodes: tuple[config.NodeRef, ...]
    db: store.LockStore
    backoff: switch.Backoff
    #: The state on disk (None: nothing saved yet), and how to read the state to persist.
    saved: records.LockRecord | None
    record: Callable[[], records.LockRecord]
    stopping: Callable[[], bool]
    #: Run after each command, and after each batch's effects.
    applied: Callable[[], None]
    settled: Callable[[], None]
    #: Told when a save fails and when saving works again (shared by every group).
    health: store_health.StoreHealth = dataclasses.field(default_factory=store_health.StoreHealth)
    #: A save failed and is being retried (the worker is held until it goes through).
    waiting_on_store: bool = dataclasses.field(init=False, default=False)
    _inbox: asyncio.Queue[inbox.Command] = dataclasses.field(
        init=False, default_factory=asyncio.Queue
    )
    #: Effects held back until a starting switch has sent its first calls (see run).
    _deferred: list[inbox.Effect] | None = dataclasses.field(init=False, default=None)
    #: Commands applied so far, and when the last one was.
    activity: int = dataclasses.field(init=False, default=0)
    active_at: float = dataclasses.field(init=False, default_factory=time.monotonic)

    def post(self, command: inbox.Command) -> None:
        self._inbox.put_nowait(command)

    async def ask(self, compute: Callable[[float], _T]) -> _T:
        """``compute`` run by the worker; its result. At once once the group stops, and
        while a failing save holds the worker: ``compute`` only reads the group or changes
        what is not persisted (a status read, a Hold stream), which must not wait for disk.
        """
        if self.stopping() or self.waiting_on_store:
            return compute(time.monotonic())  # nothing else changes the group meanwhile
        answer: asyncio.Future[_T] = asyncio.get_running_loop().create_future()

        def command(now: float) -> list[inbox.Effect]:
            if answer.done():
                return []  # the asker went away (cancelled): nobody takes the result
            try:
                answer.set_result(compute(now))
            except Exception as err:
                answer.set_exception(err)
            return []

        self.post(command)
        return await answer

    def hold_back(self) -> None:
        """A switch starts: hold the non-urgent effects until :meth:`release_deferred`."""
        if self._deferred is None:
            self._deferred = []

    def release_deferred(self) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred:
            self._run_effects(deferred)

    async def run(self) -> None:
        while True:
            batch = [await self._inbox.get()]
            while not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            now = time.monotonic()
            effects: list[inbox.Effect] = []
            for apply in batch:
                self.activity += 1
                self.active_at = now
                try:
                    effects += apply(now)
                except Exception:
                    log.exception("group %s: command failed", self.group_id)
                self.applied()
            await self._persist()
            # Urgent effects first. While a switch they started has not sent its first
            # agent calls, the others (Yield replies, event deliveries) wait, so that
            # the calls leave before them: every Acquire waits on those calls.
            self._run_effects([e for e in effects if isinstance(e, inbox.Urgent)])
            others = [e for e in effects if not isinstance(e, inbox.Urgent)]
            if self._deferred is not None:
                self._deferred += others
            else:
                self._run_effects(others)
            self.settled()

    def _run_effects(self, effects: list[inbox.Effect]) -> None:
        for effect in effects:
            try:
                effect()
            except Exception:
                log.exception("group %s: effect failed", self.group_id)

    async def _persist(self) -> None:
        record = self.record()
        if record == self.saved:
            return
        attempt = 0
        nodes = [(n.name, n.address) for n in self.nodes]
        try:
            while True:
                try:
                    await self.db.save(
                        self.group_id, nodes=nodes, record=record, previous=self.saved
                    )
                    break
                except store.Deposed as err:
                    # Not ours to act on any more: nothing after this may reach an agent.
                    log.error("group %s: %s; it stops acting", self.group_id, err)
                    await asyncio.Event().wait()  # until the group is stopped (cancelled)
                except store.StoreError as err:
                    # Nothing may act on state that is not on disk: hold this group until
                    # it is, and say why meanwhile (see store_health).
                    self.waiting_on_store = True
                    self.health.failed(self.group_id, str(err))
                    delay = self.backoff.delay(attempt)
                    attempt += 1
                    log.error("group %s: %s; retrying in %.2f s", self.group_id, err, delay)
                    await asyncio.sleep(delay)
        finally:
            if self.waiting_on_store:  # saved again, or the group stops
                self.waiting_on_store = False
                self.health.saved(self.group_id)
        if attempt:
            log.warning(
                "group %s: state saved again after %d failed attempts", self.group_id, attempt
            )
        self.saved = record
