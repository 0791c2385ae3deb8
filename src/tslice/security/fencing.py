"""An agent's fence against a deposed orchestrator leader (see ``tslice.security.leader_term``).

Every call may carry the caller's leader term in its metadata. The highest term seen is
adopted from any call (a new leader's first Status read fences the node) and stored
before the call goes on, so that it survives a SIGKILL; a *directive* (a call that moves
state, or waits on a move: Snapshot, Restore, Grant, GrantStream, ResetJob,
WaitOperation) from an older term is refused with FAILED_PRECONDITION before anything
is looked at, so a partitioned old leader moves nothing once a new one reached the node.
With authentication on, a read raises the term only when the orchestrator makes it
(directives need that role anyway): another caller cannot fence the leader out.

A directive with no term (embedded mode, llm-d's orchestrator) is let through while the
agent has seen none; once it has, it is refused too unless ``accept_unfenced`` (only an
orchestrator that was never elected sends none, and it must not drive a node alongside
the HA leader; docs/security.md weighs this against sharing agents with llm-d's
orchestrator). A term is adopted only from the caller's own metadata, never from what a
refusal says.

The term is kept where the agent keeps its state, a :class:`TermStore` it passes in (the
agent's ``tslice.agent.state.store.Store``): this package imports nothing of the agent.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from tslice.rpc import refusals
from tslice.security import leader_term

log = logging.getLogger(__name__)


class Sent(NamedTuple):
    """What a call's metadata says of its sender's leadership."""

    term: int
    leader: str = ""


def sent_term(metadata: Iterable[Any] | None) -> int:
    """The term a call's metadata carries (0: none); INVALID_ARGUMENT if malformed."""
    return sent(metadata).term


def sent(metadata: Iterable[Any] | None) -> Sent:
    """The term and leader identity a call's metadata carries (0 and "": none);
    INVALID_ARGUMENT if either is malformed."""
    term, leader = 0, ""
    for key, value in metadata or ():
        if key not in (leader_term.METADATA_KEY, leader_term.LEADER_METADATA_KEY):
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
        try:
            if key == leader_term.METADATA_KEY:
                term = leader_term.parse(text)
            else:
                leader = leader_term.parse_leader(text)
        except ValueError as err:
            raise refusals.Refused(refusals.Code.INVALID_ARGUMENT, str(err)) from None
    return Sent(term, leader)


class TermStore(Protocol):
    """Where an agent keeps the highest leader term it has seen, and who sent it."""

    #: The file it is kept in (named in the refusal when it cannot be written).
    path: Path

    def put_leader_term(self, term: int, leader: str) -> None:
        """Keep ``term`` and ``leader``, synchronously: on disk when it returns. Raises
        OSError or ``sqlite3.Error`` when it cannot."""
        ...

    async def leader_term(self) -> tuple[int, str]:
        """The term and leader kept (0 and "": none)."""
        ...


class TermFence:
    """The highest leader term this agent has seen, and the check of each call against it."""

    def __init__(
        self,
        state: TermStore | None,
        *,
        seen: int = 0,
        leader: str = "",
        accept_unfenced: bool = False,
    ) -> None:
        #: Where the term is kept; None: in memory only (tests of the servicer alone).
        self._state = state
        self._seen = seen
        #: The identity that sent the term seen ("": none named it yet).
        self._leader = leader
        self.accept_unfenced = accept_unfenced
        #: The term and leader seen, as a call sends them: a call that sends exactly these
        #: is admitted whatever it is (a stream's grants compare it before asking :meth:`admit`).
        self.current = Sent(seen, leader)

    @classmethod
    async def open(cls, state: TermStore, *, accept_unfenced: bool = False) -> TermFence:
        """The fence with the term ``state`` recorded."""
        term, leader = await state.leader_term()
        return cls(state, seen=term, leader=leader, accept_unfenced=accept_unfenced)

    @property
    def seen(self) -> int:
        return self._seen

    @property
    def leader(self) -> str:
        return self._leader

    def admit(self, term: int, *, directive: bool, adopt: bool = True, leader: str = "") -> None:
        """Let a call of ``term`` (0: none sent) from ``leader`` through, adopting a newer
        term first (unless not ``adopt``: a read by a caller that is not the
        orchestrator); raise ``refusals.Refused`` for a directive of an older term, or of
        the same term from another leader."""
        if term > self._seen or (term and term == self._seen and leader and not self._leader):
            if adopt or directive:
                self._adopt(term, leader, directive=directive)
        elif directive and term and term == self._seen and leader != self._leader:
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                leader_term.second_leader_refusal(term, leader, self._leader),
            )
        elif directive and term < self._seen and (term or not self.accept_unfenced):
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION, leader_term.refusal(term, self._seen)
            )

    def reset(self, term: int, *, by: str) -> tuple[int, str]:
        """An administrator (``by``) sets the term, with no leader named (0: none, the node
        takes directives without a term again); the term and leader it replaces."""
        if not 0 <= term <= leader_term.MAX_TERM:
            raise refusals.Refused(
                refusals.Code.INVALID_ARGUMENT,
                f"term {term} is not a leader term (0 to {leader_term.MAX_TERM}); give 0 to "
                "hand the node to an orchestrator without a term",
            )
        before = (self._seen, self._leader)
        if self._state is not None:
            try:
                self._state.put_leader_term(term, "")
            except (sqlite3.Error, OSError) as err:
                raise refusals.Refused(
                    refusals.Code.UNAVAILABLE,
                    f"this agent cannot record leader term {term} in {self._state.path} "
                    f"({err}); nothing was changed: fix the agent's state disk, then retry",
                ) from err
        self._seen, self._leader = term, ""
        self.current = Sent(term, "")
        log.warning(
            "leader term reset by %s: %d (of %s) -> %d; %s",
            by,
            before[0],
            before[1] or "no leader named",
            term,
            "directives without a term are taken again" if not term else "newer terms fence it",
        )
        return before

    def _adopt(self, term: int, leader: str, *, directive: bool) -> None:
        if self._state is not None:
            try:
                # Synchronous, as every store write: on disk before the call goes on.
                self._state.put_leader_term(term, leader)
            except (sqlite3.Error, OSError) as err:
                if not directive:
                    log.warning("leader term %d not recorded: %s", term, err)
                    return
                raise refusals.Refused(
                    refusals.Code.UNAVAILABLE,
                    f"this agent cannot record leader term {term} in {self._state.path} ({err}); "
                    "nothing was done: fix the agent's state disk, then retry",
                ) from err
        log.info(
            "leader term %d of %s seen (was %d): older terms are fenced",
            term,
            leader or "an unnamed leader",
            self._seen,
        )
        self._seen, self._leader = term, leader
        self.current = Sent(term, leader)
