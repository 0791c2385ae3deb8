"""One AcquireSet: a job's Acquire of each group of a set, granted together (see sets).

Each group gets its own Acquire of the job, tagged with the set's number, so leases,
deadlines, faults that hold a group back, Hold streams and Yields work per group as
for any Acquire. What is added: the groups grant only together (``set_gate``), and
when one part fails or the caller goes away every other part is withdrawn, so that no
group stays granted because of a set that did not complete. A group the job already
holds (or is being switched to) is answered at once, as a holder's second Acquire is;
the job's other groups are then plain Acquires (it waits holding part of the set
already, and as plain waiters they may pass a group kept for an older set that waits
for what the job holds). A job has one pending set per group at a time.

A set never takes back what another call of the job was told: a withdrawn part gives
back only its own share of the grant (``GroupDriver.give_back``: as an undelivered
reply), so a group that another Acquire of the job was granted, or held before, stays
the job's. And a set answers success only with grants that still hold when it answers:
a part granted early (a group the job held) that was evicted or lapsed meanwhile fails
the set ABORTED, naming why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from tslice.common import tasks
from tslice.orchestrator.group import callers
from tslice.orchestrator.group import driver as group
from tslice.orchestrator.sets import coordinator as sets
from tslice.rpc import refusals

log = logging.getLogger(__name__)


async def acquire_set(
    drivers: Mapping[str, group.GroupDriver],
    job: str,
    *,
    footprints: Mapping[str, int],
    lease_ms: int,
    time_left: float | None,
) -> dict[str, callers.Grant]:
    """The grant of every group in ``drivers`` (all share one orchestrator's services;
    ``footprints``: each group's); raises the first part's ``refusals.Refused`` (or the
    caller's cancellation)."""
    if not drivers:
        return {}
    services = next(iter(drivers.values())).services
    coordinator, series = services.sets, services.metrics
    started = time.monotonic()
    _refuse_a_second_set(coordinator, job, set(drivers))
    # A footprint that never fits refuses the set before any group of it queues the job.
    for gid, d in drivers.items():
        if footprints.get(gid, 0) > 0:
            await d.fits(job, footprints[gid])
    held = {gid for gid, d in drivers.items() if d.lock.holder == job}
    # A job that holds part of the set already waits for the rest while holding it: its
    # other parts are plain Acquires. As set members they would wait behind an older
    # set that waits for what the job holds (a deadlock); as plain waiters holding a
    # group of that set they pass the groups kept for it.
    seq = coordinator.open(job, () if held else set(drivers))
    parts: dict[str, asyncio.Future[callers.Grant]] = {}
    try:
        for gid, d in drivers.items():
            parts[gid] = d.acquire(
                job,
                footprint_bytes=footprints.get(gid, 0),
                lease_ms=lease_ms,
                time_left=time_left,
                set_seq=None if held else seq,
            ).future
        await _all_or_first_failure(list(parts.values()))
        grants = {gid: part.result() for gid, part in parts.items()}
        _refuse_a_lost_part(drivers, job, grants)
        for gid, grant in grants.items():
            drivers[gid].answered(job, grant.epoch)
    except BaseException as failure:
        series.acquire_sets.labels(outcome="failed").inc()
        await _withdraw(drivers, job, parts, _why(failure))
        raise
    finally:
        coordinator.close(seq)
    series.acquire_sets.labels(outcome="granted").inc()
    series.acquire_set_wait.observe(time.monotonic() - started)
    return grants


def _refuse_a_lost_part(
    drivers: Mapping[str, group.GroupDriver], job: str, grants: Mapping[str, callers.Grant]
) -> None:
    """Every part's grant must still hold as the set answers (a group the job held at the
    start was answered at once, and may have been evicted or lapsed since)."""
    for gid, grant in grants.items():
        lost = drivers[gid].lost_grant(job, grant.epoch)
        if lost is not None:
            raise refusals.Refused(
                refusals.Code.ABORTED,
                f"job {job!r}'s AcquireSet of {', '.join(sorted(grants))} is not granted: it "
                f"lost group {gid!r} while the set waited ({lost}); the set's other groups "
                "were given back: acquire the set again",
            )


def _why(failure: BaseException) -> str:
    if isinstance(failure, refusals.Refused):
        return f"its AcquireSet did not complete: {failure.message}"
    if isinstance(failure, asyncio.CancelledError):
        return "its AcquireSet was cancelled before all its groups were granted"
    return f"its AcquireSet did not complete ({type(failure).__name__})"


def _refuse_a_second_set(coordinator: sets.SetCoordinator, job: str, groups: set[str]) -> None:
    """One pending set per job and group: a second would stand in the first one's place
    in each queue and neither would be granted."""
    for _, other_job, other, _ in coordinator.waiting():
        shared = sorted(groups & other)
        if other_job == job and shared:
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                f"job {job!r} already waits in an AcquireSet for group(s) "
                f"{', '.join(map(repr, shared))}; wait for that call or cancel it before "
                "asking again",
            )


async def _all_or_first_failure(parts: list[asyncio.Future[callers.Grant]]) -> None:
    done, _ = await asyncio.wait(parts, return_when=asyncio.FIRST_EXCEPTION)
    for part in done:
        failure = part.exception()
        if failure is not None:
            raise failure


async def _withdraw(
    drivers: Mapping[str, group.GroupDriver],
    job: str,
    parts: Mapping[str, asyncio.Future[callers.Grant]],
    why: str,
) -> None:
    """Cancel the parts still waiting (each leaves its queue; one granted meanwhile
    departs undelivered) and give back each granted part's share of its grant: the
    group is released only where no other call of the job was answered with it.

    The withdrawal runs to its end in a task of its own: the caller may go away while it
    runs (its gRPC deadline is often the instant ``timeout_ms`` failed the set), and a
    granted part must not stay held by a job that nobody answered."""
    withdrawal = tasks.spawn(_withdrawn(drivers, job, parts, why), name=f"withdraw-set:{job}")
    _WITHDRAWING.add(withdrawal)
    withdrawal.add_done_callback(_WITHDRAWING.discard)
    await asyncio.shield(withdrawal)


#: Withdrawals under way (a task nobody references could be collected mid-way).
_WITHDRAWING: set[asyncio.Task[None]] = set()


async def _withdrawn(
    drivers: Mapping[str, group.GroupDriver],
    job: str,
    parts: Mapping[str, asyncio.Future[callers.Grant]],
    why: str,
) -> None:
    for part in parts.values():
        part.cancel()
    await asyncio.gather(*parts.values(), return_exceptions=True)
    granted = {
        gid: part.result().epoch
        for gid, part in parts.items()
        if not part.cancelled() and part.exception() is None
    }
    for gid, epoch in granted.items():
        await drivers[gid].give_back(job, epoch, why)
