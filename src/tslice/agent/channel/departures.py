"""The workload channel's memory of workloads that are not live: sessions lost without a
clean end (waiting out their grace) and workloads that left, by (job, group).

Kept apart from the stream handling of :mod:`tslice.agent.channel` (its module docstring
says the rules: a clean end leaves at once, a loss gets ``lost_grace_s`` to register
again, and only the same workload may come back meanwhile). Lives on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from tslice.agent.channel import rules, sessions
from tslice.agent.channel.rules import Departure

log = logging.getLogger(__name__)

#: Departures remembered (oldest forgotten first): the records they concern are marked
#: by then, and a workload that opens many streams under many ids cannot grow the hub.
DEPARTURES_KEPT = 4096

#: A session's key: (job_id, group, rank), group "" when the registration named none,
#: rank 0 for a job's only workload.
SessionKey = tuple[str, str, int]


@dataclasses.dataclass
class _Lost:
    """A session lost without a clean end, waiting out the grace for a re-registration."""

    session: sessions.Session
    reason: str
    grace_s: float
    #: Loop time of the loss, and at which the workload counts as gone.
    since: float
    deadline: float
    timer: asyncio.TimerHandle | None = None


class Departures:
    """Lost sessions and departed workloads; ``on_left(session, reason)`` is called when a
    lost session's grace runs out (the hub sends its ``left`` event)."""

    def __init__(self, on_left: Callable[[sessions.Session, str], None]) -> None:
        self._on_left = on_left
        self._lost: dict[SessionKey, _Lost] = {}
        self._departed: collections.OrderedDict[SessionKey, Departure] = collections.OrderedDict()

    def known(self, key: SessionKey) -> bool:
        return key in self._lost or key in self._departed

    def keys_of(self, job_id: str) -> set[SessionKey]:
        return {k for k in (*self._lost, *self._departed) if k[0] == job_id}

    def ranks_of(self, job_id: str, group: str) -> set[SessionKey]:
        """The lost or departed sessions of (job, group), every rank."""
        return {k for k in (*self._lost, *self._departed) if k[:2] == (job_id, group)}

    def departure(self, key: SessionKey) -> Departure | None:
        """Why ``key``'s workload counts as gone; None while it may still come back."""
        lost = self._lost.get(key)
        if lost is not None:
            if asyncio.get_running_loop().time() < lost.deadline:
                return None
            self._give_up(key, lost)  # its timer has not run yet
        return self._departed.get(key)

    def grace_left(self, key: SessionKey) -> float | None:
        lost = self._lost.get(key)
        if lost is None:
            return None
        return max(0.0, lost.deadline - asyncio.get_running_loop().time())

    def depart(self, session: sessions.Session, reason: str, *, clean: bool) -> None:
        """Record that the workload of the session's (job, group) is gone (no event)."""
        self._departed.pop(session.key, None)
        self._departed[session.key] = Departure(
            job_id=session.job_id,
            group=session.group,
            reason=reason,
            clean=clean,
            at=time.time(),
            rank=session.rank,
        )
        while len(self._departed) > DEPARTURES_KEPT:
            self._departed.popitem(last=False)

    def lose(self, session: sessions.Session, reason: str, grace_s: float) -> None:
        """Start the grace of a session lost without a clean end."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        lost = _Lost(session, reason, grace_s, since=now, deadline=now + grace_s)
        previous = self._lost.pop(session.key, None)
        if previous is not None and previous.timer is not None:
            previous.timer.cancel()
        self._lost[session.key] = lost
        if grace_s <= 0:
            self._give_up(session.key, lost)
            return
        lost.timer = loop.call_later(grace_s, self._give_up, session.key, lost)

    def lost_conflict(self, key: SessionKey, instance: str) -> str:
        """Why a registration of ``key`` by ``instance`` is refused while another workload's
        lost session may still come back ('' = accepted)."""
        lost = self._lost.get(key)
        if lost is None:
            return ""
        now = asyncio.get_running_loop().time()
        if now >= lost.deadline:
            self._give_up(key, lost)  # its timer has not run yet
            return ""
        if lost.session.instance == instance:
            return ""
        return rules.already_registered(
            lost.session.state(), lost_for_s=now - lost.since, grace_left_s=lost.deadline - now
        )

    def returned(self, key: SessionKey) -> bool:
        """A registration of ``key``: forget its departure or pending loss; True if it was
        lost or gone."""
        lost = self._lost.pop(key, None)
        if lost is not None and lost.timer is not None:
            lost.timer.cancel()
        return self._departed.pop(key, None) is not None or lost is not None

    def forget_losses(self) -> None:
        """The agent shuts down: nothing lost will be given up."""
        for lost in self._lost.values():
            if lost.timer is not None:
                lost.timer.cancel()
        self._lost.clear()

    def _give_up(self, key: SessionKey, lost: _Lost) -> None:
        """The grace of a lost session ran out without a new registration: it left."""
        if self._lost.get(key) is not lost:
            return  # registered again, or given up already
        del self._lost[key]
        if lost.timer is not None:
            lost.timer.cancel()
        reason = (
            f"its channel was lost ({lost.reason}) and it did not register again within "
            f"{lost.grace_s:g} s (lost_grace_s)"
        )
        self.depart(lost.session, reason, clean=False)
        log.warning(
            "workload counted as gone",
            extra={"job_id": lost.session.job_id, "group_id": lost.session.group, "reason": reason},
        )
        self._on_left(lost.session, reason)
