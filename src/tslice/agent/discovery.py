"""Finding the processes of a job on this node.

Three sources, in the order the cuda backend trusts them:

1. explicit PIDs from the request (``CudaBackendConfig.explicit_target.pids``),
   checked with :func:`validate_pids` (positive, the process exists);
2. processes that announced themselves over the agent's Unix socket
   (:mod:`tslice.agent.channel.registration`, PID taken from the socket's peer credentials);
3. NVML process lists matched to a pod through ``/proc/<pid>/cgroup``
   (:func:`gpu_processes` then :func:`pids_for_pod`), for Kubernetes mode.

Processes that NVML lists with no device memory (launchers, daemons) are dropped:
locking them fails and there is nothing to move. A process whose memory NVML cannot
tell (``N/A``: every process on a MIG-enabled GPU, and under vGPU) is kept, with its
memory unknown (``GpuProcess.memory_known``): it is on the device, but bytes moved
read 0 for it and the freed-memory check cannot be made per process.
All functions are synchronous and cheap except the NVML queries.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

from tslice.agent import nvml as nvml_mod


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    """A process holding device memory on one GPU."""

    pid: int
    device: int
    device_uuid: str
    used_bytes: int
    #: False where NVML reads N/A (MIG, vGPU): ``used_bytes`` is then 0, not measured.
    memory_known: bool = True


def gpu_processes(nvml: nvml_mod.Nvml) -> list[GpuProcess]:
    """Processes holding device memory, one entry per (pid, device), over all devices.

    Compute and graphics lists are merged; entries reporting 0 bytes are dropped (they
    hold a context but nothing to checkpoint); entries whose memory is "not available"
    are kept with ``memory_known=False`` (see the module docstring).
    """
    found: dict[tuple[int, int], GpuProcess] = {}
    for index in range(nvml.device_count()):
        uuid = nvml.device_uuid(index)
        for proc in nvml.processes(index):
            used = proc.used_bytes
            if used == 0:
                continue
            known = used is not None and used < nvml_mod.NVML_VALUE_NOT_AVAILABLE
            entry = GpuProcess(proc.pid, index, uuid, used if known and used else 0, known)
            key = (proc.pid, index)
            previous = found.get(key)
            if previous is None or (known and previous.used_bytes < entry.used_bytes):
                found[key] = entry
    return sorted(found.values(), key=lambda p: (p.pid, p.device))


def listed_without_memory(nvml: nvml_mod.Nvml) -> set[int]:
    """PIDs that NVML lists (so it sees them, in this PID namespace) with 0 bytes on
    every device: a CUDA context and nothing to move (a launcher, a Ray daemon)."""
    empty: set[int] = set()
    holding: set[int] = set()
    for index in range(nvml.device_count()):
        for proc in nvml.processes(index):
            (empty if proc.used_bytes == 0 else holding).add(proc.pid)
    return empty - holding


def memory_unknown(processes: Iterable[GpuProcess]) -> set[int]:
    """PIDs whose device memory NVML cannot tell on some device (MIG, vGPU)."""
    return {proc.pid for proc in processes if not proc.memory_known}


def device_bytes_by_pid(processes: Iterable[GpuProcess]) -> dict[int, int]:
    """Total device bytes per PID, summed over devices."""
    totals: dict[int, int] = {}
    for proc in processes:
        totals[proc.pid] = totals.get(proc.pid, 0) + proc.used_bytes
    return totals


def pids_on_devices(processes: Iterable[GpuProcess], devices: Iterable[int]) -> set[int]:
    """PIDs holding device memory on at least one of ``devices`` (NVML indices)."""
    wanted = set(devices)
    return {proc.pid for proc in processes if proc.device in wanted}


def pids_for_pod(
    pod_uid: str, candidates: Iterable[int], *, proc_root: str | os.PathLike[str] = "/proc"
) -> list[int]:
    """The candidates whose ``<proc_root>/<pid>/cgroup`` names the pod.

    A line matches if it contains the UID as written (cgroupfs driver:
    ``.../pod<uid>/...``) or with dashes turned into underscores (systemd
    driver: ``kubepods-pod<uid_with_underscores>.slice``). A PID whose cgroup
    file cannot be read (exited, permission, not a file) is skipped.
    """
    uid = pod_uid.strip()
    if not uid:
        raise ValueError("pod_uid is empty; pass the pod's metadata.uid")
    forms = {uid, uid.replace("-", "_")}
    matched: list[int] = []
    seen: set[int] = set()
    for pid in candidates:
        if pid in seen:
            continue
        seen.add(pid)
        try:
            text = (Path(proc_root) / str(pid) / "cgroup").read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if any(form in line for line in text.splitlines() for form in forms):
            matched.append(pid)
    return matched


def _stat_fields(pid: int, proc_root: str | os.PathLike[str]) -> list[str] | None:
    """The fields of ``<proc_root>/<pid>/stat`` after the command name (field 3 on), or
    None if the process is gone. The name may contain spaces: split after the last ')'."""
    try:
        stat = (Path(proc_root) / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def _stat_int(pid: int, index: int, proc_root: str | os.PathLike[str]) -> int | None:
    fields = _stat_fields(pid, proc_root)
    try:
        return int(fields[index]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def process_exists(pid: int, *, proc_root: str | os.PathLike[str] = "/proc") -> bool:
    """Whether ``pid`` is a live process (zombies count as gone)."""
    fields = _stat_fields(pid, proc_root)
    # The state letter is the first field after the command name.
    return fields is not None and bool(fields) and fields[0] not in ("Z", "X")


def process_start_time(pid: int, *, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone.

    PID plus start time identifies a process across PID reuse.
    """
    # Field 22 of stat overall = index 19 after the command name (fields 3..).
    return _stat_int(pid, 19, proc_root)


def parent_pid(pid: int, *, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """The parent of ``pid``, or None if it is gone (or has none: pid 1)."""
    parent = _stat_int(pid, 1, proc_root)  # field 4: ppid
    return parent if parent is not None and parent > 0 else None


def descends_from(
    pid: int, ancestors: Iterable[int], *, proc_root: str | os.PathLike[str] = "/proc"
) -> bool:
    """Whether ``pid`` is one of ``ancestors`` or a (grand)child of one (64 levels at most)."""
    wanted = set(ancestors)
    current: int | None = pid
    for _ in range(64):
        if current is None:
            return False
        if current in wanted:
            return True
        current = parent_pid(current, proc_root=proc_root)
    return False


#: What NCCL names its shared-memory segments (``/dev/shm/nccl-XXXXXX``): a process that
#: maps one holds a communicator with peers on this node.
NCCL_SHM_MARK = "/dev/shm/nccl-"


def holds_nccl_peers(pid: int, *, proc_root: str | os.PathLike[str] = "/proc") -> bool:
    """Whether ``pid`` maps an NCCL shared-memory segment (a communicator with a peer on
    this node, through the SHM or P2P transport); False if its maps cannot be read.

    A heuristic, documented as such: loading libnccl (every PyTorch CUDA process does)
    is not enough; a communicator between processes of one node is.
    """
    try:
        with (Path(proc_root) / str(pid) / "maps").open(errors="replace") as maps:
            return any(NCCL_SHM_MARK in line for line in maps)
    except OSError:
        return False


class InvalidPidError(ValueError):
    """A PID given by the caller is not usable; the message says which and why."""


def validate_pids(pids: Iterable[int], *, proc_root: str | os.PathLike[str] = "/proc") -> list[int]:
    """Return the PIDs in the order given, duplicates dropped, each positive and alive."""
    result: list[int] = []
    for pid in pids:
        if pid <= 0:
            raise InvalidPidError(f"pid {pid} is not a process id (must be positive)")
        if pid in result:
            continue
        if not process_exists(pid, proc_root=proc_root):
            raise InvalidPidError(
                f"pid {pid} does not exist on this node (looked in {proc_root}); "
                "is the agent running in the host PID namespace (hostPID)?"
            )
        result.append(pid)
    return result
