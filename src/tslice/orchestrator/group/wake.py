"""The lock's wake-up: a policy may keep an idle group for its yielded resident.

The cost-aware policy keeps a group idle for its resident when the resident's gaps are
shorter than the next waiter's switch-in (``tslice.orchestrator.policy``). The pure lock
has no clock, so it says until when (``GroupLock.wake_at``) and its driver wakes it then:
:class:`Wake` keeps one timer, re-armed whenever the group's state settles, which posts
``on_expire`` to the group's inbox (the lock then promotes the waiter unless the resident
came back). A lock whose driver never wakes it never keeps a group idle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Wake:
    """One timer that calls ``wake`` at the time last armed (re-arming moves it)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._armed: tuple[float, asyncio.TimerHandle] | None = None

    def arm(self, at: float | None) -> None:
        """Wake at ``at`` (``time.monotonic()``, the lock's clock), or not at all (None)."""
        if self._armed is not None and self._armed[0] == at:
            return
        self.cancel()
        if at is None:
            return
        loop = asyncio.get_running_loop()
        self._armed = (at, loop.call_later(max(0.0, at - time.monotonic()), self._fire))

    def cancel(self) -> None:
        if self._armed is not None:
            self._armed[1].cancel()
            self._armed = None

    def _fire(self) -> None:
        self._armed = None
        self._wake()
