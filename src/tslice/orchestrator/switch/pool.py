"""Connections to node agents: one channel per address, a deadline on every call.

Every unary agent RPC goes through :meth:`AgentClient._call`, the one place where
deadlines are applied and gRPC failures are translated (:meth:`AgentClient.error`, which
the GrantStream's link uses too):

- :class:`AgentUnreachable`  the agent did not answer (UNAVAILABLE, DEADLINE_EXCEEDED...):
  the truth on that node is unknown; retry with backoff, report UNKNOWN meanwhile;
- :class:`AgentRejected`  the agent answered and refused (FAILED_PRECONDITION, ABORTED,
  NOT_FOUND, UNIMPLEMENTED...): our view of the node is stale; re-read its Status and re-plan;
- :class:`AgentDeposed`  (an :class:`AgentRejected`) the agent has seen a newer leader term
  than ours: another orchestrator leads now; :meth:`Term.deposed
  <tslice.security.leader_term.Term.deposed>` tells the HA mode to step down.

Every call carries the orchestrator's leader term (``tslice.security.leader_term``; none in
term 0, the embedded mode); each new leadership drops the links (:meth:`AgentPool.new_term`),
so that the next switch reads the nodes again and opens its GrantStreams in the new term.

What an agent speaks is negotiated, never guessed: its Status reply declares it
(``StatusResponse.features``), and the link the switch moves that node through
(``switch.links``: tslice's Grant, or llm-d's Snapshot/Restore) is chosen from that
declaration once per connection (:attr:`AgentClient.link`, dropped with the connection).
Nothing here looks at the declaration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol, TypeVar, cast

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.common import tasks
from tslice.orchestrator import tracing_hooks
from tslice.security import leader_term, tls
from tslice.server import tracing


class Link(Protocol):
    """How the switch moves the agent's node (``switch.links``): what the pool needs of it."""

    async def close(self) -> None:
        """The connection is over (its streams end)."""


_R = TypeVar("_R")
log = logging.getLogger(__name__)

# RESOURCE_EXHAUSTED is not here: a tslice agent says so when a job's state can never fit.
_UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
}

#: An agent refusing the orchestrator's credential (authentication on there), and the fix.
_CREDENTIALS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
_CREDENTIALS_FIX = (
    "agent_client: {ca, cert, key} in its config (a client certificate of identity "
    "orchestrator: tslice certs --client orchestrator) or {token_file} of a token with the "
    "orchestrator role in the agents' auth.tokens"
)

#: How often renewed TLS files are looked for, seconds (a stat of each, on a call).
_TLS_CHECK_S = 1.0

# Reconnect quickly after an agent restarts (grpc's default backoff grows to 2 min).
_CHANNEL_OPTIONS = [
    # The grant stream sends nothing between switches; keepalive notices a dead peer.
    # 60 s stays within what default servers (llm-d's agents too) tolerate.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class AgentError(Exception):
    def __init__(self, address: str, operation: str, detail: str) -> None:
        super().__init__(f"agent {address}: {operation}: {detail}")
        self.address = address
        self.operation = operation
        self.detail = detail


class AgentUnreachable(AgentError):
    """The agent did not answer; nothing is known about what happened there."""


class AgentRejected(AgentError):
    """The agent answered with an error status (its state differs from what we assumed)."""

    def __init__(self, address: str, operation: str, detail: str, code: grpc.StatusCode) -> None:
        super().__init__(address, operation, f"{code.name}: {detail}")
        self.code = code
        #: The agent's own message, without the code.
        self.reason = detail


class AgentDeposed(AgentRejected):
    """The agent refused a directive: it has seen leader term :attr:`seen`, newer than ours
    (:attr:`sent`; 0: we sent none), or ours from another replica. Nothing moved there;
    this orchestrator must not lead."""

    def __init__(self, address: str, operation: str, detail: str, *, sent: int, seen: int) -> None:
        super().__init__(address, operation, detail, grpc.StatusCode.FAILED_PRECONDITION)
        self.sent = sent
        self.seen = seen


class OperationFailed(AgentError):
    """A snapshot/restore operation finished as FAILED (or never finished in time)."""


class AgentClient:
    """Typed calls to one agent, each with a deadline."""

    def __init__(
        self,
        address: str,
        *,
        rpc_timeout_s: float = 10.0,
        operation_timeout_s: float = 900.0,
        wait_chunk_s: float = 30.0,
        security: tls.ClientSecurity | None = None,
        term: leader_term.Term | None = None,
    ) -> None:
        self.address = address
        #: This orchestrator's leader term, sent with every call (Term(0): none sent).
        self._term = term if term is not None else leader_term.Term()
        #: TLS of the channel and the token every call carries (the orchestrator's identity).
        self._security = security or tls.ClientSecurity()
        self.rpc_timeout_s = rpc_timeout_s
        self.operation_timeout_s = operation_timeout_s
        self.wait_chunk_s = wait_chunk_s
        #: How the switch moves this node, chosen from what the agent declared on the
        #: current connection (``switch.step.chosen``); None until then.
        self.link: Link | None = None
        #: Each device's memory (bytes), in the order the last Status reply listed them;
        #: empty until read, or when it lists none (noop, llm-d's agents).
        self.device_bytes: tuple[int, ...] = ()
        #: Whether a Status reply was ever read (device_bytes is then what it listed).
        self.status_seen = False
        self._watch: asyncio.Task[None] | None = None
        tls_files = self._security.tls
        #: The TLS files as the channel read them, and when they were last looked at.
        self._tls_stamp = tls_files.stamp() if tls_files is not None else None
        self._tls_checked = time.monotonic()
        self._channel = self._security.aio_channel(address, _CHANNEL_OPTIONS)
        self._stub: Any = pb_grpc.SnapshotAgentServiceStub(self._channel)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries: the orchestrator's credential and its leader term."""
        return (*self._security.metadata(), *self._term.metadata())

    def open_grant_stream(self) -> Any:
        """A GrantStream call on the current channel, in the current term."""
        return self._stub.GrantStream(metadata=self.metadata())

    async def drop_link(self) -> None:
        """Forget the link (its stream closed): the next switch reads the node again."""
        link, self.link = self.link, None
        if link is not None:
            await link.close()

    async def close(self) -> None:
        if self._watch is not None:
            await tasks.cancel_all([self._watch])
        await self.drop_link()
        await self._channel.close()

    async def _renew_channel(self) -> None:
        """A channel on renewed TLS files (the client certificate, the CA), once the one
        in use is not connected: an open connection keeps its handshake, and a reconnect
        with an expired or untrusted certificate would fail for ever (no restart needed)."""
        tls_files = self._security.tls
        now = time.monotonic()
        if tls_files is None or now - self._tls_checked < _TLS_CHECK_S:
            return
        self._tls_checked = now
        stamp = tls_files.stamp()
        if stamp is None or stamp == self._tls_stamp:
            return
        if self._channel.get_state() == grpc.ChannelConnectivity.READY:
            return
        self._tls_stamp = stamp  # before any await: one renewal at a time
        old = self._channel
        self._channel = self._security.aio_channel(self.address, _CHANNEL_OPTIONS)
        self._stub = pb_grpc.SnapshotAgentServiceStub(self._channel)
        if self._watch is not None:
            await tasks.cancel_all([self._watch])
            self._watch = None
        await self.drop_link()  # chosen again, its stream opened on the new channel
        await old.close()
        log.info("agent %s: TLS files renewed; reconnecting with them", self.address)

    async def _forget_on_disconnect(self) -> None:
        """A declaration holds for one connection: the next may reach another agent."""
        state = self._channel.get_state()
        while True:
            await self._channel.wait_for_state_change(state)
            new = self._channel.get_state()
            if state == grpc.ChannelConnectivity.READY:
                await self.drop_link()
            state = new

    async def status(self, *, timeout_s: float | None = None) -> pb.StatusResponse:
        """The node's job states, devices and declared features."""
        await self._renew_channel()
        resp = await self._call(
            "status", self._stub.Status, pb.StatusRequest(), pb.StatusResponse, timeout_s
        )
        self.device_bytes = tuple(max(0, a.memory_total_bytes) for a in resp.accelerator_statuses)
        self.status_seen = True
        if self._watch is None:
            self._watch = tasks.spawn(self._forget_on_disconnect(), name=f"agent {self.address}")
        return resp

    async def snapshot(self, *, job_id: str, group: str) -> str:
        """llm-d's Snapshot directive; returns the operation id at once."""
        # backend_config stays empty: the agent knows each job's backend.
        request = pb.SnapshotRequest(job_id=job_id, group=group)
        resp = await self._call("snapshot", self._stub.Snapshot, request, pb.SnapshotResponse)
        return resp.operation_id

    async def restore(self, *, job_id: str, group: str) -> str:
        """llm-d's Restore directive; returns the operation id at once."""
        request = pb.RestoreRequest(job_id=job_id, group=group)
        resp = await self._call("restore", self._stub.Restore, request, pb.RestoreResponse)
        return resp.operation_id

    async def get_operation(self, operation_id: str) -> pb.GetOperationResponse:
        """llm-d's GetOperation: the operation as it stands (no waiting)."""
        request = pb.GetOperationRequest(operation_id=operation_id)
        resp = await self._call("poll", self._stub.GetOperation, request, pb.GetOperationResponse)
        return resp

    async def grant(self, request: pb.GrantRequest, *, timeout_s: float) -> pb.GrantResponse:
        """One unary Grant (see ``switch.links.GrantLink``: its stream is preferred)."""
        resp = await self._call("grant", self._stub.Grant, request, pb.GrantResponse, timeout_s)
        return resp

    async def restore_early(self, *, job_id: str, group: str) -> None:
        """A prefetch: Restore with ``prefetch`` set (only to an agent that declares it)."""
        request = pb.RestoreRequest(job_id=job_id, group=group, prefetch=True)
        await self._call("prefetch", self._stub.Restore, request, pb.RestoreResponse)

    async def reset_job(self, *, job_id: str, group: str = "") -> pb.JobState:
        resp = await self._call(
            "reset",
            self._stub.ResetJob,
            pb.ResetJobRequest(job_id=job_id, group=group),
            pb.ResetJobResponse,
        )
        return resp.state

    async def wait_operation(self, operation_id: str) -> pb.GetOperationResponse:
        """Long-poll until the operation finished; raise OperationFailed past the timeout."""
        deadline = time.monotonic() + self.operation_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OperationFailed(
                    self.address,
                    "wait",
                    f"operation {operation_id} did not finish within "
                    f"{self.operation_timeout_s:g} s (operation_timeout_s)",
                )
            chunk = min(self.wait_chunk_s, left)
            resp = await self._call(
                "wait",
                self._stub.WaitOperation,
                pb.WaitOperationRequest(operation_id=operation_id, timeout_ms=int(chunk * 1000)),
                pb.GetOperationResponse,
                chunk + self.rpc_timeout_s,
            )
            if resp.status != pb.OPERATION_STATUS_PENDING:
                return resp

    async def _call(
        self,
        operation: str,
        method: Any,
        request: object,
        response_type: type[_R],
        timeout_s: float | None = None,
    ) -> _R:
        try:
            if tracing.ENABLED and tracing_hooks.in_trace():
                timeout = timeout_s or self.rpc_timeout_s
                replied = await tracing_hooks.agent_call(
                    lambda metadata: method(request, timeout=timeout, metadata=metadata),
                    metadata=self.metadata(),
                    operation=operation,
                    address=self.address,
                    request=request,
                )
                return cast(_R, replied)
            call = method(
                request, timeout=timeout_s or self.rpc_timeout_s, metadata=self.metadata()
            )
            return cast(_R, await call)
        except grpc.aio.AioRpcError as err:
            detail = err.details() or err.code().name.lower()
            raise self.error(operation, err.code(), detail) from err

    def error(self, operation: str, code: grpc.StatusCode, detail: str) -> AgentError:
        """The error for a call that ended with ``code`` (the one place that translates)."""
        if code in _CREDENTIALS:
            # The agent's message speaks to a job; the orchestrator's own fix is its config.
            detail = f"{detail} [the orchestrator's credential: {_CREDENTIALS_FIX}]"
        if code in _UNREACHABLE:
            hint = tls.mismatch_hint(detail, self._security, settings="agent_client")
            detail = f"{detail} [{hint}]" if hint else detail
            return AgentUnreachable(self.address, operation, detail)
        seen = leader_term.seen_in(detail) if code == grpc.StatusCode.FAILED_PRECONDITION else None
        sent = self._term.value
        # The same term refused: another replica was elected in it (the agent saw it first).
        if seen is not None and (seen > sent or seen == sent != 0):
            # Never adopted (only an election raises a term): we are deposed; say so.
            log.warning("agent %s: %s: %s", self.address, operation, detail)
            self._term.deposed(seen)
            return AgentDeposed(self.address, operation, detail, sent=sent, seen=seen)
        return AgentRejected(self.address, operation, detail, code)


class AgentPool:
    """One :class:`AgentClient` per agent address, shared by every group using it."""

    def __init__(
        self,
        *,
        rpc_timeout_s: float,
        operation_timeout_s: float,
        wait_chunk_s: float,
        security: tls.ClientSecurity | None = None,
        term: leader_term.Term | None = None,
    ) -> None:
        self._security = security
        #: Shared by every client: the orchestrator's leader term (HA mode advances it).
        self._term = term if term is not None else leader_term.Term()
        self._rpc_timeout_s = rpc_timeout_s
        self._operation_timeout_s = operation_timeout_s
        self._wait_chunk_s = wait_chunk_s
        self._clients: dict[str, AgentClient] = {}

    def get(self, address: str) -> AgentClient:
        client = self._clients.get(address)
        if client is None:
            client = AgentClient(
                address,
                rpc_timeout_s=self._rpc_timeout_s,
                operation_timeout_s=self._operation_timeout_s,
                wait_chunk_s=self._wait_chunk_s,
                security=self._security,
                term=self._term,
            )
            self._clients[address] = client
        return client

    async def new_term(self) -> None:
        """A leadership begins: every link is chosen again from a fresh read of its node
        (a new leader's first call fences the node), its stream opened in the new term."""
        for client in self._clients.values():
            await client.drop_link()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
