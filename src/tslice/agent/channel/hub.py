"""Agent side of the workload channel: one live stream per registered (job, group).

An in-process workload (``tslice.workload.register_workload``) opens the
``WorkloadChannel`` bidirectional stream, registers its job, and from then on the
agent pushes ``AgentCommand``s (snapshot/restore) down the stream and the workload
answers each with a ``CommandResult`` carrying the same ``command_id``.

Interface used by the agent core (keep it stable)::

    hub = ChannelHub()                                   # one per agent, in app.py
    # servicer (grpc.aio needs an async generator *function* here: a plain ``def``
    # returning the generator is run as a sync iterator in a thread and fails):
    async def WorkloadChannel(self, request_iterator, context):
        async for command in hub.handle_stream(request_iterator, context):
            yield command
    # backend registry, name "app-channel" (the hub comes with the node's services):
    AppChannelBackend.create_on_node(settings, NodeServices(..., hub=hub, ...))
    # queries, by (job, group) (group "" = the job's only session, see below):
    #   hub.is_registered(job_id, group), hub.session_state(job_id, group),
    #   hub.departure(job_id, group), hub.lost_grace_left(job_id, group),
    #   hub.known_sessions(), hub.known_jobs(), hub.add_listener(callback),
    #   await hub.wait_registered(job_id, group, timeout=...),
    #   await hub.wait_settled(job_id, group, timeout=...)

Rules (WIRE.md "Workload channel rules", plus the tslice additions):

- The stream itself (:mod:`tslice.agent.channel.stream`): it opens with a valid
  ``register`` or ends with INVALID_ARGUMENT, and keepalive is for those who declare it.
- Who registers (:mod:`tslice.security.admission`): over the Unix socket the
  process is bound by its peer credentials (its instance token, bound through the
  register socket); over TCP the ``pid`` field is never trusted and, with
  authentication on, the job credential must allow the job.
- Sessions are keyed by (job, group, rank), as the agent's records are by (job,
  group): one job may register one workload per group on a node (a sampler engine
  and a trainer process), and one per rank of a group for a job with one process
  per GPU (``RegisterWorkload.rank``; 0 = the only one; the app-channel backend moves
  the ranks together, :mod:`tslice.agent.backends.app_channel_ranks`). A second
  registration of a (job, group, rank) never replaces a live session,
  nor a lost one within its grace: it is refused with ALREADY_EXISTS naming the
  live registration and the fix. Only the same workload (the same instance token,
  metadata ``tslice-workload-instance``; for workloads that send none, llm-d's, a
  lost session counts as theirs) may take its place: a new stream of a live session
  supersedes the old one (ABORTED, its in-flight commands fail at once), and a lost
  one comes back. Another group's session of the job is untouched.
- A lookup names (job, group) with the rule the agent core uses for its records:
  a group with no session of its own is served by the job's session registered
  without a group (llm-d's workloads register none), and a request without a group
  means the job's only session (refused, naming the groups, when it has several).
  A command for a group with several ranks names the rank (refused otherwise).
- Commands are sent at most once, with a UUID ``command_id`` and ``deadline_ms``;
  the hub fails a command at its deadline. Results are routed by id; a result for
  an id nobody waits for is dropped, except that a *late* success still updates
  what the hub believes the workload holds (so a reset reconciles to the truth).
- The snapshot mode is resolved (request, else the workload's default, else
  OFFLOAD) and checked against the declared modes, and tags against the declared
  tags, *before* anything is sent.
- The hub speaks only what the workload declared in ``RegisterWorkload.features``,
  never what it infers from the shape of replies: llm-d's workload library logs an
  error for every command it does not know, so a workload that declares nothing
  gets snapshot and restore commands and nothing else.
- State report (``features.reports_state``): ``suspended``/``resident_tags`` in the
  registration are the truth and the hub tracks residency from them
  (:meth:`ChannelHub.session_state`), which the app-channel backend uses to answer
  ``recover()``. Without it the hub knows only what its own commands did.
- Leaving (tslice's addition; the wire has no goodbye message, so the end of the
  stream is the signal): a workload whose stream *ends* (it half-closes:
  ``WorkloadHandle.close()``; or its process exits, and the stream ends with it) has
  left the node and taken its device state with it. The hub records a
  :class:`Departure` at once and the ``closed`` event says ``left=True``. A stream
  lost any other way (keepalive silence, a cancelled or broken stream, a protocol
  error) may belong to a live process: the hub waits ``lost_grace_s`` for the same
  (job, group) to register again, then records the departure and sends a ``left``
  event. A registration of the (job, group) clears its departure, or its pending
  loss (its state is then what the new registration reports). A superseded session and
  an agent shutting down leave nothing. (The bookkeeping: :mod:`tslice.agent.channel.departures`.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Literal, TypeVar

import grpc

from tslice.agent.channel import departures, registration, rules, sessions, stream
from tslice.agent.channel.rules import (
    WORKLOAD_LEFT,
    ChannelError,
    ChannelEvent,
    CommandOutcome,
    CommandRefusedError,
    CommandTimeoutError,
    Departure,
    Listener,
    NoWorkloadError,
    WorkloadDisconnectedError,
    WorkloadState,
    check_mode,
    check_tags,
    resolve_mode,
)
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import validation
from tslice.security import admission
from tslice.security.admission import describe

# The rules' public names are part of this module's interface (callers catch
# ``channel.CommandRefusedError``); they live in channel_rules to keep this module small.
__all__ = [
    "WORKLOAD_LEFT",
    "ChannelError",
    "ChannelEvent",
    "ChannelHub",
    "CommandOutcome",
    "CommandRefusedError",
    "CommandTimeoutError",
    "Departure",
    "Listener",
    "NoWorkloadError",
    "WorkloadDisconnectedError",
    "WorkloadState",
    "check_mode",
    "check_tags",
    "describe",
    "resolve_mode",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


#: A session's key: (job_id, group, rank), group "" when the registration named none.
SessionKey = departures.SessionKey


class ChannelHub:
    """Accepts workload streams and sends them commands (one session per (job, group,
    rank))."""

    def __init__(
        self,
        *,
        ping_interval_s: float = 5.0,
        missed_pings: int = 3,
        lost_grace_s: float = 5.0,
        processes: registration.ProcessRegistry | None = None,
        credentials: admission.JobCredentials | None = None,
    ) -> None:
        if ping_interval_s <= 0:
            raise ValueError("ping_interval_s must be > 0 (seconds between keepalive pings)")
        if missed_pings < 1:
            raise ValueError("missed_pings must be >= 1")
        self.ping_interval_s = ping_interval_s
        self.missed_pings = missed_pings
        #: How long a session lost without a clean end may take to register again before
        #: its workload counts as gone (read at each loss; >= 0).
        self.lost_grace_s = check_grace(lost_grace_s)
        #: Who may register (process bindings of the register socket, job credentials).
        self.admission = admission.Admission(processes=processes, credentials=credentials)
        self._sessions: dict[SessionKey, sessions.Session] = {}
        self._gone = departures.Departures(
            lambda session, reason: self._notify("left", session, reason, left=True)
        )
        self._closing = False
        self._listeners: list[Listener] = []
        self._changed: asyncio.Event | None = None
        #: Commands put on any stream since start (pings excluded), for tests and metrics.
        self.commands_sent = 0

    # ---- queries -------------------------------------------------------------------

    def is_registered(self, job_id: str, group: str = "") -> bool:
        """Whether a live session serves (job, group); with no group, any of the job's."""
        return bool(self._matching(job_id, group))

    def known_jobs(self) -> list[str]:
        """Job ids with a live workload session."""
        return sorted({key[0] for key in self._sessions})

    def known_sessions(self) -> list[tuple[str, str]]:
        """(job_id, group) of every live workload session (once for a job's several ranks)."""
        return sorted({key[:2] for key in self._sessions})

    def session_state(self, job_id: str, group: str = "") -> WorkloadState | None:
        """What the session serving (job, group) reports; ``None`` if none (or no single one:
        a job with several ranks answers through :meth:`rank_states`)."""
        found = self._matching(job_id, group)
        return found[0].state() if len(found) == 1 else None

    def rank_states(self, job_id: str, group: str = "") -> dict[int, WorkloadState]:
        """What each live rank serving (job, group) reports, by rank; empty if none, or
        if the sessions (job, group) may mean belong to several groups."""
        found = self._matching(job_id, group)
        if len({s.group for s in found}) != 1:
            return {}
        return {s.rank: s.state() for s in found}

    def departed_ranks(self, job_id: str, group: str = "") -> dict[int, Departure]:
        """The ranks of (job, group) that left and have not registered again, by rank."""
        resolved = self._resolved_group(job_id, group)
        if resolved is None:
            return {}
        live = {s.rank for s in self._of(job_id, resolved)}
        gone = {
            key[2]: self._gone.departure(key)
            for key in sorted(self._gone.ranks_of(job_id, resolved))
            if key[2] not in live
        }
        return {rank: d for rank, d in gone.items() if d is not None}

    def lost_ranks(self, job_id: str, group: str = "") -> dict[int, float]:
        """The ranks of (job, group) whose channel is lost and may still come back, with
        the seconds of grace each has left."""
        resolved = self._resolved_group(job_id, group)
        if resolved is None:
            return {}
        live = {s.rank for s in self._of(job_id, resolved)}
        left = {
            key[2]: self._gone.grace_left(key)
            for key in self._gone.ranks_of(job_id, resolved)
            if key[2] not in live
        }
        return {rank: s for rank, s in sorted(left.items()) if s is not None and s > 0}

    def departure(self, job_id: str, group: str = "") -> Departure | None:
        """Why the workload that served (job, group) counts as gone (every rank of it, the
        lowest rank's); ``None`` while a live session serves it, while a lost one may still
        come back, or if none ever did."""
        gone = [self._gone.departure(key) for key in self._gone_keys(job_id, group)]
        if not gone or any(d is None for d in gone):
            return None
        return gone[0]

    def lost_grace_left(self, job_id: str, group: str = "") -> float | None:
        """Seconds left for the lost sessions of (job, group) to register again (the
        longest); ``None`` when no session of it is lost (live, gone, or never seen)."""
        left = [self._gone.grace_left(key) for key in self._gone_keys(job_id, group)]
        found = [s for s in left if s is not None]
        return max(found) if found else None

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` on every registration and session end (on the loop)."""
        self._listeners.append(listener)

    async def wait_registered(
        self, job_id: str, group: str = "", *, timeout: float | None = None
    ) -> WorkloadState:
        """Wait until one live session serves (job, group); ``TimeoutError`` after ``timeout`` s."""
        return await self._wait(
            lambda: self.session_state(job_id, group), timeout, f"{_who(job_id, group)} registered"
        )

    async def wait_settled(
        self, job_id: str, group: str = "", *, timeout: float | None = None
    ) -> WorkloadState | Departure:
        """Wait until one live session serves (job, group) or its workload counts as gone."""

        def settled() -> WorkloadState | Departure | None:
            return self.session_state(job_id, group) or self.departure(job_id, group)

        return await self._wait(settled, timeout, f"{_who(job_id, group)} settled")

    async def wait_ranks_settled(
        self, job_id: str, group: str = "", *, timeout: float | None = None
    ) -> None:
        """Wait until no rank of (job, group) is lost within its grace (each rank is live
        again or counts as gone)."""

        def settled() -> bool | None:
            return True if not self.lost_ranks(job_id, group) else None

        await self._wait(settled, timeout, f"{_who(job_id, group)} ranks settled")

    async def wait_unregistered(
        self, job_id: str, group: str = "", *, timeout: float | None = None
    ) -> None:
        """Wait until no live session serves (job, group)."""

        def gone() -> bool | None:
            return True if not self._matching(job_id, group) else None

        await self._wait(gone, timeout, f"{_who(job_id, group)} disconnected")

    # ---- commands ------------------------------------------------------------------

    async def snapshot(
        self,
        job_id: str,
        group: str = "",
        *,
        mode: int = pb.SUSPEND_MODE_UNSPECIFIED,
        tags: Iterable[str] = (),
        timeout_s: float,
        rank: int | None = None,
    ) -> CommandOutcome:
        """Ask the workload of (job, group) (its ``rank``; ``None``: its only one) to move
        its (tagged) state off the device, and wait for the answer.

        Raises NoWorkloadError / CommandRefusedError (nothing sent),
        WorkloadDisconnectedError or CommandTimeoutError (state unknown).
        """
        session = self._live(job_id, group, rank)
        wanted = tuple(dict.fromkeys(tags))
        resolved = resolve_mode(session.state(), mode)
        check_mode(session.state(), resolved)
        check_tags(session.state(), wanted, kind="snapshot")
        command = pb.AgentCommand(
            snapshot=pb.SnapshotCommand(mode=pb.SuspendMode.Name(resolved), tags=wanted)
        )
        return await self._dispatch(
            session, command, kind="snapshot", tags=wanted, mode=resolved, timeout_s=timeout_s
        )

    async def restore(
        self,
        job_id: str,
        group: str = "",
        *,
        tags: Iterable[str] = (),
        timeout_s: float,
        rank: int | None = None,
    ) -> CommandOutcome:
        """Ask the workload of (job, group) (its ``rank``; ``None``: its only one) to bring
        its (tagged) state back, and wait."""
        session = self._live(job_id, group, rank)
        wanted = tuple(dict.fromkeys(tags))
        check_tags(session.state(), wanted, kind="restore")
        command = pb.AgentCommand(restore=pb.RestoreCommand(tags=wanted))
        return await self._dispatch(
            session,
            command,
            kind="restore",
            tags=wanted,
            mode=pb.SUSPEND_MODE_UNSPECIFIED,
            timeout_s=timeout_s,
        )

    async def _dispatch(
        self,
        session: sessions.Session,
        command: pb.AgentCommand,
        *,
        kind: str,
        tags: tuple[str, ...],
        mode: int,
        timeout_s: float,
    ) -> CommandOutcome:
        answer = stream.send(session, command, kind=kind, tags=tags, timeout_s=timeout_s)
        self.commands_sent += 1
        result = await stream.answered(session, command, answer, kind=kind, timeout_s=timeout_s)
        return CommandOutcome(
            command_id=command.command_id,
            ok=result.ok,
            # The workload's own words: kept, but never longer than a message may be.
            error=validation.bounded(result.error),
            device_bytes=result.device_bytes,
            host_bytes=result.host_bytes,
            mode=mode,
            state=session.state(),
        )

    async def close(self) -> None:
        """End every session (agent shutdown); workloads reconnect to the next agent.

        Nothing departs: the workloads did not leave, the agent did.
        """
        self._closing = True
        for session in list(self._sessions.values()):
            self._end(session, grpc.StatusCode.UNAVAILABLE, "the agent is shutting down")
        self._gone.forget_losses()

    # ---- the stream ----------------------------------------------------------------

    def handle_stream(
        self,
        request_iterator: AsyncIterator[pb.WorkloadMessage],
        context: stream.Context,
    ) -> AsyncIterator[pb.AgentCommand]:
        """Serve one ``WorkloadChannel`` call (an async generator of commands, run by
        :mod:`tslice.agent.channel.stream`; the hub keeps the sessions)."""
        owner = stream.Owner(
            admission=self.admission,
            conflict=self._conflict,
            admit=self._admit,
            end=self._end,
            ping_interval_s=self.ping_interval_s,
            missed_pings=self.missed_pings,
        )
        return stream.serve(request_iterator, context, owner)

    def _admit(self, session: sessions.Session) -> None:
        """Take an accepted session: it supersedes a live one of the same workload."""
        previous = self._sessions.get(session.key)
        came_back = self._gone.returned(session.key)
        if previous is not None:
            self._end(
                previous,
                grpc.StatusCode.ABORTED,
                f"superseded by a new stream of the same workload of {session.label}",
            )
        self._sessions[session.key] = session
        log.info(
            "workload registered",
            extra={
                "job_id": session.job_id,
                "group": session.group,
                "rank": session.rank,
                "pid": session.pid,
                "claimed_pid": session.claimed_pid,
                "modes": [pb.SuspendMode.Name(m) for m in session.supported_modes],
                "tags": list(session.tags),
                "residency": session.tracker.residency,
                "resident_tags": list(session.tracker.resident_tags),
                "superseded": previous is not None,
                "came_back": came_back,
            },
        )
        self._notify("registered", session)

    # ---- helpers -------------------------------------------------------------------

    def _matching(self, job_id: str, group: str) -> list[sessions.Session]:
        """The sessions (job, group) may mean (the rule of the module docstring): the
        ranks of one group, none, or, for a request without a group, every session of the
        job."""
        if group:
            return self._of(job_id, group) or self._of(job_id, "")
        return [s for key, s in sorted(self._sessions.items()) if key[0] == job_id]

    def _of(self, job_id: str, group: str) -> list[sessions.Session]:
        """The live sessions of exactly (job, group), by rank."""
        return [s for key, s in sorted(self._sessions.items()) if key[:2] == (job_id, group)]

    def _resolved_group(self, job_id: str, group: str) -> str | None:
        """The one group whose sessions (job, group) means, live or gone; None if none."""
        groups = {s.group for s in self._matching(job_id, group)}
        if not groups:
            groups = {key[1] for key in self._gone_keys(job_id, group)}
        return groups.pop() if len(groups) == 1 else None

    def _live(self, job_id: str, group: str, rank: int | None = None) -> sessions.Session:
        found = [s for s in self._matching(job_id, group) if not s.closed.is_set()]
        groups = sorted({s.group or '""' for s in found})
        if len(groups) > 1:
            raise CommandRefusedError(
                f"job {job_id!r} has workloads registered for groups {', '.join(groups)} on "
                "this node; name the group"
            )
        if rank is not None:
            found = [s for s in found if s.rank == rank]
        if len(found) > 1:
            ranks = ", ".join(str(s.rank) for s in found)
            raise CommandRefusedError(
                f"{describe(job_id, group)} has workloads registered for ranks {ranks} on "
                "this node; name the rank"
            )
        if not found:
            who = rules.label(job_id, group, rank or 0)
            raise NoWorkloadError(
                f"no workload channel registered for {who}; the workload must call "
                "tslice.workload.register_workload(agent, job_id, group, ...) first"
            )
        return found[0]

    def _end(self, session: sessions.Session, code: grpc.StatusCode, reason: str) -> None:
        if not session.close(code, reason):
            return
        current = self._sessions.get(session.key) is session
        if current:
            del self._sessions[session.key]
        level = (
            logging.INFO
            if code in (grpc.StatusCode.OK, grpc.StatusCode.ABORTED)
            else logging.WARNING
        )
        # A replaced session's successor holds the (job, group); a shutdown leaves nothing.
        leaves = current and not self._closing and code != grpc.StatusCode.ABORTED
        left = leaves and code == grpc.StatusCode.OK
        if left:
            self._gone.depart(session, reason, clean=True)
        elif leaves:
            self._gone.lose(session, reason, self.lost_grace_s)
        log.log(
            level,
            "workload session closed",
            extra={
                "job_id": session.job_id,
                "group_id": session.group,
                "rank": session.rank,
                "reason": reason,
                "left": left,
                "grace_s": self.lost_grace_s if leaves and not left else None,
            },
        )
        self._notify("closed", session, reason, left=left)

    def _conflict(self, key: SessionKey, instance: str) -> str:
        """Why a registration of ``key`` by ``instance`` is refused ('' = accepted): another
        workload's session is live, or lost and still within its grace."""
        live = self._sessions.get(key)
        if live is not None:
            if instance and live.instance == instance:
                return ""
            return rules.already_registered(live.state())
        return self._gone.lost_conflict(key, instance)

    def _gone_keys(self, job_id: str, group: str) -> list[SessionKey]:
        """The lost or departed sessions (every rank) (job, group) means when no live
        session serves it, by the lookup rule of the module docstring (the group's own,
        else the job's group-less one; no group: the job's group-less one, else its only
        group's)."""
        if self._matching(job_id, group):
            return []
        for candidate in (group, "") if group else ("",):
            found = self._gone.ranks_of(job_id, candidate)
            if found:
                return sorted(found)
        if group:
            return []
        found = self._gone.keys_of(job_id)
        return sorted(found) if len({key[1] for key in found}) == 1 else []

    def _notify(
        self,
        kind: Literal["registered", "closed", "left"],
        session: sessions.Session,
        reason: str = "",
        *,
        left: bool = False,
    ) -> None:
        event = ChannelEvent(
            kind=kind,
            job_id=session.job_id,
            group=session.group,
            state=session.state(),
            reason=reason,
            left=left,
            rank=session.rank,
        )
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("workload channel listener failed", extra={"job_id": event.job_id})

    async def _wait(self, probe: Callable[[], _T | None], timeout: float | None, what: str) -> _T:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            value = probe()
            if value is not None:
                return value
            if self._changed is None:
                self._changed = asyncio.Event()
            changed = self._changed
            # wait_for with a timeout of 0 times out at once unless the event is set.
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"timed out after {timeout:g} s waiting for workload {what}"
                ) from None


def check_grace(value: float) -> float:
    """``lost_grace_s`` checked: a number of seconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"lost_grace_s must be a number of seconds >= 0 (how long a lost workload channel "
            f"may take to register again), got {value!r}"
        )
    return float(value)


def _who(job_id: str, group: str) -> str:
    return f"{job_id} (group {group})" if group else job_id
