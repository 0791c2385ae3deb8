"""Two TorchAdapters switched at once: one's snapshot overlapping the other's restore.

Issue 9 §2: the outgoing adapter's snapshot runs on a thread of its own (its copies on
its own streams: device to host) while the incoming one is restored here (host to
device), each of the incoming job's storages allocated only once the outgoing one has
freed enough within a device budget, so a switch costs about the longer copy and never
holds two states beyond the budget.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING

from tslice.workload.adapters import base

if TYPE_CHECKING:
    from tslice.workload.adapters.torch import TorchAdapter

OFFLOAD = base.SuspendMode.OFFLOAD


@dataclasses.dataclass(frozen=True)
class SwitchTimes:
    """How long an :func:`overlap_switch` took, seconds."""

    snapshot_s: float
    restore_s: float
    total_s: float
    #: Most device bytes both adapters held at once during the switch.
    peak_bytes: int


class _Budget:
    """Device bytes in use by both adapters of a switch, within a budget (thread-safe)."""

    def __init__(self, *, in_use: int, budget: int | None) -> None:
        self.in_use = in_use
        self.budget = budget
        self.peak = in_use
        self._changed = threading.Condition()

    def freed(self, nbytes: int) -> None:
        with self._changed:
            self.in_use -= nbytes
            self._changed.notify_all()

    def lift(self) -> None:
        """The snapshot failed: nothing more comes free, stop holding the restore back."""
        with self._changed:
            self.budget = None
            self._changed.notify_all()

    def admit(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit (always, without a budget)."""
        with self._changed:
            budget = self.budget
            if budget is not None:
                self._changed.wait_for(lambda: self.in_use + nbytes <= budget)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)


def overlap_switch(
    outgoing: TorchAdapter,
    incoming: TorchAdapter,
    *,
    mode: base.SuspendMode | int | str = OFFLOAD,
    budget_bytes: int | None = None,
    in_use_bytes: int = 0,
) -> SwitchTimes:
    """Snapshot ``outgoing`` and restore ``incoming`` at once (issue 9 §2).

    The snapshot runs on a thread of its own (its copies on the outgoing adapter's
    streams), the restore here; with ``budget_bytes`` (device memory both may use,
    ``in_use_bytes`` of it taken when the switch starts) each storage of the incoming
    job is allocated only once the outgoing one has freed enough: never two states
    resident beyond the budget. Give ``outgoing`` ``free_progressively`` so that its
    memory comes free piece by piece. Errors of either side are raised after both end.
    """
    budget = _Budget(in_use=in_use_bytes, budget=budget_bytes)
    times: dict[str, float] = {}
    errors: list[BaseException] = []
    began = time.perf_counter()

    def snapshot() -> None:
        try:
            outgoing.snapshot(mode, freed_bytes=budget.freed)
        except BaseException as err:  # re-raised below, in the caller's thread
            errors.append(err)
            budget.lift()
        finally:
            times["snapshot"] = time.perf_counter() - began

    thread = threading.Thread(target=snapshot, name="tslice-overlap-snapshot")
    thread.start()
    try:
        incoming.restore(admit=budget.admit)
        times["restore"] = time.perf_counter() - began
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return SwitchTimes(
        snapshot_s=times["snapshot"],
        restore_s=times["restore"],
        total_s=time.perf_counter() - began,
        peak_bytes=budget.peak,
    )
