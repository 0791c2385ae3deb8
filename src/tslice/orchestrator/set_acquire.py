"""One AcquireSet: a job's Acquire of each group of a set, granted together (see sets).

Each group gets its own Acquire of the job, tagged with the set's number, so leases,
deadlines, faults that hold a group back, Hold streams and Yields work per group as
for any Acquire. What is added: the groups grant only together (``set_gate``), and
when one part fails or the caller goes away every other part is withdrawn, and a part
already granted is yielded again, so that no group stays granted because of a set that
did not complete. A group the job already holds (or is being switched to) is answered
at once, as a holder's second Acquire is; the job's other groups are then plain
Acquires (it waits holding part of the set already, and as plain waiters they may pass
a group kept for an older set that waits for what the job holds). A job has one
pending set per group at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from tslice.common import refusals
from tslice.orchestrator import callers, group, sets

log = logging.getLogger(__name__)


async def acquire_set(
    drivers: Mapping[str, group.GroupDriver],
    job: str,
    *,
    footprint_bytes: int,
    lease_ms: int,
    time_left: float | None,
) -> dict[str, callers.Grant]:
    """The grant of every group in ``drivers`` (all share one orchestrator's services);
    raises the first part's ``refusals.Refused`` (or the caller's cancellation)."""
    if not drivers:
        return {}
    services = next(iter(drivers.values())).services
    coordinator, series = services.sets, services.metrics
    started = time.monotonic()
    _refuse_a_second_set(coordinator, job, set(drivers))
    held = {gid for gid, d in drivers.items() if d.lock.holder == job}
    # A job that holds part of the set already waits for the rest while holding it: its
    # other parts are plain Acquires. As set members they would wait behind an older
    # set that waits for what the job holds (a deadlock); as plain waiters holding a
    # group of that set they pass the groups kept for it.
    seq = coordinator.open(job, () if held else set(drivers))
    parts = {
        gid: asyncio.ensure_future(
            d.acquire(
                job,
                footprint_bytes=footprint_bytes,
                lease_ms=lease_ms,
                time_left=time_left,
                set_seq=None if held else seq,
            )
        )
        for gid, d in drivers.items()
    }
    try:
        await _all_or_first_failure(list(parts.values()))
    except BaseException:
        series.acquire_sets.labels(outcome="failed").inc()
        await _withdraw(drivers, job, parts, held)
        raise
    finally:
        coordinator.close(seq)
    series.acquire_sets.labels(outcome="granted").inc()
    series.acquire_set_wait.observe(time.monotonic() - started)
    return {gid: part.result() for gid, part in parts.items()}


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
    held: set[str],
) -> None:
    """Cancel the parts still waiting (each leaves its queue) and yield the ones the set
    had granted (never a group the job held before the call)."""
    for part in parts.values():
        part.cancel()
    # Shielded: a cancelled caller must not leave a granted part behind.
    await asyncio.shield(asyncio.gather(*parts.values(), return_exceptions=True))
    granted = [
        gid
        for gid, part in parts.items()
        if gid not in held and not part.cancelled() and part.exception() is None
    ]
    for gid in granted:
        with contextlib.suppress(refusals.Refused):
            await asyncio.shield(drivers[gid].yield_(job))
        log.info(
            "group %s: yielded again for job %s, whose AcquireSet did not complete",
            gid,
            job,
            extra={"group_id": gid, "job_id": job},
        )
