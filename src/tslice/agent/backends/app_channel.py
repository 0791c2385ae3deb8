"""The ``app-channel`` backend: the workload moves its own state when told over its channel.

The agent builds it with :meth:`AppChannelBackend.create_on_node`, which takes the
agent's :class:`tslice.agent.channel.ChannelHub` from the node's services. Snapshot and
restore become one command each on the job's workload stream; the workload's
in-process adapter (PyTorch, vLLM, SGLang, callbacks) does the copying and reports
the bytes it moved.

Partial residency: the workload may declare tags (``weights``, ``kv_cache``...) and
a request may name some of them, so a job can be *partly* resident (weights back,
KV cache not yet). Every result carries ``OpResult.state`` with::

    {"residency": "full" | "partial" | "none",
     "resident_tags": [...], "missing_tags": [...], "suspended": bool}

and the agent's state machine uses ``residency`` to decide: after a snapshot,
``partial`` keeps the job RUNNING (it still holds device memory), ``none`` makes it
SAVED; a Restore of a RUNNING job whose recorded residency is ``partial`` must be
sent here rather than short-circuited.

A workload that left (its stream ended cleanly, or a lost channel was not registered
again within ``lost_grace_s``, see :class:`tslice.agent.channel.Departure`) took its
device state with it: a snapshot of it completes at once, moving nothing, and a
restore is refused (:class:`WorkloadLeftError`: it must register again). A snapshot
or restore of a workload whose channel is lost waits for it at most the rest of the
grace; one whose stream ends while it waits for the answer is settled the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from tslice.agent import channel
from tslice.agent.backends import app_channel_ranks as ranks
from tslice.agent.backends import base, services
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import errors, residency

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

_SETTINGS = ("command_timeout_s", "register_wait_s", "recover_wait_s", "lost_grace_s")


class WorkloadNotRegisteredError(base.RefusedBackendError):
    """No workload channel for the job; nothing was sent, the job's state is unchanged."""


class CommandRefusedError(base.RefusedBackendError):
    """The request does not fit what the workload declared; nothing was sent."""


class WorkloadLeftError(base.RefusedBackendError):
    """The job's workload left the node, its state with it: nothing to restore until it
    registers again."""


class AppChannelBackend(base.Backend):
    """Sends snapshot/restore commands to the job's registered workload and waits for them."""

    name = "app-channel"

    def __init__(
        self,
        *,
        hub: channel.ChannelHub,
        command_timeout_s: float = 120.0,
        register_wait_s: float = 10.0,
        recover_wait_s: float = 0.0,
        lost_grace_s: float | None = None,
    ) -> None:
        if command_timeout_s <= 0:
            raise errors.ConfigError(
                f"app-channel command_timeout_s must be > 0 seconds, got {command_timeout_s}"
            )
        if register_wait_s < 0 or recover_wait_s < 0:
            raise errors.ConfigError("app-channel register_wait_s/recover_wait_s must be >= 0")
        if lost_grace_s is not None:
            # The hub keeps the time (it sees the sessions end); the setting lives here
            # with the backend's others. None: the hub's own (5 s by default).
            try:
                hub.lost_grace_s = channel.check_grace(lost_grace_s)
            except ValueError as exc:
                raise errors.ConfigError(f"app-channel {exc}") from exc
        self.hub = hub
        #: How long the workload has to answer one command (sent to it as ``deadline_ms``).
        self.command_timeout_s = command_timeout_s
        #: How long a command waits for a workload that is (re)connecting before failing.
        self.register_wait_s = register_wait_s
        #: How long ``recover()`` waits for the workload to re-register (0 = not at all;
        #: at agent start-up nobody can connect until the server is serving).
        self.recover_wait_s = recover_wait_s

    @classmethod
    def create(cls, settings: Mapping[str, Any]) -> Self:
        raise errors.ConfigError(
            "the app-channel backend reaches workloads through the agent's ChannelHub: "
            "build it with AppChannelBackend.create_on_node(settings, node_services), or "
            "AppChannelBackend(hub=...)"
        )

    @classmethod
    def create_on_node(
        cls, settings: Mapping[str, Any], node_services: services.NodeServices
    ) -> Self:
        unknown = sorted(set(settings) - set(_SETTINGS))
        if unknown:
            raise errors.ConfigError(
                f"unknown app-channel setting(s) {unknown}; known: {list(_SETTINGS)}"
            )
        return cls(hub=node_services.hub, **settings)

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        requested_mode, tags = _request(job)
        if mode != pb.SUSPEND_MODE_UNSPECIFIED:
            requested_mode = mode
        return await self._move(job, "snapshot", tags, mode=requested_mode)

    async def host_bytes_needed(self, job: base.JobContext) -> int | None:
        """Nothing for a DISCARD; else unknown (the workload says what it parked)."""
        mode, _tags = _request(job)
        return 0 if mode == pb.SUSPEND_MODE_DISCARD else None

    async def restore(self, job: base.JobContext) -> base.OpResult:
        _mode, tags = _request(job)
        return await self._move(job, "restore", tags)

    async def _move(
        self,
        job: base.JobContext,
        kind: Literal["snapshot", "restore"],
        tags: list[str],
        *,
        mode: int = pb.SUSPEND_MODE_UNSPECIFIED,
    ) -> base.OpResult:
        """One command to the job's workload (to each of its ranks, all at once), unless
        what it reports leaves nothing to do."""

        def send(
            what: Literal["snapshot", "restore"], rank: int | None
        ) -> Awaitable[channel.CommandOutcome]:
            if what == "snapshot":
                return self.hub.snapshot(
                    job.job_id,
                    job.group,
                    mode=mode,
                    tags=tags,
                    timeout_s=self.command_timeout_s,
                    rank=rank,
                )
            return self.hub.restore(
                job.job_id, job.group, tags=tags, timeout_s=self.command_timeout_s, rank=rank
            )

        gone = await self._wait_for_workload(job)
        if gone is not None:
            return _after_departure(job, kind, gone)
        if ranks.is_ranked(self.hub, job.job_id, job.group):
            return await ranks.move(
                self.hub,
                job,
                kind,
                send,
                lambda state: _already(state, tags, off=kind == "snapshot"),
            )
        known = self.hub.session_state(job.job_id, job.group)
        if known is not None and _already(known, tags, off=kind == "snapshot"):
            return _skipped(job, kind, known)
        try:
            try:
                outcome = await send(kind, None)
            except channel.WorkloadDisconnectedError:
                # The stream ended before the answer: the workload left (a snapshot then
                # has nothing left to do), or it registers again within the grace, after
                # any command it ran, reporting what it holds now; what is still to do is
                # sent once more, on the new stream.
                settled = await self._settle(job)
                if isinstance(settled, channel.Departure):
                    return _after_departure(job, kind, settled)
                if settled is None:
                    raise
                if _already(settled, tags, off=kind == "snapshot"):
                    return _skipped(job, kind, settled)
                log.info("%s sent again: the workload registered again", kind, extra=_log(job))
                outcome = await send(kind, None)
        except channel.ChannelError as exc:
            raise _translate(exc) from exc
        return _result(job, kind, outcome)

    async def _settle(
        self, job: base.JobContext
    ) -> channel.WorkloadState | channel.Departure | None:
        """After a disconnect: the workload's new session, or its departure, waiting at
        most the rest of the grace; ``None`` if neither (the agent is shutting down)."""
        wait = self.hub.lost_grace_left(job.job_id, job.group)
        try:
            return await self.hub.wait_settled(job.job_id, job.group, timeout=wait or 0.0)
        except TimeoutError:
            return self.hub.departure(job.job_id, job.group)

    async def validate(self, job: base.JobContext) -> None:
        """Refuse, before any operation exists, what the registered workload did not declare.

        Tags must be among the declared tags, and a mode *named* in the config among the
        declared modes (an unnamed one is resolved at snapshot time). With no workload
        connected there is nothing to check against; the operation itself then waits for
        one (``register_wait_s``).
        """
        mode, tags = _request(job)
        # Every rank of a multi-process job must accept the request.
        for known in self.hub.rank_states(job.job_id, job.group).values():
            try:
                if mode != pb.SUSPEND_MODE_UNSPECIFIED:
                    channel.check_mode(known, mode)
                channel.check_tags(known, tags, kind="request")
            except channel.CommandRefusedError as exc:
                raise base.BackendConfigRefusedError(str(exc)) from exc

    async def missing_tags(self, job: base.JobContext, tags: Sequence[str]) -> list[str]:
        """Agent hook for staged restore: which of ``tags`` a RUNNING job does not hold.

        The live workload's report wins; without a connection, the residency recorded
        by the last operation (``JobContext.state``) answers. No I/O.
        """
        known = self.hub.session_state(job.job_id, job.group)
        if known is not None and known.state_reported:
            if known.residency == residency.FULL:
                return []
            return [tag for tag in tags if tag not in known.resident_tags]
        if job.state.get("residency") != residency.PARTIAL:
            return []
        resident = set(job.state.get("resident_tags") or ())
        return [tag for tag in tags if tag not in resident]

    async def recover(self, job: base.JobContext) -> pb.JobState | None:
        """RUNNING or SAVED from what the connected workload reports; None if it cannot tell."""
        if self.hub.departure(job.job_id, job.group) is not None:
            return pb.JOB_STATE_IDLE  # the workload left, its state with it
        live = self.hub.rank_states(job.job_id, job.group)
        if len(live) > 1:
            if not all(state.state_reported for state in live.values()):
                return None
            left = self.hub.departed_ranks(job.job_id, job.group)
            held = ranks.ranks_state(live, left)["residency"]
            return pb.JOB_STATE_SAVED if held == residency.NONE else pb.JOB_STATE_RUNNING
        known = self.hub.session_state(job.job_id, job.group)
        if known is None and self.recover_wait_s > 0:
            try:
                known = await self.hub.wait_registered(
                    job.job_id, job.group, timeout=self.recover_wait_s
                )
            except TimeoutError:
                known = None
        if known is None or not known.state_reported:
            return None
        if known.residency == residency.NONE:
            return pb.JOB_STATE_SAVED
        # Fully or partly resident: either way the job holds device memory.
        return pb.JOB_STATE_RUNNING

    async def _wait_for_workload(self, job: base.JobContext) -> channel.Departure | None:
        """Return once a workload serves the job (``None``) or has left (its departure).

        A lost session is waited for at most the rest of its grace, a workload never seen
        (not yet connected, or since the agent started) at most ``register_wait_s``.
        """
        if self.hub.is_registered(job.job_id, job.group):
            return None
        gone = self.hub.departure(job.job_id, job.group)
        if gone is not None:
            return gone
        grace = self.hub.lost_grace_left(job.job_id, job.group)
        wait = grace if grace is not None else self.register_wait_s
        if wait > 0:
            try:
                settled = await self.hub.wait_settled(job.job_id, job.group, timeout=wait)
            except TimeoutError:
                pass
            else:
                return settled if isinstance(settled, channel.Departure) else None
        gone = self.hub.departure(job.job_id, job.group)
        if gone is not None:
            return gone
        group = f"{job.group!r}, " if job.group else ""
        raise WorkloadNotRegisteredError(
            f"no workload channel registered for {channel.describe(job.job_id, job.group)} "
            "on this node"
            + (f" (waited {wait:g} s)" if wait > 0 else "")
            + "; the workload must call tslice.workload.register_workload(agent, "
            f"{job.job_id!r}, {group}...) before the agent can move its state"
        )


def state_dict(state: channel.WorkloadState) -> dict[str, Any]:
    """The residency record persisted with the job (``OpResult.state``)."""
    return {
        "residency": state.residency,
        "resident_tags": list(state.resident_tags),
        "missing_tags": list(state.missing_tags),
        "suspended": state.suspended,
    }


def left_state(departure: channel.Departure) -> dict[str, Any]:
    """The residency record of a job whose workload left: nothing resident, nothing saved."""
    return {
        "residency": residency.NONE,
        "resident_tags": [],
        "missing_tags": [],
        "suspended": False,
        channel.WORKLOAD_LEFT: departure.reason,
    }


def _after_departure(
    job: base.JobContext, kind: Literal["snapshot", "restore"], departure: channel.Departure
) -> base.OpResult:
    """A snapshot of a workload that left has nothing to move; a restore cannot be done."""
    who = channel.describe(job.job_id, job.group)
    if kind == "restore":
        group = f"{job.group!r}, " if job.group else ""
        raise WorkloadLeftError(
            f"the workload of {who} left this node ({departure.reason}), taking its device "
            "state with it: nothing is saved to restore. It must register again "
            f"(tslice.workload.register_workload(agent, {job.job_id!r}, {group}...)) before "
            "the job can be resident here"
        )
    log.info(
        "snapshot: nothing resident (the workload left)",
        extra={**_log(job), "reason": departure.reason},
    )
    return base.OpResult(state=left_state(departure))


def _skipped(
    job: base.JobContext, kind: Literal["snapshot", "restore"], known: channel.WorkloadState
) -> base.OpResult:
    log.info(
        "%s skipped: the workload reports it has nothing to move",
        kind,
        extra={**_log(job), "residency": known.residency},
    )
    return base.OpResult(state=state_dict(known))


def _request(job: base.JobContext) -> tuple[int, list[str]]:
    if job.config is not None and job.config.WhichOneof("backend") == "app_channel":
        return job.config.app_channel.mode, list(job.config.app_channel.tags)
    return pb.SUSPEND_MODE_UNSPECIFIED, []


def _already(state: channel.WorkloadState, tags: list[str], *, off: bool) -> bool:
    """True when the workload reported that the requested move has nothing left to do."""
    if not state.state_reported:
        return False
    if off:
        wanted = set(tags) if tags else set(state.tags)
        return state.residency == residency.NONE or (
            bool(tags) and not wanted & set(state.resident_tags)
        )
    if state.residency == residency.FULL:
        return True
    return bool(tags) and set(tags) <= set(state.resident_tags)


def _translate(exc: channel.ChannelError) -> base.BackendError:
    if isinstance(exc, channel.CommandRefusedError):
        return CommandRefusedError(str(exc))
    if isinstance(exc, channel.NoWorkloadError):
        return WorkloadNotRegisteredError(str(exc))
    # Disconnected or timed out: the workload may have moved some of its state.
    return base.FatalBackendError(str(exc))


def _result(job: base.JobContext, kind: str, outcome: channel.CommandOutcome) -> base.OpResult:
    if not outcome.ok:
        raise base.FatalBackendError(
            f"workload {job.job_id!r} failed {kind} command {outcome.command_id}: "
            f"{outcome.error or 'no error message given'}"
        )
    return base.OpResult(
        device_bytes=max(outcome.device_bytes, 0),
        host_bytes=max(outcome.host_bytes, 0),
        state=state_dict(outcome.state),
        still_resident=kind == "snapshot" and outcome.state.residency == residency.PARTIAL,
    )


def _log(job: base.JobContext) -> dict[str, Any]:
    return {"job_id": job.job_id, "group": job.group}
