"""What a group's worker executes: commands posted to its inbox, and their effects.

A *command* runs in the group's worker with the time of its batch; it may change the
group's state (the lock and the driver's bookkeeping) and returns *effects*, which run
only after the new state has been persisted ("write before act"). Everything that
changes a group goes through its inbox, from RPCs, switches, timers and the device
arbiter alike, so the group's changes are serialised without a lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

Effect = Callable[[], None]
Command = Callable[[float], list[Effect]]


class Urgent:
    """An effect on the hand-over path (resolve an Acquire, start a switch): it runs first."""

    def __init__(self, fn: Effect) -> None:
        self._fn = fn

    def __call__(self) -> None:
        self._fn()


def change(fn: Callable[[], object]) -> Command:
    """A command that only changes state (it has no effects)."""

    def command(now: float) -> list[Effect]:
        fn()
        return []

    return command


def resolve(future: asyncio.Future[_T], value: _T) -> None:
    if not future.done():
        future.set_result(value)
