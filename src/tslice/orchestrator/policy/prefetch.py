"""Should the next waiter's state start coming in before the holder yields?

A pure decision for the group driver that runs prefetches: it asks
:meth:`tslice.orchestrator.group.state.LockState.prefetch_advice` (which fills in
what the lock knows) or :func:`should_prefetch` directly.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """The advice: bring ``job`` in now (``start``), and why (or why not)."""

    #: The waiter the group will switch to next ("" = nobody waits).
    job: str
    start: bool
    reason: str


def should_prefetch(
    *,
    switch_in_s: float,
    holder_left_s: float | None,
    free_bytes: int,
    footprint_bytes: int,
    reserve_bytes: int = 0,
) -> tuple[bool, str]:
    """Start bringing a waiter's state in now? ``(start, reason)``.

    ``switch_in_s``: the waiter's expected switch-in; ``holder_left_s``: how long the
    holder is expected to keep the group (None: unknown); ``free_bytes``: device memory
    free beside the holder on the tightest node; ``footprint_bytes``: the waiter's
    state; ``reserve_bytes``: what the holder may still allocate. Never at the cost of
    the holder's memory: the state must fit in what is free beyond the reserve. It
    starts just in time: once the holder's expected rest is no longer than the
    switch-in (so the state is in when the holder yields), or at once when the
    holder's turn length is not known yet.
    """
    if footprint_bytes <= 0:
        return False, "the waiter announced no footprint: cannot tell whether it fits"
    room = free_bytes - reserve_bytes
    if room < footprint_bytes:
        return False, f"does not fit beside the holder ({footprint_bytes} B needed, {room} B free)"
    if holder_left_s is None:
        return True, "fits beside the holder; the holder's turn length is not known yet"
    if holder_left_s > switch_in_s:
        return False, (
            f"too early: the holder is expected for {holder_left_s:.3g} s more, the "
            f"switch-in takes {switch_in_s:.3g} s"
        )
    return True, "fits beside the holder and the holder is expected to yield before it is in"
