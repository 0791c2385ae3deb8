"""One accepted workload stream, as the agent's hub sees it: what the workload declared,
what it holds, and the commands in flight on it.

Lives on the event loop; not thread-safe. The hub (:mod:`tslice.agent.channel`)
accepts streams, creates a :class:`Session` per registration and routes results to
it; the session tracks residency from the registration's report (when the workload
declared ``reports_state``) and from every command that succeeded, including a late
success after the command timed out.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Iterable

import grpc

from tslice.agent.channel import rules
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import residency

#: Timed-out command ids remembered per session, so a late success still updates residency.
EXPIRED_KEPT = 64


@dataclasses.dataclass(frozen=True)
class Close:
    code: grpc.StatusCode
    details: str


@dataclasses.dataclass(frozen=True)
class Probe:
    """The workload's requests ended: the hub's writer finds out whether it half-closed
    (a write still goes through) or is gone (the write fails)."""


@dataclasses.dataclass
class Pending:
    kind: str
    tags: tuple[str, ...]
    future: asyncio.Future[pb.CommandResult] | None


class Session:
    """One accepted stream. Lives on the event loop; not thread-safe."""

    def __init__(self, register: pb.RegisterWorkload, *, instance: str = "", pid: int = 0) -> None:
        caps = register.capabilities
        self.job_id = register.job_id
        self.group = register.group
        #: Which of the job's processes on this node (0 = the job's only one).
        self.rank = register.rank
        #: The hub's key: one session per (job, group, rank).
        self.key = (register.job_id, register.group, register.rank)
        #: How messages name the session's job, group and rank.
        self.label = rules.label(self.job_id, self.group, self.rank)
        #: The registering process as the agent knows it (bound through its register
        #: socket); 0 = not known. The registration's own ``pid`` field is never trusted.
        self.pid = pid
        self.claimed_pid = register.pid
        #: The workload's instance token ("" = none sent): the same workload coming back.
        self.instance = instance
        self.supported_modes = tuple(dict.fromkeys(caps.supported_modes))
        self.default_mode = caps.default_mode
        self.tags = tuple(dict.fromkeys(caps.tags))
        self.state_reported = register.features.reports_state
        resident: Iterable[str] | None = None
        if self.state_reported and (register.suspended or register.resident_tags):
            resident = register.resident_tags
        self.tracker = residency.ResidencyTracker(
            declared=self.tags, suspended=register.suspended, resident=resident
        )
        self.registered_at = time.time()
        self.outbox: asyncio.Queue[pb.AgentCommand | Close | Probe] = asyncio.Queue()
        self.pending: dict[str, Pending] = {}
        self.expired: collections.OrderedDict[str, Pending] = collections.OrderedDict()
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.keepalive = register.features.keepalive
        self.last_heard = asyncio.get_running_loop().time()
        self.pings_sent = 0
        self.pongs_received = 0
        self.commands_sent = 0

    def state(self) -> rules.WorkloadState:
        return rules.WorkloadState(
            job_id=self.job_id,
            group=self.group,
            pid=self.pid,
            supported_modes=self.supported_modes,
            default_mode=self.default_mode,
            tags=self.tags,
            state_reported=self.state_reported,
            suspended=self.tracker.suspended,
            resident_tags=self.tracker.resident_tags,
            missing_tags=self.tracker.missing_tags,
            residency=self.tracker.residency,
            keepalive=self.keepalive,
            registered_at=self.registered_at,
            rank=self.rank,
        )

    def heard(self) -> None:
        self.last_heard = asyncio.get_running_loop().time()

    def send(self, command: pb.AgentCommand) -> None:
        if self.closed.is_set():
            raise rules.WorkloadDisconnectedError(
                f"the workload of {self.label} disconnected ({self.close_reason})"
            )
        self.outbox.put_nowait(command)

    def ping(self) -> None:
        self.pings_sent += 1
        self.send(pb.AgentCommand(ping=pb.Ping(nonce=self.pings_sent)))

    def apply(self, pending: Pending, result: pb.CommandResult) -> None:
        if not result.ok:
            return
        # Once a command succeeded the hub knows what the workload holds.
        self.state_reported = True
        if pending.kind == "snapshot":
            self.tracker.snapshot_done(pending.tags)
        else:
            self.tracker.restore_done(pending.tags)

    def expire(self, command_id: str) -> None:
        pending = self.pending.pop(command_id, None)
        if pending is None:
            return
        pending.future = None
        self.expired[command_id] = pending
        while len(self.expired) > EXPIRED_KEPT:
            self.expired.popitem(last=False)

    def close(self, code: grpc.StatusCode, reason: str) -> bool:
        """End the session; False if it was already closed."""
        if self.closed.is_set():
            return False
        self.closed.set()
        self.close_reason = reason
        for command_id, pending in self.pending.items():
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(
                    rules.WorkloadDisconnectedError(
                        f"the workload of {self.label} disconnected before answering "
                        f"{pending.kind} command {command_id} ({reason})"
                    )
                )
        self.pending.clear()
        self.outbox.put_nowait(Close(code, reason))
        return True
