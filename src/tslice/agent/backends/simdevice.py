"""Simulated accelerators of one node: capacity accounting, persistence and a journal.

A :class:`SimNode` stands in for the GPUs of one machine. A job's state for a group
occupies bytes on every device of the node while resident (residency is per
(job, group): one job's sampler and trainer states are two allocations); an
allocation that would overcommit a device is refused with a message naming who holds
the memory, so a mutual-exclusion bug in the layers above surfaces as an error
instead of passing silently.

The device state outlives the process that drives it (a real GPU outlives an agent
crash), so every change is written atomically to a JSON file and read back on start.
Every allocation and release is also appended to a JSON-lines *journal*; the
mutual-exclusion checker replays journals of all nodes with :func:`read_journal`.

States also move piece by piece (chunked offload, issue 9 §2): a snapshot frees its
bytes progressively (:meth:`SimNode.leave`) and a restore lands them progressively
(:meth:`SimNode.land`), so an incoming state may use what an outgoing one has already
freed while both copies run, and a prefetch may land a saved state in free memory
ahead of its grant. Capacity counts every byte on the device, moving or not. The
journal marks when a state is *usable* on the device: ``alloc`` once all its bytes
are there, ``free`` when it starts leaving (its job yielded it); bytes in motion and
prefetched copies are counted against capacity, never journaled as resident.
:class:`CopySpeed` says how long moving a job's bytes off (snapshot) or back onto
(restore) a device takes; the two directions may run at different rates.

This module is pure stdlib and imports no tslice layer: the agent's sim backend owns
it, and the demo and the checker (``tslice.sim``, a layer above) read its journals.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

GiB = 1024**3
DEFAULT_CAPACITY_BYTES = 80 * GiB
DEFAULT_BANDWIDTH_BYTES_PER_S = 25 * 10**9
DEFAULT_LATENCY_S = 0.005
#: Share of a device a job's state for a group occupies when it declares nothing: below
#: one half, so that one job's states for two groups that share the devices fit together
#: (weight sync holds both), and above one third, so that a third state never fits
#: beside them and deferred residents of other groups must give way.
DEFAULT_FOOTPRINT_SHARE = 0.4

STATE_FILE = "sim-devices.json"
JOURNAL_FILE = "sim-journal.jsonl"
#: Every injected fault (failure or hang), one JSON line each: chaos runs count them.
FAULTS_FILE = "sim-faults.jsonl"

EventKind = Literal["alloc", "free"]
Direction = Literal["snapshot", "restore"]
FaultKind = Literal["fail", "hang"]


class CapacityError(Exception):
    """An allocation would exceed a device's capacity; nothing was allocated."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One journal line: ``bytes`` landed on (alloc) or left (free) ``device``."""

    t: float
    node: str
    group: str
    job: str
    event: EventKind
    device: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: a ``direction`` copy of ``job``'s state for ``group`` failed or hung."""

    t: float
    node: str
    group: str
    job: str
    kind: FaultKind
    direction: Direction


#: Whose state it is: ``(job, group)``.
Key = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class SavedState:
    """A job's state for a group parked off the devices: footprint to bring back, host bytes."""

    footprint_bytes: int
    host_bytes: int


@dataclasses.dataclass(frozen=True)
class CopySpeed:
    """Time of a copy: ``bytes_per_device / rate + latency_s``, the rate set per direction.

    Devices copy in parallel, each over its own link, so only the bytes of one device
    count. A restore moves at ``restore_bandwidth_bytes_per_s``, or at the snapshot
    rate when that is ``None``: real hosts often read pinned memory back faster than
    they write it (the recorded veRL run restored ~3x faster than it snapshotted).
    """

    bandwidth_bytes_per_s: int = DEFAULT_BANDWIDTH_BYTES_PER_S
    restore_bandwidth_bytes_per_s: int | None = None
    latency_s: float = DEFAULT_LATENCY_S

    def __post_init__(self) -> None:
        for label, rate in (
            ("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s),
            ("restore_bandwidth_bytes_per_s", self.restore_bandwidth_bytes_per_s),
        ):
            if rate is not None and rate <= 0:
                raise ValueError(f"{label} must be positive (got {rate})")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0 (got {self.latency_s})")

    def rate(self, direction: Direction) -> int:
        """Bytes per second per device in ``direction``."""
        if direction == "restore" and self.restore_bandwidth_bytes_per_s is not None:
            return self.restore_bandwidth_bytes_per_s
        return self.bandwidth_bytes_per_s

    def seconds(self, *, bytes_per_device: int, direction: Direction) -> float:
        """How long moving ``bytes_per_device`` in ``direction`` takes."""
        return bytes_per_device / self.rate(direction) + self.latency_s

    @classmethod
    def matching(
        cls,
        *,
        bytes_per_device: int,
        snapshot_s: float,
        restore_s: float,
        latency_s: float,
        min_copy_s: float = 1e-4,
    ) -> CopySpeed:
        """The speed at which ``bytes_per_device`` snapshot in ``snapshot_s`` and restore in
        ``restore_s`` (latency included). A target below the latency is clamped to
        ``latency_s + min_copy_s``: no rate can make a copy faster than its fixed cost.
        """

        def rate(total_s: float) -> int:
            return max(int(bytes_per_device / max(total_s - latency_s, min_copy_s)), 1)

        return cls(
            bandwidth_bytes_per_s=rate(snapshot_s),
            restore_bandwidth_bytes_per_s=rate(restore_s),
            latency_s=latency_s,
        )


class SimNode:
    """N identical simulated devices of ``capacity_bytes`` each.

    Not thread-safe; callers on one event loop need no lock because no method awaits.
    ``state_dir=None`` keeps everything in memory (no state file, no journal).
    """

    def __init__(
        self,
        *,
        node: str,
        devices: int = 1,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        state_dir: Path | None = None,
    ) -> None:
        if devices < 1:
            raise ValueError(f"devices must be at least 1 (got {devices})")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive (got {capacity_bytes})")
        self.node = node
        self.devices = devices
        self.capacity_bytes = capacity_bytes
        self._state_path = state_dir / STATE_FILE if state_dir is not None else None
        self._journal_path = state_dir / JOURNAL_FILE if state_dir is not None else None
        self._faults_path = state_dir / FAULTS_FILE if state_dir is not None else None
        #: Bytes per device of every resident state.
        self._resident: dict[Key, int] = {}
        self._saved: dict[Key, SavedState] = {}
        #: Of a resident state being snapshotted: the bytes already freed (chunked offload).
        self._freed: dict[Key, int] = {}
        #: Of a saved state being restored or prefetched: the bytes already landed.
        self._landed: dict[Key, int] = {}
        #: Landed bytes that only a prefetch holds (dropped whenever room is needed).
        self._cached: set[Key] = set()
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._load()

    # ---- queries ---------------------------------------------------------------

    def device_ids(self) -> list[str]:
        return [f"sim{i}" for i in range(self.devices)]

    def resident_bytes(self, *, job: str, group: str) -> int | None:
        """Bytes per device the job's state for the group holds; ``None`` if not resident."""
        return self._resident.get((job, group))

    def saved(self, *, job: str, group: str) -> SavedState | None:
        return self._saved.get((job, group))

    def used_bytes(self) -> int:
        """Bytes in use on each device (all devices hold the same jobs), moving ones too."""
        return sum(self._resident.values()) - sum(self._freed.values()) + sum(self._landed.values())

    def _on_device(self, key: Key) -> int:
        """Bytes per device of one state now: resident minus freed, plus landed."""
        return self._resident.get(key, 0) - self._freed.get(key, 0) + self._landed.get(key, 0)

    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes()

    def landed_bytes(self, *, job: str, group: str) -> int:
        """Bytes of the job's saved state already on the devices (a restore or prefetch)."""
        return self._landed.get((job, group), 0)

    def leaving(self) -> bool:
        """Whether some state is being snapshotted (its memory is being freed)."""
        return bool(self._freed)

    def cached(self, *, job: str, group: str) -> bool:
        """Whether the job's landed bytes are a prefetch's (no restore uses them yet)."""
        return (job, group) in self._cached

    # ---- changes ----------------------------------------------------------------

    def never_fits(self, *, job: str, group: str, bytes_per_device: int) -> str:
        """Why ``bytes_per_device`` can never be resident here ("" if it can)."""
        if bytes_per_device <= self.capacity_bytes:
            return ""
        return (
            f"job {job} (group {group}) needs {bytes_per_device} bytes per device but each "
            f"device of node {self.node} holds only {self.capacity_bytes}; lower the job's "
            "footprint or raise the simulated capacity"
        )

    def check_fits(
        self,
        *,
        job: str,
        group: str,
        bytes_per_device: int,
        action: str = "restore",
        counting_cached: bool = True,
    ) -> None:
        """Raise :class:`CapacityError` if the job cannot land ``bytes_per_device`` now
        (``counting_cached=False``: as if other jobs' prefetched copies were dropped)."""
        first = self.device_ids()[0]
        if reason := self.never_fits(job=job, group=group, bytes_per_device=bytes_per_device):
            raise CapacityError(f"{action} on {first}: {reason}")
        others = {
            k: held
            for k in {*self._resident, *self._landed}
            if k != (job, group)
            and (counting_cached or k not in self._cached)
            and (held := self._on_device(k)) > 0
        }
        used = sum(others.values())
        if used + bytes_per_device > self.capacity_bytes:
            holders = ", ".join(
                f"job {j} of group {g} ({held} bytes)" for (j, g), held in sorted(others.items())
            )
            raise CapacityError(
                f"{action} of job {job} (group {group}) on {first} (node {self.node}) would "
                f"need {bytes_per_device} bytes; {used} of {self.capacity_bytes} in use by "
                f"{holders}"
            )

    def allocate(
        self, *, job: str, group: str, bytes_per_device: int, action: str = "restore"
    ) -> None:
        """Land the job's bytes on every device, or raise :class:`CapacityError` (no change).

        Bytes a restore or prefetch of the job already landed count towards it; other
        jobs' prefetched copies are dropped first if that makes room.
        """
        key = (job, group)
        if key in self._resident:
            return
        landed = self._landed.get(key, 0)
        self.make_room(job=job, group=group, bytes_per_device=bytes_per_device - landed)
        self.check_fits(
            job=job, group=group, bytes_per_device=bytes_per_device - landed, action=action
        )
        self._landed.pop(key, None)
        self._cached.discard(key)
        self._resident[key] = bytes_per_device
        self._save()
        self._journal(job=job, group=group, event="alloc", bytes_per_device=bytes_per_device)

    # ---- moving piece by piece ----------------------------------------------------------

    def make_room(self, *, job: str, group: str, bytes_per_device: int) -> bool:
        """Drop other jobs' prefetched copies (newest first) until ``bytes_per_device``
        more fit; whether they fit now. A prefetch never costs anyone else memory."""
        for key in sorted(self._cached - {(job, group)}, reverse=True):
            if self.free_bytes() >= bytes_per_device:
                break
            self.drop_landed(job=key[0], group=key[1])
        return self.free_bytes() >= bytes_per_device

    def land(self, *, job: str, group: str, bytes_per_device: int, cached: bool = False) -> None:
        """``bytes_per_device`` more of the job's saved state are on the devices (a
        restore's chunk, or a prefetch's with ``cached``); :class:`CapacityError` if
        they do not fit in free memory (nothing changes)."""
        key = (job, group)
        if bytes_per_device > self.free_bytes():
            raise CapacityError(
                f"{bytes_per_device} more bytes of job {job} (group {group}) do not fit on "
                f"node {self.node}: {self.free_bytes()} of {self.capacity_bytes} free"
            )
        self._landed[key] = self._landed.get(key, 0) + bytes_per_device
        if cached:
            self._cached.add(key)
        else:
            self._cached.discard(key)

    def drop_landed(self, *, job: str, group: str) -> int:
        """Give back what a restore or prefetch of the job landed (its host copy stays)."""
        self._cached.discard((job, group))
        return self._landed.pop((job, group), 0)

    def begin_leaving(self, *, job: str, group: str) -> None:
        """A snapshot of the job's resident state starts: it is no longer usable (journaled
        ``free``); its bytes stay counted until :meth:`leave` frees them."""
        key = (job, group)
        if key in self._resident and key not in self._freed:
            self._freed[key] = 0
            self._journal(job=job, group=group, event="free", bytes_per_device=self._resident[key])

    def leave(self, *, job: str, group: str, bytes_per_device: int) -> None:
        """``bytes_per_device`` more of a leaving state are copied off and freed."""
        key = (job, group)
        if key in self._freed:
            self._freed[key] = min(self._freed[key] + bytes_per_device, self._resident[key])

    def stay(self, *, job: str, group: str) -> None:
        """A snapshot that moved nothing in the end: the state is usable again."""
        key = (job, group)
        if self._freed.pop(key, None) is not None and key in self._resident:
            self._journal(job=job, group=group, event="alloc", bytes_per_device=self._resident[key])

    def free(self, *, job: str, group: str) -> int:
        """Release the job's device bytes; returns the bytes freed per device (0 if none)."""
        return self._release((job, group))

    def park(self, *, job: str, group: str, saved: SavedState) -> None:
        """Free the job's devices and record its saved state, in one persisted step."""
        self._saved[(job, group)] = saved
        self._release((job, group), changed=True)

    def _release(self, key: Key, *, changed: bool = False) -> int:
        held = self._resident.pop(key, None)
        journaled = self._freed.pop(key, None) is not None  # begin_leaving said ``free``
        if held is not None or changed:
            self._save()
        if held is None:
            return 0
        if not journaled:
            self._journal(job=key[0], group=key[1], event="free", bytes_per_device=held)
        return held

    def unpark(self, *, job: str, group: str) -> None:
        """The job's saved state is back on the devices; forget the host copy."""
        if self._saved.pop((job, group), None) is not None:
            self._save()

    def forget(self, *, job: str, group: str) -> None:
        self.free(job=job, group=group)
        self.drop_landed(job=job, group=group)
        self.unpark(job=job, group=group)

    def record_fault(self, *, job: str, group: str, kind: FaultKind, direction: Direction) -> None:
        """Append an injected fault to the faults file (nothing without a state directory)."""
        if self._faults_path is None:
            return
        fault = Fault(
            t=time.time(), node=self.node, group=group, job=job, kind=kind, direction=direction
        )
        with self._faults_path.open("a") as f:
            f.write(json.dumps(dataclasses.asdict(fault)) + "\n")

    # ---- persistence --------------------------------------------------------------

    def _load(self) -> None:
        assert self._state_path is not None
        try:
            raw = json.loads(self._state_path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            raise ValueError(
                f"simulated device state {self._state_path} is unreadable ({err}); "
                "delete it to start with empty devices"
            ) from err
        resident, saved = raw.get("resident", []), raw.get("saved", [])
        if isinstance(resident, dict):  # written before residency was per (job, group)
            resident = [{"job": j, **r} for j, r in resident.items()]
            saved = [{"job": j, **s} for j, s in saved.items()]
        self._resident = {(r["job"], r["group"]): int(r["bytes_per_device"]) for r in resident}
        self._saved = {
            (s["job"], s["group"]): SavedState(int(s["footprint_bytes"]), int(s["host_bytes"]))
            for s in saved
        }
        self._reconcile_journal()

    def _reconcile_journal(self) -> None:
        """After a restart, make the journal say what the devices hold: a snapshot cut
        by a crash journaled ``free`` when it started but left the state resident (usable
        again: ``alloc``), and a crash between a state change and its journal line left
        the journal one event behind. Without this the checker would miss a residency."""
        if self._journal_path is None:
            return
        last: dict[Key, Event] = {}
        for event in _iter_journal(self._journal_path):
            if event.node == self.node:
                last[(event.job, event.group)] = event
        for key, held in self._resident.items():
            if key not in last or last[key].event == "free":
                self._journal(job=key[0], group=key[1], event="alloc", bytes_per_device=held)
        for key, event in last.items():
            if event.event == "alloc" and key not in self._resident:
                self._journal(job=key[0], group=key[1], event="free", bytes_per_device=event.bytes)

    def _save(self) -> None:
        if self._state_path is None:
            return
        payload = {
            "node": self.node,
            "resident": [
                {"job": j, "group": g, "bytes_per_device": held}
                for (j, g), held in self._resident.items()
            ],
            "saved": [
                {"job": j, "group": g, **dataclasses.asdict(s)} for (j, g), s in self._saved.items()
            ],
        }
        tmp = self._state_path.with_suffix(".tmp")
        with tmp.open("w") as f:
            json.dump(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._state_path)

    def _journal(self, *, job: str, group: str, event: EventKind, bytes_per_device: int) -> None:
        if self._journal_path is None:
            return
        now = time.time()
        with self._journal_path.open("a") as f:
            for device in self.device_ids():
                line = {
                    "t": now,
                    "node": self.node,
                    "group": group,
                    "job": job,
                    "event": event,
                    "device": device,
                    "bytes": bytes_per_device,
                }
                f.write(json.dumps(line) + "\n")
                # One flush per line: a checker tailing the file never sees half an event.
                f.flush()


def read_journal(path: Path) -> list[Event]:
    """Every event of a journal file, in write order; a torn last line (crash) is skipped."""
    return list(_iter_journal(path))


def read_faults(path: Path) -> list[Fault]:
    """Every injected fault of a faults file, in write order; a torn last line is skipped."""
    return [
        Fault(
            t=float(raw["t"]),
            node=str(raw["node"]),
            group=str(raw["group"]),
            job=str(raw["job"]),
            kind="hang" if raw["kind"] == "hang" else "fail",
            direction="restore" if raw["direction"] == "restore" else "snapshot",
        )
        for raw in _json_lines(path)
    ]


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except ValueError:
            continue


def _iter_journal(path: Path) -> Iterator[Event]:
    for raw in _json_lines(path):
        yield Event(
            t=float(raw["t"]),
            node=str(raw["node"]),
            group=str(raw["group"]),
            job=str(raw["job"]),
            event="alloc" if raw["event"] == "alloc" else "free",
            device=str(raw["device"]),
            bytes=int(raw["bytes"]),
        )
