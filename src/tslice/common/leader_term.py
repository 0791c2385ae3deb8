"""The orchestrator leader's *term*, which fences agents against a deposed leader.

In Kubernetes HA mode several orchestrator replicas run and one leads, elected through a
Lease (``tslice.orchestrator.kube``); each election win starts a new, higher term. Every
directive the orchestrator sends an agent carries its term in the call's metadata under
:data:`METADATA_KEY`; an agent remembers the highest term it has seen and refuses
directives from an older one, so a partitioned old leader cannot move device state after
a new leader took over. Unlike a grant epoch, a term is never adopted from a refusal.
Term 0 means "not elected": the embedded (single-orchestrator) mode, which sends none.
"""

from __future__ import annotations

#: gRPC metadata key carrying the sender's leader term (decimal).
METADATA_KEY = "x-tslice-leader-term"


class Term:
    """The current leader term of this orchestrator process (0 until elected; only rises)."""

    def __init__(self, value: int = 0) -> None:
        self._value = value

    @property
    def value(self) -> int:
        return self._value

    def advance(self, value: int) -> None:
        """Enter term ``value``; a term never goes back."""
        if value < self._value:
            raise ValueError(f"leader term {value} is older than the current term {self._value}")
        self._value = value
