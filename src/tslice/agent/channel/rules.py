"""The workload channel's rules, as pure functions: what a registration and a command must be.

WIRE.md "Workload channel rules" plus tslice's additions, kept apart from the stream
handling in :mod:`tslice.agent.channel` (which re-exports the public names) so that
they can be read, and tested, without a stream: the snapshot mode on the wire is
resolved (request, else the workload's default, else OFFLOAD) and checked against
the declared modes, tags against the declared tags, and a registration is refused
with a message that says what to fix.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Literal

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import validation
from tslice.security import admission

VALID_MODES = (pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD)

#: The key, in an operation's backend state and in the job's record, that says the
#: job's workload left the node (the value: why). The agent's rules read it
#: (``tslice.agent.jobs.rules``): a snapshot that reports it leaves the job IDLE, not SAVED.
WORKLOAD_LEFT = "workload_left"

#: gRPC metadata key of the workload's instance token: random, made once per workload
#: (``WorkloadHandle``) and sent on every stream it opens, so that the hub tells the same
#: workload coming back from another one (and, once bound through the agent's register
#: socket, its process). llm-d's library sends none.
INSTANCE_METADATA = "tslice-workload-instance"


class ChannelError(Exception):
    """A command could not be completed over the workload channel."""


class NoWorkloadError(ChannelError):
    """No workload is registered for the job; nothing was sent."""


class CommandRefusedError(ChannelError):
    """The command does not fit what the workload declared; nothing was sent."""


class WorkloadDisconnectedError(ChannelError):
    """The stream ended (or was replaced) before the workload answered."""


class CommandTimeoutError(ChannelError):
    """The workload did not answer within the command's deadline."""


@dataclasses.dataclass(frozen=True)
class Departure:
    """A workload the agent no longer counts as holding anything: it left the node.

    A workload leaves when its stream ends cleanly (it closed its channel, or its process
    exited and the stream ended with it: a process's device memory is freed when it
    exits), or when a channel lost without a clean end (a keepalive drop, a cancelled or
    broken stream) is not registered again within the hub's grace period.
    """

    job_id: str
    group: str
    #: Why the agent counts the workload as gone (for messages and logs).
    reason: str
    #: True for a clean end of the stream; False when the grace after a loss ran out.
    clean: bool
    #: Wall-clock time the workload was counted as gone.
    at: float
    #: Which of the job's processes (``RegisterWorkload.rank``; 0 = the only one).
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class WorkloadState:
    """What the hub knows about one registered workload."""

    job_id: str
    group: str
    pid: int
    supported_modes: tuple[int, ...]
    default_mode: int
    #: Tags the workload declared; empty = all-or-nothing.
    tags: tuple[str, ...]
    #: True when the hub knows what the workload holds: it declared ``reports_state``
    #: (tslice clients do; llm-d's do not), or a command of this session succeeded.
    state_reported: bool
    suspended: bool
    resident_tags: tuple[str, ...]
    missing_tags: tuple[str, ...]
    #: ``residency.FULL`` / ``PARTIAL`` / ``NONE``.
    residency: str
    #: The workload declared keepalive: it is pinged and closed after missed pings.
    keepalive: bool
    #: Wall-clock time of the registration.
    registered_at: float
    #: Which of the job's processes on this node (``RegisterWorkload.rank``; 0 = the
    #: job's only one).
    rank: int = 0


def resolve_mode(state: WorkloadState, mode: int) -> int:
    """The snapshot mode on the wire: the request's, else the workload's default, else OFFLOAD."""
    if mode != pb.SUSPEND_MODE_UNSPECIFIED:
        return mode
    if state.default_mode != pb.SUSPEND_MODE_UNSPECIFIED:
        return state.default_mode
    return pb.SUSPEND_MODE_OFFLOAD


def check_mode(state: WorkloadState, mode: int) -> None:
    """Raise CommandRefusedError unless the workload declared ``mode`` (or declared none)."""
    if mode not in VALID_MODES:
        raise CommandRefusedError(f"suspend mode {mode_name(mode)} is not a valid SuspendMode")
    if state.supported_modes and mode not in state.supported_modes:
        raise CommandRefusedError(
            f"workload {state.job_id!r} does not support suspend mode {mode_name(mode)}; "
            f"it declared {[mode_name(m) for m in state.supported_modes]}"
        )


def check_tags(state: WorkloadState, tags: Iterable[str], *, kind: str) -> None:
    """Raise CommandRefusedError unless every tag is declared (when the workload declared any)."""
    wanted = list(tags)
    if any(not tag for tag in wanted):
        raise CommandRefusedError(
            f"{kind} tags must be non-empty strings, got {validation.shown_list(wanted)}"
        )
    if not state.tags:
        return
    unknown = [tag for tag in wanted if tag not in state.tags]
    if unknown:
        raise CommandRefusedError(
            f"workload {state.job_id!r} declared tags {validation.shown_list(state.tags)}; "
            f"{kind} of unknown tags {validation.shown_list(unknown)} refused"
        )


#: The highest rank a workload may register (one process per device; generous).
MAX_RANK = 4095


def label(job_id: str, group: str, rank: int = 0) -> str:
    """How messages name one workload: its job, its group if named, its rank if not 0."""
    who = admission.describe(job_id, group)
    return f"{who} rank {rank}" if rank else who


def registration_problem(register: pb.RegisterWorkload) -> str:
    """Why a registration is refused, or '' if it is acceptable."""
    try:
        validation.check_id("job_id", register.job_id)
        if register.group:
            validation.check_id("group", register.group)
    except validation.InvalidIdError as exc:
        return f"invalid RegisterWorkload: {exc}"
    try:
        validation.check_message(register)
    except validation.InvalidInput as exc:
        return f"invalid RegisterWorkload for job {register.job_id!r}: {exc}"
    if not 0 <= register.rank <= MAX_RANK:
        return (
            f"invalid RegisterWorkload for job {register.job_id!r}: rank must be between 0 "
            f"and {MAX_RANK} (which of the job's processes on this node), got {register.rank}"
        )
    caps = register.capabilities
    for mode in caps.supported_modes:
        if mode not in VALID_MODES:
            return (
                f"invalid RegisterWorkload for job {register.job_id!r}: supported_modes "
                f"contains {mode_name(mode)}; declare SUSPEND_MODE_OFFLOAD and/or "
                "SUSPEND_MODE_DISCARD"
            )
    if caps.default_mode != pb.SUSPEND_MODE_UNSPECIFIED:
        if caps.default_mode not in VALID_MODES:
            return (
                f"invalid RegisterWorkload for job {register.job_id!r}: default_mode "
                f"{mode_name(caps.default_mode)} is not a suspend mode"
            )
        if caps.supported_modes and caps.default_mode not in caps.supported_modes:
            return (
                f"invalid RegisterWorkload for job {register.job_id!r}: default_mode "
                f"{mode_name(caps.default_mode)} is not among supported_modes "
                f"{[mode_name(m) for m in caps.supported_modes]}"
            )
    if any(not tag for tag in caps.tags):
        return f"invalid RegisterWorkload for job {register.job_id!r}: a tag is empty"
    if caps.tags:
        stray = [tag for tag in register.resident_tags if tag not in caps.tags]
        if stray:
            return (
                f"invalid RegisterWorkload for job {register.job_id!r}: resident_tags "
                f"{validation.shown_list(stray)} are not among the declared tags "
                f"{validation.shown_list(caps.tags)}"
            )
    if not register.features.reports_state and (register.suspended or register.resident_tags):
        return (
            f"invalid RegisterWorkload for job {register.job_id!r}: suspended/resident_tags "
            "are given but features.reports_state is not set; set it if they are the truth, "
            "or leave them out"
        )
    if register.pid < 0:
        return f"invalid RegisterWorkload for job {register.job_id!r}: pid {register.pid} < 0"
    return ""


def instance_problem(instance: str) -> str:
    """Why an instance token is refused, or '' (empty = none sent: llm-d's library)."""
    if not instance:
        return ""
    try:
        validation.check_id(INSTANCE_METADATA, instance)
    except validation.InvalidIdError as exc:
        return f"invalid workload channel metadata: {exc}"
    return ""


def already_registered(
    state: WorkloadState, *, lost_for_s: float | None = None, grace_left_s: float = 0.0
) -> str:
    """The refusal of a second registration while ``state``'s workload is live or may still
    come back (``lost_for_s``: seconds since its channel was lost)."""
    who = label(state.job_id, state.group, state.rank)
    since = time.strftime("%H:%M:%S", time.localtime(state.registered_at))
    process = f"process {state.pid}" if state.pid else "a process the agent cannot name"
    if lost_for_s is None:
        return (
            f"{who} already has a live workload registration ({process}, registered at "
            f"{since}); a second registration never replaces it. Close the first "
            "(WorkloadHandle.close(), or end its process); a workload whose channel is "
            "lost may be replaced once lost_grace_s has passed"
        )
    return (
        f"{who} lost its workload channel {lost_for_s:.1f} s ago ({process}, registered "
        f"at {since}) and may still come back: only that workload (its instance token) "
        f"may register now; another registration is accepted in {grace_left_s:.1f} s, "
        "once its lost_grace_s has passed"
    )


def mode_name(mode: int) -> str:
    try:
        return pb.SuspendMode.Name(mode)
    except ValueError:
        return str(mode)


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
    #: Which of the job's processes the session is (0 = the job's only one).
    rank: int = 0


Listener = Callable[[ChannelEvent], None]
