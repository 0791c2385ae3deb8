"""The agent's records follow the workload channel: who registered, who left.

A workload that registers on the workload channel has its model on the device, so its
(job, group) record becomes resident on app-channel (``rules.after_channel_registration``);
a workload that left took its state with it, so the records it served become IDLE
(``rules.after_workload_left``). :class:`WorkloadPresence` is the hub's listener that
applies both to the store (``tslice.agent.state.store``), each under the job's lock
shared with ``tslice.agent.moves.runner``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tslice.agent.jobs import model, rules
from tslice.agent.state import store
from tslice.rpc import refusals

log = logging.getLogger(__name__)


class WorkloadPresence:
    """Applies the workload channel's registrations and departures to the records."""

    def __init__(
        self,
        *,
        records: store.Store,
        locks: collections.defaultdict[str, asyncio.Lock],
        done: dict[str, asyncio.Future[None]],
        registered: Callable[[str, str], bool],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
    ) -> None:
        """``locks`` and ``done`` are the agent's (one lock per job id, one future per
        running operation); ``registered`` tells whether a live workload serves
        (job, group); ``spawn`` runs a coroutine as a named task of the agent."""
        self._records = records
        self._locks = locks
        self._done = done
        self._registered = registered
        self._spawn = spawn

    def on_event(self, event: Any) -> None:
        """Listener for the workload-channel hub: a registration makes the job resident, a
        workload that left takes its state with it."""
        kind = getattr(event, "kind", None)
        job_id = str(event.job_id)
        state = getattr(event, "state", None)
        group = str(getattr(state, "group", "") or "")
        if kind in ("closed", "left") and getattr(event, "left", False):
            reason = str(getattr(event, "reason", "") or "the workload left")
            self._spawn(
                self.note_workload_left(job_id=job_id, group=group, reason=reason),
                f"channel-left-{job_id}",
            )
            return
        if kind != "registered":
            return
        # What a workload says it holds counts only if it declared that it reports it.
        reported = bool(getattr(state, "state_reported", False))
        suspended: bool | None = bool(getattr(state, "suspended", False)) if reported else None
        self._spawn(
            self.note_channel_registration(job_id=job_id, group=group, suspended=suspended),
            f"channel-registration-{job_id}",
        )

    async def note_channel_registration(
        self, *, job_id: str, group: str, suspended: bool | None = None
    ) -> None:
        async with self._locks[job_id]:
            try:
                job = self._records.find(job_id, group)
            except refusals.Refused as refused:
                # No group named, and records in several: the registration serves none
                # of them until a request names the group (the workload stays registered).
                log.warning(
                    "job %s registered on the workload channel without a group: %s",
                    job_id,
                    refused.message,
                    extra={"job_id": job_id},
                )
                return
            updated = rules.after_channel_registration(
                job, job_id=job_id, group=group, suspended=suspended
            )
            if updated != job:
                self._records.commit(jobs=[updated], previous=job)
                log.info(
                    "job %s (group %s) registered on the workload channel: %s on app-channel",
                    job_id,
                    group,
                    updated.state.value,
                    extra={"job_id": job_id},
                )

    async def note_workload_left(self, *, job_id: str, group: str, reason: str) -> None:
        """The workload that served (job, group) left: its records become IDLE (nothing
        resident or saved). A record with an operation in flight is marked once that
        operation has finished; one whose workload registered again meanwhile is not."""
        while True:
            async with self._locks[job_id]:
                running: list[asyncio.Future[None]] = []
                for job in self._left_records(job_id, group):
                    if job.state is model.State.TRANSITIONING:
                        done = self._done.get(job.operation_id)
                        if done is not None:
                            running.append(done)
                        continue
                    updated = rules.after_workload_left(job, reason=reason)
                    if updated != job:
                        self._records.commit(jobs=[updated], previous=job)
                        log.info(
                            "job %s (group %s): its workload left (%s); %s -> IDLE, nothing "
                            "resident",
                            job_id,
                            job.group,
                            reason,
                            job.state.value,
                            extra={"job_id": job_id},
                        )
                if not running:
                    return
            await asyncio.wait(running)

    def _left_records(self, job_id: str, group: str) -> list[model.Job]:
        """The job's records a departed workload of ``group`` held: the group's record, or
        for a workload that named no group every record of the job; none that a live
        workload serves (it registered again)."""
        if group:
            found = self._records.find(job_id, group)
            candidates = [found] if found is not None else []
        else:
            candidates = [j for (job, _g), j in sorted(self._records.jobs.items()) if job == job_id]
        return [j for j in candidates if not self._registered(job_id, j.group)]
