"""Host memory is a budget: a snapshot that cannot be parked is refused before anything is
frozen (DESIGN.md invariant 8).

Why: every parked state lives in the node's host memory (the cuda driver keeps it in the
process, an in-process adapter in its host buffers, an engine in its own). Three parked
8-GPU jobs can need more DRAM than the node has, and the first sign used to be the OOM
killer taking a training process. So the agent knows how much host memory parked states
may use and refuses, with RESOURCE_EXHAUSTED naming the bytes needed and available, a
snapshot that would go beyond it: the holder keeps running, nothing is lost.

Two ways to set the limit:

* ``host_budget`` configured: parked states are accounted per (job, group), from what
  each snapshot reported parking (``OpResult.host_bytes``: NVML's count for the cuda
  backend, the adapter's for app-channel); the records persist with the jobs, so the
  accounting survives an agent restart. A snapshot needing more than the budget less
  what the others hold is refused.
* not configured (the default): the node's available memory now (``MemAvailable`` of
  ``/proc/meminfo``, which already counts what parked states hold) less
  ``host_reserve`` (default 10 % of the node's memory, at least 2 GiB) must cover it.

What a snapshot needs is asked of its backend first (``Backend.host_bytes_needed``:
the cuda backend reads NVML), else taken from the job's record (the device bytes it was
last seen to hold). Simulated states (the ``sim`` and ``noop`` backends) hold no host
memory and are not counted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable
from pathlib import Path

from tslice.agent.backends import guarded
from tslice.agent.jobs import model
from tslice.rpc import refusals

log = logging.getLogger(__name__)

GiB = 2**30
#: The least the default reserve keeps free for the node's own processes.
MIN_RESERVE_BYTES = 2 * GiB


@dataclasses.dataclass(frozen=True)
class Meminfo:
    total_bytes: int
    available_bytes: int


def read_meminfo(path: Path = Path("/proc/meminfo")) -> Meminfo | None:
    """MemTotal and MemAvailable, or None where they cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024  # kB
    if "MemTotal" not in values or "MemAvailable" not in values:
        return None
    return Meminfo(values["MemTotal"], values["MemAvailable"])


class HostBudget:
    """The node's budget for parked states, and the check a snapshot passes first."""

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        reserve_bytes: int | None = None,
        meminfo: Path = Path("/proc/meminfo"),
    ) -> None:
        """``budget_bytes``: the configured budget (None: the live default)."""
        self.configured = budget_bytes
        self._meminfo = meminfo
        self._reserve = reserve_bytes

    def reserve_bytes(self, info: Meminfo | None) -> int:
        if self._reserve is not None:
            return self._reserve
        total = info.total_bytes if info is not None else 0
        return max(MIN_RESERVE_BYTES, total // 10)

    def limit(self, parked: int) -> int | None:
        """What parked states may hold in all now (None: cannot tell, nothing refused)."""
        if self.configured is not None:
            return self.configured
        info = read_meminfo(self._meminfo)
        if info is None:
            return None
        # MemAvailable already excludes what the parked states hold.
        return max(0, info.available_bytes - self.reserve_bytes(info) + parked)

    def refusal(
        self, jobs: Iterable[model.Job], *, key: model.Key, needed: int, counted: Collection[str]
    ) -> str:
        """Why parking ``needed`` more bytes for ``key`` would exceed the budget ('' = it
        fits). ``counted``: the backends whose states hold host memory."""
        if needed <= 0:
            return ""
        holders = {
            (job.job_id, job.group): job.host_bytes
            for job in jobs
            if job.host_bytes > 0 and (job.backend or job.choice) in counted
        }
        own = holders.pop(key, 0)  # a snapshot again replaces what the job parked before
        parked = sum(holders.values())
        limit = self.limit(parked + own)
        if limit is None or parked + needed <= limit:
            return ""
        who = ", ".join(
            f"{job} ({group or 'no group'}) {n} bytes"
            for (job, group), n in sorted(holders.items())
        )
        where = (
            f"the node's budget for parked states is {limit} bytes (host_budget)"
            if self.configured is not None
            else f"the node has {limit} bytes of host memory for parked states (MemAvailable "
            "less the reserve, host_reserve)"
        )
        return (
            f"parking the state of job {key[0]!r} (group {key[1]!r}) needs {needed} bytes of "
            f"host memory; {where}, {parked} of them held by other parked states"
            + (f" ({who})" if who else "")
            + f", so {max(0, limit - parked)} are available. Nothing was frozen: the job "
            "keeps running. Restore or end a parked job first, or raise host_budget"
        )

    def parked_bytes(self, jobs: Iterable[model.Job], *, counted: Collection[str]) -> int:
        """Host bytes the parked states of this node hold now (for Status)."""
        return sum(
            job.host_bytes
            for job in jobs
            if job.host_bytes > 0 and (job.backend or job.choice) in counted
        )


async def check(
    backends: guarded.GuardedBackends,
    budget: HostBudget,
    jobs: Iterable[model.Job],
    route: model.Route,
    job: model.Job,
) -> None:
    """Refuse (RESOURCE_EXHAUSTED, nothing frozen) a snapshot of ``job`` whose state the
    node's host memory cannot park."""
    if job.state is not model.State.RUNNING or route.backend not in backends.parking:
        return  # nothing resident to park, or a simulated state
    needed = await backends.host_bytes_needed(route, job)
    why = budget.refusal(
        jobs,
        key=(job.job_id, job.group),
        needed=job.device_bytes if needed is None else needed,
        counted=backends.parking,
    )
    if why:
        raise refusals.Refused(refusals.Code.RESOURCE_EXHAUSTED, why)


def usage(
    backends: guarded.GuardedBackends, budget: HostBudget, jobs: Iterable[model.Job]
) -> tuple[int | None, int]:
    """(the limit for parked states now, the bytes they hold)."""
    listed = list(jobs)
    parked = budget.parked_bytes(listed, counted=backends.parking)
    return budget.limit(parked), parked
