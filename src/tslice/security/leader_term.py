"""The orchestrator leader's *term*, which fences agents against a deposed leader.

In Kubernetes HA mode several orchestrator replicas run and one leads, elected through a
Lease (``tslice.orchestrator.kube``); each election win starts a new, higher term. Every
call the orchestrator makes to an agent carries its term in the call's metadata under
:data:`METADATA_KEY`; an agent remembers the highest term it has seen (adopted from any
call, reads included, so that a new leader's first Status read fences the node) and
refuses *directives* (calls that move state) from an older one, so a partitioned old
leader cannot move device state after a new leader took over. Unlike a grant epoch, a
term is never adopted from a refusal: the refusal names the agent's term
(:func:`refusal`, read back by :func:`seen_in`) only so that the caller knows it was
deposed and steps down (:meth:`Term.deposed`).
Term 0 means "not elected": the embedded (single-orchestrator) mode, which sends none.

A term belongs to one leader: with its term a leader sends its identity (the replica's
name in the Lease) under :data:`LEADER_METADATA_KEY`, and an agent that has seen a term
from one identity refuses the same term's directives from another (an operator who
deletes or replaces the Lease must not let two replicas act under one number).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: gRPC metadata key carrying the sender's leader term (decimal).
METADATA_KEY = "x-tslice-leader-term"
#: gRPC metadata key carrying the sender's identity (the replica that won the term).
LEADER_METADATA_KEY = "x-tslice-leader-identity"
#: The highest term: a Lease counts its transitions in an int32 (``leaseTransitions``),
#: so no election can win above it. A call carrying more is refused (a term that high
#: would fence every leader out for ever).
MAX_TERM = 2**31 - 1

_SEEN = re.compile(r"\[leader term (\d{1,19})\]$")


class Term:
    """The current leader term of this orchestrator process (0 until elected; only rises).

    :meth:`deposed` is called when an agent refused a directive because it has seen a
    newer term; the listeners added with :meth:`on_deposed` (the HA mode steps down)
    are told the agent's term.
    """

    def __init__(self, value: int = 0, *, leader: str = "") -> None:
        self._value = value
        #: The identity this process leads as (HA mode's replica name; "" if none).
        self.leader = leader
        self._listeners: list[Callable[[int], None]] = []
        self._guard = threading.Lock()

    @property
    def value(self) -> int:
        return self._value

    def advance(self, value: int) -> None:
        """Enter term ``value``; a term never goes back, nor past :data:`MAX_TERM`."""
        if value < self._value:
            raise ValueError(f"leader term {value} is older than the current term {self._value}")
        if value > MAX_TERM:
            raise ValueError(f"leader term {value} is above the highest a Lease holds, {MAX_TERM}")
        self._value = value

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a call to an agent carries: the term (and the leader's identity, if it
        has one), or nothing in term 0."""
        if not self._value:
            return ()
        if not self.leader:
            return ((METADATA_KEY, str(self._value)),)
        return ((METADATA_KEY, str(self._value)), (LEADER_METADATA_KEY, self.leader))

    def on_deposed(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(newer_term)`` each time an agent refuses this term as deposed."""
        with self._guard:
            self._listeners.append(listener)

    def deposed(self, newer: int) -> None:
        """An agent has seen term ``newer``: this process no longer leads. The term itself
        is left as it is (never adopted from a refusal): only an election raises it."""
        with self._guard:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(newer)
            except Exception:  # the caller is an agent call's error path: never break it
                log.exception("a listener of leader term %d's deposition failed", self._value)


def parse(value: str) -> int:
    """The term a call's metadata names; ValueError (with the fix) if it is malformed."""
    if not value.isdigit() or len(value) > 19 or int(value) > MAX_TERM:
        raise ValueError(
            f"metadata {METADATA_KEY}={value[:40]!r} is not a leader term (a decimal number "
            f"from 0 to {MAX_TERM}, the most a Lease can count); only a tslice orchestrator "
            "should set it"
        )
    return int(value)


def refusal(sent: int, seen: int) -> str:
    """Why an agent that has seen term ``seen`` refuses a directive of term ``sent``
    (0: none sent), ending with the tag :func:`seen_in` reads."""
    if sent:
        why = (
            f"directive from leader term {sent}, but this agent has seen term {seen}: a newer "
            "orchestrator leader took over; this replica must step down"
        )
    else:
        why = (
            f"directive without a leader term, but this agent has seen term {seen} from an "
            "elected orchestrator leader (Kubernetes HA mode): an orchestrator without a term "
            "(embedded mode, or llm-d's) must not drive this node alongside it; point only "
            "the HA orchestrator at this agent, or, to hand the node back to a single "
            "orchestrator, clear its fence: tslice admin reset-term --agent <this agent> "
            "(the admin role), or with the agent stopped "
            "sqlite3 <state-dir>/agent.sqlite3 'DELETE FROM leader_term'"
        )
    return f"{why} [leader term {seen}]"


def parse_leader(value: str) -> str:
    """The leader identity a call's metadata names; ValueError (with the fix) if it is
    not a replica name (printable ASCII, at most 253 characters: a pod name)."""
    if not value or len(value) > 253 or not value.isascii() or not value.isprintable():
        raise ValueError(
            f"metadata {LEADER_METADATA_KEY}={value[:40]!r} is not an orchestrator replica "
            "name (1 to 253 printable ASCII characters); only a tslice orchestrator should set it"
        )
    return value


def second_leader_refusal(term: int, sent_leader: str, seen_leader: str) -> str:
    """Why an agent that has seen ``term`` from ``seen_leader`` refuses a directive of the
    same term from ``sent_leader``, ending with the tag :func:`seen_in` reads."""
    return (
        f"directive from leader term {term} of {sent_leader or 'a replica that names none'}, "
        f"but this agent has seen term {term} from {seen_leader or 'a replica that named none'}: "
        "two orchestrator replicas were elected in one term (the Lease was deleted or "
        "replaced by hand?); this replica must step down and campaign above it "
        f"[leader term {term}]"
    )


def seen_in(message: str) -> int | None:
    """The agent's term a :func:`refusal` names, or None (not a term refusal)."""
    found = _SEEN.search(message)
    return int(found.group(1)) if found else None
