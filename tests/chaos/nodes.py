"""The one sim node of the focused chaos tests: 80 GiB of devices and 30 GiB states,
so two states fit and a third needs another to give way."""

from __future__ import annotations

from typing import Any

from tslice.sim.cluster import SimAgent

GiB = 1024**3


def two_states_fit(**faults: Any) -> SimAgent:
    """``node-1``, fast copies; ``faults`` as SimAgent takes them (fail_probability...)."""
    return SimAgent(
        name="node-1",
        capacity_bytes=80 * GiB,
        footprint_bytes=30 * GiB,
        bandwidth_bytes_per_s=1000 * 10**9,
        latency_s=0.001,
        **faults,
    )
