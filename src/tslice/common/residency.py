"""What part of a workload's state is on the device, by tag.

Shared by both ends of the workload channel (the agent's ``ChannelHub`` and the
workload's ``WorkloadHandle``/adapters) so that both follow the same rules and agree
after a reconnect, when the workload reports what it holds.

Rules: a command with no tags means "everything". ``declared`` are the tags the
workload registered; with none declared the workload is all-or-nothing.
``suspended`` is true when anything is off the device; a workload with some
declared tags resident and others not is *partly* resident.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Everything is on the device.
FULL = "full"
#: Some declared tags are on the device, others are not (e.g. weights back, KV cache not yet).
PARTIAL = "partial"
#: Nothing is on the device.
NONE = "none"


class ResidencyTracker:
    """Follows residency from the commands that succeeded."""

    def __init__(
        self,
        *,
        declared: Iterable[str] = (),
        suspended: bool = False,
        resident: Iterable[str] | None = None,
    ) -> None:
        self.declared = tuple(declared)
        self.suspended = suspended
        if resident is not None:
            self.resident = set(resident)
        else:
            self.resident = set() if suspended else set(self.declared)

    def snapshot_done(self, tags: Iterable[str]) -> None:
        moved = set(tags)
        if not moved or moved >= set(self.declared):
            self.resident.clear()
        else:
            self.resident -= moved
        self.suspended = True

    def restore_done(self, tags: Iterable[str]) -> None:
        moved = set(tags)
        if not moved or self.resident | moved >= set(self.declared):
            self.resident = set(self.declared)
            self.suspended = False
        else:
            self.resident |= moved
            self.suspended = True

    @property
    def resident_tags(self) -> tuple[str, ...]:
        """Resident tags in declaration order."""
        return tuple(t for t in self.declared if t in self.resident)

    @property
    def missing_tags(self) -> tuple[str, ...]:
        """Declared tags that are not on the device."""
        return tuple(t for t in self.declared if t not in self.resident)

    @property
    def residency(self) -> str:
        """:data:`FULL`, :data:`PARTIAL` or :data:`NONE`."""
        if not self.suspended:
            return FULL
        return PARTIAL if self.resident else NONE
