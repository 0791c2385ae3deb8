"""Whether the orchestrator can write its state, and why not: a failing store is loud.

A group's worker writes its state before it acts (``tslice.orchestrator.group.executor``). When a
save fails (a full disk, a corrupt database, an unreachable API server in HA mode) the
worker holds that group and retries with back-off until the save goes through: nothing
may act on state that is not on disk. :class:`StoreHealth` keeps why, shared by every
group, so that meanwhile nothing is silent:

- a call that would change a group is refused at once, UNAVAILABLE, naming the reason
  (:meth:`StoreHealth.check`; nothing was changed, and the clients retry UNAVAILABLE);
- each group reports UNKNOWN with the reason as its detail, and GetGroupStatus still
  answers (the worker answers reads at once while it waits for the store), so an
  Acquire already waiting is answered UNAVAILABLE with the reason before its deadline;
- the process's gRPC health goes NOT_SERVING, and the reason is logged (the watcher
  that ``tslice.orchestrator.app`` registers).

All of it ends on its own with the first save that goes through (space was freed).
"""

from __future__ import annotations

from collections.abc import Callable

from tslice.rpc import refusals

#: What a refused call is told before the reason.
_REFUSED = "the orchestrator cannot persist its state, so it changes nothing now: "


class StoreHealth:
    """The groups whose last save failed, and why; watchers hear each change."""

    def __init__(self) -> None:
        #: group -> why its save failed (insertion order: the first is reported).
        self._failing: dict[str, str] = {}
        self._watchers: list[Callable[[str], None]] = []
        #: Why the state cannot be written ("" = it can): read on every call that would
        #: change a group, so it is kept, not computed.
        self.problem = ""

    def watch(self, on_change: Callable[[str], None]) -> None:
        """Call ``on_change(problem)`` when the store starts failing, and with "" when it
        works again."""
        self._watchers.append(on_change)

    def failed(self, group_id: str, why: str) -> None:
        """A save of ``group_id`` failed with ``why``; it is retried."""
        was = self.problem
        self._failing[group_id] = why
        self.problem = next(iter(self._failing.values()))
        if not was:
            self._tell(why)

    def saved(self, group_id: str) -> None:
        """``group_id`` saved again (or stopped trying: it stopped)."""
        if self._failing.pop(group_id, None) is not None:
            self.problem = next(iter(self._failing.values()), "")
            if not self._failing:
                self._tell("")

    def check(self) -> None:
        """Refuse (UNAVAILABLE, naming the reason) while the state cannot be written."""
        if self.problem:
            raise self.refusal()

    def refusal(self) -> refusals.Refused:
        """What a call that would change a group is told while the state cannot be written."""
        return refusals.Refused(refusals.Code.UNAVAILABLE, _REFUSED + self.problem)

    def _tell(self, problem: str) -> None:
        for on_change in self._watchers:
            on_change(problem)
