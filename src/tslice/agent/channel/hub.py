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
- Sessions are keyed by (job, group), as the agent's records are: one job may
  register one workload per group on a node (a sampler engine and a trainer
  process). A second registration of a (job, group) never replaces a live session,
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
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Literal, TypeVar

import grpc

from tslice.agent.channel import departures, registration, rules, sessions, stream
from tslice.agent.channel.rules import (
    WORKLOAD_LEFT,
    ChannelError,
    CommandRefusedError,
    CommandTimeoutError,
    Departure,
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


@dataclasses.dataclass(frozen=True)
class CommandOutcome:
    """A command the workload answered (``ok`` may be false)."""

    command_id: str
    ok: bool
    error: str
    device_bytes: int
    host_bytes: int
    #: Resolved snapshot mode (UNSPECIFIED for restore).
    mode: int
    #: Workload state after the result was applied.
    state: WorkloadState


@dataclasses.dataclass(frozen=True)
class ChannelEvent:
    """Passed to listeners when a workload registers, its session ends, or it has left.

    ``closed`` comes with every session end; ``left=True`` on it when the stream ended
    cleanly (the workload left at once). ``left`` comes later, once a lost session's
    grace ran out without a new registration.
    """

    kind: Literal["registered", "closed", "left"]
    job_id: str
    state: WorkloadState
    #: Why a session closed or the workload left (empty for registrations).
    reason: str = ""
    #: The group the session registered for ("" = none named).
    group: str = ""
    #: The workload has left: the agent no longer counts it as holding anything.
    left: bool = False


Listener = Callable[[ChannelEvent], None]


#: A session's key: (job_id, group), group "" when the registration named none.
SessionKey = departures.SessionKey


class ChannelHub:
    """Accepts workload streams and sends them commands (one session per (job, group))."""

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
        return sorted({job_id for job_id, _group in self._sessions})

    def known_sessions(self) -> list[SessionKey]:
        """(job_id, group) of every live workload session."""
        return sorted(self._sessions)

    def session_state(self, job_id: str, group: str = "") -> WorkloadState | None:
        """What the session serving (job, group) reports; ``None`` if none (or no single one)."""
        found = self._matching(job_id, group)
        return found[0].state() if len(found) == 1 else None

    def departure(self, job_id: str, group: str = "") -> Departure | None:
        """Why the workload that served (job, group) counts as gone; ``None`` while a live
        session serves it, while a lost one may still come back, or if none ever did."""
        key = self._gone_key(job_id, group)
        return self._gone.departure(key) if key is not None else None

    def lost_grace_left(self, job_id: str, group: str = "") -> float | None:
        """Seconds left for the lost session of (job, group) to register again; ``None``
        when no session of it is lost (live, gone, or never seen)."""
        key = self._gone_key(job_id, group)
        return self._gone.grace_left(key) if key is not None else None

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
    ) -> CommandOutcome:
        """Ask the workload of (job, group) to move its (tagged) state off the device, and
        wait for the answer.

        Raises NoWorkloadError / CommandRefusedError (nothing sent),
        WorkloadDisconnectedError or CommandTimeoutError (state unknown).
        """
        session = self._live(job_id, group)
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
        self, job_id: str, group: str = "", *, tags: Iterable[str] = (), timeout_s: float
    ) -> CommandOutcome:
        """Ask the workload of (job, group) to bring its (tagged) state back, and wait."""
        session = self._live(job_id, group)
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
        """The sessions (job, group) may mean (the rule of the module docstring): one, none,
        or, for a request without a group, every session of the job."""
        if group:
            session = self._sessions.get((job_id, group)) or self._sessions.get((job_id, ""))
            return [session] if session is not None else []
        return [s for (job, _group), s in sorted(self._sessions.items()) if job == job_id]

    def _live(self, job_id: str, group: str) -> sessions.Session:
        found = [s for s in self._matching(job_id, group) if not s.closed.is_set()]
        if len(found) > 1:
            groups = ", ".join(s.group or '""' for s in found)
            raise CommandRefusedError(
                f"job {job_id!r} has workloads registered for groups {groups} on this node; "
                "name the group"
            )
        if not found:
            raise NoWorkloadError(
                f"no workload channel registered for {describe(job_id, group)}; "
                "the workload must call tslice.workload.register_workload(agent, job_id, group, "
                "...) first"
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

    def _gone_key(self, job_id: str, group: str) -> SessionKey | None:
        """The lost or departed session (job, group) means when no live session serves it,
        by the lookup rule of the module docstring (the group's own, else the job's
        group-less one; no group: the job's group-less one, else its only one)."""
        if self._matching(job_id, group):
            return None

        known = self._gone.known
        if group:
            return next((k for k in ((job_id, group), (job_id, "")) if known(k)), None)
        if known((job_id, "")):
            return (job_id, "")
        found = self._gone.keys_of(job_id)
        return found.pop() if len(found) == 1 else None

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
