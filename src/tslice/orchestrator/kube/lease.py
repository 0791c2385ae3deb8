"""Leader election through a ``coordination.k8s.io/v1`` Lease (lightkube), for HA mode.

As client-go's leader election, with a term:

- a candidate reads the Lease every renew interval and takes it when it is free (no
  holder: released, or never held) or expired: unchanged (same resourceVersion) for
  ``leaseDurationSeconds`` on the candidate's own clock since it first saw that version
  (no clock is compared across machines). It takes it with an update that carries the
  version it read: of two candidates one wins, the other gets 409 Conflict;
- every take raises ``leaseTransitions`` by one, and the new value is the winner's
  **term** (``tslice.security.leader_term``): it only rises, whoever wins, even a replica
  taking the Lease back from itself;
- the leader renews every interval; once it has not renewed for the renew deadline (2/3
  of the duration, from the start of its last successful renewal), or it finds the Lease
  another's, it has lost, before any candidate may see it expired;
- on a graceful stop the leader releases the Lease (no holder): a candidate takes it at
  its next read, without waiting for it to expire.

A term is never used twice, whatever an operator does to the Lease: the count of a Lease
deleted, or replaced by hand with a fresh one, starts again at 0, so every win is above
the :attr:`Elector.floor`, the highest term this replica knows to be taken (every term it
read on the Lease, its own, a newer one an agent or a ConfigMap named), and a Lease
created anew starts above the terms in the state ConfigMaps too (``known_terms``: a
replica that never saw the old Lease). A leader that finds its Lease deleted has lost it.
Two replicas that still win the same number (each knew nothing of the other's) are told
apart by the agents and the ConfigMaps, which keep the identity with the term.

The holder's address (``host:port``, where its clients go) is the Lease's annotation
:data:`ADDRESS_ANNOTATION`, which followers name in their redirects.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lightkube import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from tslice.orchestrator.kube import leadership
from tslice.security import leader_term

log = logging.getLogger(__name__)

ADDRESS_ANNOTATION = "timeslice.io/leader-address"
_CONFLICT, _NOT_FOUND = 409, 404

#: ``(holder identity, holder address)`` each time the Lease is read (None: no holder).
OnSeen = Callable[[str | None, str | None], None]
#: The highest leader term the state names (read before a Lease is created anew).
KnownTerms = Callable[[], Awaitable[int]]


async def _none_known() -> int:
    return 0


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _term(lease: Any) -> int:
    return int(lease.spec.leaseTransitions or 0) if lease.spec is not None else 0


def _holder(lease: Any) -> str | None:
    return (lease.spec.holderIdentity or None) if lease.spec is not None else None


class Elector:
    """Campaigns for, holds and releases one Lease."""

    def __init__(
        self,
        client: Any,
        settings: leadership.HaSettings,
        *,
        on_seen: OnSeen,
        known_terms: KnownTerms = _none_known,
    ) -> None:
        self._client = client
        self._settings = settings
        self._on_seen = on_seen
        self._known_terms = known_terms
        #: The Lease as this replica last wrote it while leading.
        self._held: Any = None
        #: ``(resourceVersion, monotonic time it was first seen)`` of the Lease.
        self._seen: tuple[str, float] | None = None
        #: The highest term known to be taken (read on the Lease, won, or named by the
        #: state or an agent, though the Lease may have been deleted and created again
        #: since): the next win is above it.
        self.floor = 0
        #: When the last take or renewal that succeeded was sent (monotonic).
        self._renewed_at = 0.0
        #: The holder and its address as last seen.
        self._leader: tuple[str | None, str | None] = (None, None)

    @property
    def _what(self) -> str:
        s = self._settings
        return f"Lease {s.namespace}/{s.lease_name}"

    async def acquire(self) -> int:
        """Until this replica holds the Lease; its term."""
        interval = self._settings.renew_interval_s
        while True:
            try:
                term = await self._try_acquire()
            except Exception as err:  # the API server unreachable, RBAC...: try again
                log.warning(
                    "leader election: cannot read or take %s (%s); retrying in %.1f s "
                    "(check the API server and the Lease RBAC of the orchestrator)",
                    self._what,
                    _why(err),
                    interval,
                )
                term = None
            if term is not None:
                return term
            await asyncio.sleep(interval)

    async def _try_acquire(self) -> int | None:
        s = self._settings
        try:
            lease = await self._client.get(Lease, s.lease_name, namespace=s.namespace)
        except ApiError as err:
            if err.status.code != _NOT_FOUND:
                raise
            return await self._create()
        holder = _holder(lease)
        address = (lease.metadata.annotations or {}).get(ADDRESS_ANNOTATION)
        self._saw(holder, address if holder else None, _term(lease))
        version = str(lease.metadata.resourceVersion)
        now = time.monotonic()
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, now)
        duration = (lease.spec.leaseDurationSeconds if lease.spec else None) or 0
        expired = now - self._seen[1] >= duration
        if holder is not None and holder != s.identity and not expired:
            return None
        return await self._take(lease, why="free" if holder is None else "expired")

    def raise_floor(self, term: int) -> None:
        """``term`` is taken: the next win is above it."""
        self.floor = max(self.floor, term)

    def _saw(self, holder: str | None, address: str | None, term: int) -> None:
        self.raise_floor(term)
        if (holder, address) != self._leader:
            self._leader = (holder, address)
            if holder is not None and holder != self._settings.identity:
                log.info("leader election: %s leads (term %d) at %s", holder, term, address or "?")
        self._on_seen(holder, address)

    def _spec(self, term: int, acquired: datetime.datetime) -> LeaseSpec:
        return LeaseSpec(
            holderIdentity=self._settings.identity,
            leaseDurationSeconds=self._settings.lease_duration_s,
            leaseTransitions=term,
            acquireTime=acquired,
            renewTime=_now(),
        )

    def _annotations(self, lease: Any | None) -> dict[str, str]:
        old = dict(lease.metadata.annotations or {}) if lease is not None else {}
        return {**old, ADDRESS_ANNOTATION: self._settings.address}

    async def _create(self) -> int | None:
        s = self._settings
        # The Lease is gone (deleted, or never made): its count with it. The state's terms
        # are read first, in case this replica never saw the Lease at all.
        self.raise_floor(await self._known_terms())
        lease = Lease(
            metadata=ObjectMeta(
                name=s.lease_name, namespace=s.namespace, annotations=self._annotations(None)
            ),
            spec=self._spec(self._next_term(0), _now()),
        )
        sent = time.monotonic()
        try:
            self._held = await self._client.create(lease)
        except ApiError as err:
            if err.status.code == _CONFLICT:  # another replica created it first
                return None
            raise
        self._renewed_at = sent
        return self._won("created")

    async def _take(self, lease: Any, *, why: str) -> int | None:
        lease.metadata.annotations = self._annotations(lease)
        lease.spec = self._spec(self._next_term(_term(lease)), _now())
        sent = time.monotonic()
        try:
            self._held = await self._client.replace(lease)
        except ApiError as err:
            if err.status.code == _CONFLICT:  # another candidate took it first
                return None
            raise
        self._renewed_at = sent
        return self._won(why)

    def _next_term(self, counted: int) -> int:
        """The term of a win over a Lease that counted ``counted``: above the floor too."""
        term = max(counted, self.floor) + 1
        if term > leader_term.MAX_TERM:
            raise RuntimeError(
                f"leader term {term} would be above {leader_term.MAX_TERM}, the most a Lease "
                f"counts (a term of {self.floor} was seen in the state or at an agent): reset "
                "the agents' terms (tslice admin reset-term) and delete the state "
                "ConfigMaps' timeslice.io/leader-term annotations, see docs/security.md"
            )
        return term

    def _won(self, why: str) -> int:
        term = _term(self._held)
        self.raise_floor(term)
        self._saw(self._settings.identity, self._settings.address, term)
        log.info(
            "leader election: %s took %s (%s); leader term %d",
            self._settings.identity,
            self._what,
            why,
            term,
        )
        return term

    async def hold(self) -> str:
        """Renew the Lease until it is lost; why it was lost."""
        s = self._settings
        renewed = self._renewed_at  # the deadline runs from the take
        while True:
            await asyncio.sleep(s.renew_interval_s)
            started = time.monotonic()
            left = renewed + s.renew_deadline_s - started
            if left <= 0:
                return f"could not renew {self._what} for {s.renew_deadline_s:.1f} s"
            try:
                lost = await asyncio.wait_for(self._renew(), timeout=left)
            except ApiError as err:
                log.warning("leader election: renewing %s failed (%s)", self._what, _why(err))
                continue
            except Exception as err:  # unreachable, timed out: until the deadline
                log.warning("leader election: renewing %s failed (%s)", self._what, _why(err))
                continue
            if lost is not None:
                self._held = None  # another's now: nothing to release
                return lost
            renewed = started

    async def _renew(self) -> str | None:
        """None if renewed, else why the Lease is not this replica's any more."""
        held = self._held
        held.spec.renewTime = _now()
        try:
            self._held = await self._client.replace(held)
            return None
        except ApiError as err:
            if err.status.code not in (_CONFLICT, _NOT_FOUND):
                raise
        s = self._settings
        try:
            lease = await self._client.get(Lease, s.lease_name, namespace=s.namespace)
        except ApiError as err:
            if err.status.code != _NOT_FOUND:
                raise
            # Deleted (by hand): whoever creates it next must not take this term again.
            return f"{self._what} was deleted (term {_term(held)} was this replica's)"
        self.raise_floor(_term(lease))
        if _holder(lease) == s.identity and _term(lease) == _term(held):
            self._held = lease  # our own renewal, applied though its answer was lost
            return None
        return f"{self._what} is now held by {_holder(lease) or 'nobody'} (term {_term(lease)})"

    async def release(self) -> None:
        """Give the Lease up (graceful stop): the next candidate need not wait it out."""
        held, self._held = self._held, None
        if held is None:
            return
        try:
            await asyncio.wait_for(self._give_up(held), self._settings.renew_deadline_s)
        except Exception as err:  # not ours any more, or unreachable: it expires
            log.warning("leader election: could not release %s (%s)", self._what, _why(err))
            return
        log.info("leader election: %s released %s", self._settings.identity, self._what)

    async def _give_up(self, held: Any) -> None:
        """Write ``held`` with nobody holding it. A renewal cut off by the stop may have
        reached the API server without its answer (``held`` is then one version behind):
        on a conflict the Lease is read again and, still this replica's in this term,
        given up at its current version."""
        for attempt in range(2):
            held.spec.holderIdentity = None
            held.spec.leaseDurationSeconds = 1
            held.spec.renewTime = _now()
            try:
                await self._client.replace(held)
                return
            except ApiError as err:
                if err.status.code != _CONFLICT or attempt:
                    raise
            s = self._settings
            lease = await self._client.get(Lease, s.lease_name, namespace=s.namespace)
            if _holder(lease) != s.identity or _term(lease) != _term(held):
                raise RuntimeError(f"{self._what} is now held by {_holder(lease) or 'nobody'}")
            held = lease


def _why(err: BaseException) -> str:
    if isinstance(err, ApiError):
        return f"{err.status.code} {err.status.message}"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
