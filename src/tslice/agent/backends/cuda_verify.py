"""What NVML says a job's processes hold on the device, and the proof that a snapshot
freed it.

Why: a snapshot that reports SAVED while the memory is still allocated lets the next
job in onto a full device (field reports: "memory stays allocated after a sleep"). So
the cuda backend reads NVML before and after, and a snapshot whose processes still
hold more than ``released_tolerance_bytes`` is fatal (the job FAULTED, with the bytes
named), never SAVED. Where NVML cannot tell (no NVML, ``measure_bytes: false``, a
failed query, N/A on MIG or vGPU), the result says the release was not verified.

The same reading finds the processes NVML lists with no device memory at all (a CUDA
context and nothing else: launchers, Ray daemons, llm-d-rl-time-slicing #148); the
backend leaves those alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from tslice.agent import discovery
from tslice.agent import nvml as nvml_mod


@dataclasses.dataclass(frozen=True)
class Reading:
    """Device bytes per PID at one moment, as NVML reports them."""

    #: Bytes per PID (summed over devices; 0 = not listed, or N/A).
    bytes: dict[int, int]
    #: PIDs NVML lists only with 0 bytes (a context, no memory).
    idle: frozenset[int] = frozenset()
    #: PIDs whose memory NVML cannot tell (N/A: MIG, vGPU).
    unknown: frozenset[int] = frozenset()
    #: Why nothing could be read ('' = it was).
    missing: str = ""

    def total(self) -> int:
        return sum(self.bytes.values())


def read(nvml: nvml_mod.Nvml, pids: Iterable[int]) -> Reading:
    """NVML's view of ``pids`` now (blocking: run it off the event loop)."""
    wanted = set(pids)
    procs = discovery.gpu_processes(nvml)
    totals = discovery.device_bytes_by_pid(procs)
    return Reading(
        bytes={pid: totals.get(pid, 0) for pid in wanted},
        idle=frozenset(discovery.listed_without_memory(nvml) & wanted),
        unknown=frozenset(discovery.memory_unknown(procs) & wanted),
    )


def unread(why: str, pids: Iterable[int]) -> Reading:
    return Reading(bytes=dict.fromkeys(pids, 0), missing=why)


def still_held(after: Reading, pids: Iterable[int], *, tolerance: int) -> dict[int, int]:
    """The processes of ``pids`` that hold more than ``tolerance`` bytes after a snapshot."""
    return {
        pid: after.bytes.get(pid, 0)
        for pid in pids
        if pid not in after.unknown and after.bytes.get(pid, 0) > tolerance
    }


def verification(after: Reading, pids: Iterable[int]) -> str:
    """'verified', or why the release could not be checked (for the operation's state)."""
    if after.missing:
        return f"not verified: {after.missing}"
    unknown = sorted(after.unknown & set(pids))
    if unknown:
        return f"not verified for pids {unknown}: NVML reads N/A (MIG or vGPU)"
    return "verified"
