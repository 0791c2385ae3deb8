"""Workload side of the workload channel: ``register_workload`` and its handle.

A training or serving process calls :func:`register_workload` once; from then on a
background thread keeps a ``WorkloadChannel`` stream open to the node agent and
runs the snapshot/restore commands the agent sends through an adapter (PyTorch,
vLLM, SGLang, callbacks). The caller's code keeps running; only the adapter's
memory moves.

Threads, and why:

- the *connection* thread reads the stream. It answers pings itself, so keepalive
  keeps flowing while a long offload runs;
- one *worker* thread runs commands, one at a time, in arrival order (the agent
  sends at most one per job at a time anyway);
- awaitable adapter methods run on the event loop that was running when
  ``register_workload`` was called (engines such as vLLM's ``AsyncLLM`` are bound
  to it), or on a private loop thread when there was none
  (:mod:`tslice.workload.commands` runs the commands).

Readiness is real: the wire has no registration reply, so the agent's first
``Ping``, which a tslice agent sends right after accepting a registration that
declares ``features.keepalive`` (this library declares it, and ``reports_state``),
is the acknowledgement. :meth:`WorkloadHandle.wait_registered` waits for it.
(llm-d's agent never pings, so against it ``wait_registered`` times out, and
keepalive stays off, while commands still work.)

Reconnects back off exponentially (0.5 s doubling to 30 s, with jitter), and each
one re-registers with what the workload holds *now* (``suspended``,
``resident_tags``), after any running command has finished, so the agent
reconciles. A registration the agent refuses (INVALID_ARGUMENT, UNAUTHENTICATED,
PERMISSION_DENIED) is final: the handle stops and says why in
:attr:`WorkloadHandle.error`.

Identity: each handle makes a random instance token once and sends it on every stream
(metadata ``tslice-workload-instance``): the agent lets only the same workload take the
place of a live or lost registration of its (job, group); another is refused with
ALREADY_EXISTS, which the handle retries with its backoff (the other one may be gone
after the agent's ``lost_grace_s``), saying why in :attr:`WorkloadHandle.refusal`. Over
the agent's Unix socket the token is first bound to this process on the agent's register
socket (``$TSLICE_AGENT_REGISTER_SOCKET``, else ``register.sock`` next to the agent
socket), where the kernel tells the agent which process it is.

TLS and token: the job side's own settings (``$TSLICE_TLS_*``, ``$TSLICE_TOKEN``, or
``security=``), as :mod:`tslice.workload.agent_link` applies them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
import random
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.common import validation
from tslice.security import tls
from tslice.workload import adapters, agent_link, commands, process
from tslice.workload.adapters import base, callbacks
from tslice.workload.agent_link import AGENT_ENV_VARS, ChannelSettings

__all__ = ["AGENT_ENV_VARS", "ChannelSettings", "WorkloadHandle", "register_workload"]

log = logging.getLogger(__name__)

ModeLike: TypeAlias = "base.SuspendMode | str | int"
#: gRPC metadata key of the handle's instance token (the agent's
#: ``tslice.agent.channel.rules.INSTANCE_METADATA``).
INSTANCE_METADATA = "tslice-workload-instance"


class _Stop:
    """Outbox sentinel: end the request stream (half-close)."""


_STOP = _Stop()
#: Refusals after which registering again cannot help.
_FINAL_REFUSALS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)
# Generated stubs are untyped; calling through Any keeps strict mypy quiet either way.
_STUB: Any = pb_grpc.SnapshotAgentServiceStub


@dataclasses.dataclass
class _Connection:
    """One stream attempt; commands answer on the connection they arrived on."""

    outbox: queue.Queue[pb.WorkloadMessage | _Stop] = dataclasses.field(default_factory=queue.Queue)
    call: Any = None
    acked: bool = False
    keepalive: bool = False
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    pings_sent: int = 0

    def heard(self) -> None:
        self.last_heard = time.monotonic()


class WorkloadHandle:
    """A registered workload: the background connection plus the command worker.

    Create it with :func:`register_workload`. Use as a context manager, or call
    :meth:`close` when done.
    """

    def __init__(
        self,
        *,
        agent: str | grpc.Channel,
        job_id: str,
        group: str,
        adapter: base.WorkloadAdapter,
        capabilities: base.Capabilities,
        loop: asyncio.AbstractEventLoop | None,
        settings: ChannelSettings,
        register_socket: Path | None = None,
        security: tls.ClientSecurity | None = None,
        rank: int = 0,
    ) -> None:
        self.job_id = job_id
        #: Which of the job's processes on this node this workload is (0 = the only one).
        self.rank = rank
        #: Sent on every stream: the agent tells this workload coming back from another.
        self.instance = secrets.token_hex(16)
        self._register_socket = register_socket
        self._unix = agent_link.is_unix(agent)
        #: TLS (TCP addresses only) and the token every stream carries.
        self._security = agent_link.security(agent, security)
        self.group = group
        self._label = f"job {job_id!r} (group {group!r})" if group else f"job {job_id!r}"
        if rank:
            self._label += f" rank {rank}"
        self.adapter = adapter
        self.capabilities = capabilities
        self._agent = agent
        self._settings = settings
        self._commands = commands.CommandRunner(
            job_id=job_id, adapter=adapter, capabilities=capabilities, loop=loop
        )
        self._stop = threading.Event()
        self._state = threading.Condition()
        self._registered = False
        self._finished = False
        self._in_flight = 0
        self._connection: _Connection | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"tslice-workload-{job_id}-worker"
        )
        self._thread = threading.Thread(
            target=self._run, name=f"workload-channel-{job_id}", daemon=True
        )
        #: Why the handle stopped for good (refused or replaced registration), else None.
        self.error: str | None = None
        #: Why the agent last refused the registration for now (another workload of the
        #: job and group is live; retried), else None.
        self.refusal: str | None = None
        #: Why binding this process on the agent's register socket last failed, else None.
        self.bind_error: str | None = None
        #: Streams opened so far (1 + reconnects).
        self.connections = 0
        #: Commands run so far (successful or not).
        self.commands_executed = 0
        #: Keepalive pings received from the agent (the first one acknowledges registration).
        self.pings_received = 0

    # ---- public -------------------------------------------------------------------

    def start(self) -> WorkloadHandle:
        self._thread.start()
        return self

    @property
    def registered(self) -> bool:
        """True while the agent has acknowledged the current registration."""
        with self._state:
            return self._registered

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Block until the agent acknowledged the registration; False on timeout or stop."""
        with self._state:
            self._state.wait_for(lambda: self._registered or self._finished, timeout)
            return self._registered

    def wait_refused(self, timeout: float | None = None) -> str | None:
        """Block until the agent refused a registration for now (another workload of the job
        and group holds it; the handle keeps retrying); the refusal, or None on timeout."""
        with self._state:
            self._state.wait_for(lambda: self.refusal is not None or self._finished, timeout)
            return self.refusal

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the handle stopped for good (closed, refused or replaced)."""
        with self._state:
            return self._state.wait_for(lambda: self._finished, timeout)

    def state(self) -> base.AdapterState:
        """What the workload holds on the device now (the adapter's view, else tracked)."""
        return self._commands.state()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the channel (the agent sees a clean end of stream) and the worker. Idempotent."""
        self._stop.set()
        with self._state:
            self._state.notify_all()  # wakes a reconnect waiting for a command to finish
        connection = self._connection
        if connection is not None:
            connection.outbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout / 2)
            connection = self._connection
            if self._thread.is_alive() and connection is not None and connection.call is not None:
                connection.call.cancel()
            self._thread.join(timeout / 2)
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._commands.close()
        self._set_finished()

    def __enter__(self) -> WorkloadHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<WorkloadHandle job_id={self.job_id!r} adapter={self.adapter.name} "
            f"registered={self.registered} error={self.error!r}>"
        )

    # ---- connection loop ----------------------------------------------------------

    def _run(self) -> None:
        delay = self._settings.backoff_initial_s
        try:
            while not self._stop.is_set():
                self._wait_idle()
                if self._stop.is_set():
                    break
                acked, final = self._connect_once()
                if final or self._stop.is_set():
                    break
                if acked:
                    delay = self._settings.backoff_initial_s
                pause = delay * random.uniform(0.5, 1.5)
                log.info(
                    "reconnecting to the agent",
                    extra={"job_id": self.job_id, "in_s": round(pause, 2)},
                )
                if self._stop.wait(pause):
                    break
                delay = min(delay * 2, self._settings.backoff_max_s)
        finally:
            self._set_finished()

    def _connect_once(self) -> tuple[bool, bool]:
        """One stream, until it ends. Returns (acknowledged, stop for good)."""
        channel, owned = self._open_channel()
        connection = _Connection()
        self._connection = connection
        self.connections += 1
        registration = self._registration()
        self._bind()
        try:
            stub = _STUB(channel)
            connection.call = stub.WorkloadChannel(
                self._requests(connection, registration),
                metadata=((INSTANCE_METADATA, self.instance), *self._security.metadata()),
            )
            if self._stop.is_set():
                connection.outbox.put(_STOP)
            for command in connection.call:
                self._on_command(connection, command)
            log.info("the agent ended the workload channel", extra={"job_id": self.job_id})
            return connection.acked, False
        except grpc.RpcError as err:
            return connection.acked, self._on_stream_error(err)
        except ValueError as exc:
            if not owned and not self._stop.is_set():
                # grpc raises ValueError for a call on a closed channel.
                self._fail(f"the grpc.Channel given to register_workload() is unusable: {exc}")
                return connection.acked, True
            log.exception("workload channel failed", extra={"job_id": self.job_id})
            return connection.acked, self._stop.is_set()
        except Exception:
            log.exception("workload channel failed", extra={"job_id": self.job_id})
            return connection.acked, self._stop.is_set()
        finally:
            connection.outbox.put(_STOP)
            self._set_registered(False)
            if owned:
                channel.close()

    def _on_stream_error(self, err: grpc.RpcError) -> bool:
        """Log why the stream ended; True if reconnecting cannot help."""
        code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
        details = err.details() if callable(getattr(err, "details", None)) else str(err)
        if self._stop.is_set():
            return True
        if code in _FINAL_REFUSALS:
            bind = f" (binding on the register socket failed: {self.bind_error})"
            self._fail(
                f"the agent refused the registration of {self._label}: {details}"
                f"{bind if self.bind_error else ''}"
            )
            return True
        if code == grpc.StatusCode.ALREADY_EXISTS:
            with self._state:
                self.refusal = details
                self._state.notify_all()
            log.warning(
                "another workload holds the registration; retrying",
                extra={"job_id": self.job_id, "details": details},
            )
            return False
        if code == grpc.StatusCode.ABORTED and "replaced" in (details or ""):
            self._fail(
                f"{self._label} was registered again (by another process or handle), "
                f"which now owns the channel ({details}); this handle stops"
            )
            return True
        log.warning(
            "workload channel lost",
            extra={"job_id": self.job_id, "code": code.name, "details": details},
        )
        return False

    def _bind(self) -> None:
        """Bind the instance token to this process on the agent's register socket (before
        each stream: an agent that restarted has forgotten it)."""
        if self._register_socket is None:
            return
        try:
            process.bind_channel(
                self.job_id,
                instance=self.instance,
                group=self.group,
                socket_path=self._register_socket,
            )
        except process.RegistrationError as exc:
            self.bind_error = str(exc)
            level = logging.WARNING if self._unix else logging.DEBUG
            log.log(level, "cannot bind the workload channel", extra={"error": str(exc)})
        else:
            self.bind_error = None

    def _on_command(self, connection: _Connection, command: pb.AgentCommand) -> None:
        connection.heard()
        kind = command.WhichOneof("command")
        if kind == "ping":
            self.pings_received += 1
            if not connection.acked:
                connection.acked = True
                self.refusal = None
                self._set_registered(True)
                log.info("registered with the agent", extra={"job_id": self.job_id})
            connection.keepalive = True
            connection.outbox.put(pb.WorkloadMessage(pong=command.ping))
        elif kind in ("snapshot", "restore"):
            with self._state:
                self._in_flight += 1
            try:
                self._worker.submit(self._execute, connection, command, time.monotonic())
            except RuntimeError:  # the worker was shut down by close()
                with self._state:
                    self._in_flight -= 1
        elif kind == "pong":
            pass
        elif command.command_id:
            connection.outbox.put(
                pb.WorkloadMessage(
                    result=pb.CommandResult(
                        command_id=command.command_id,
                        ok=False,
                        error="unsupported command: this workload library knows "
                        "snapshot and restore only",
                    )
                )
            )

    def _requests(
        self, connection: _Connection, registration: pb.WorkloadMessage
    ) -> Iterator[pb.WorkloadMessage]:
        """The outgoing stream: registration, then results/pongs, and our own pings."""
        yield registration
        interval = self._settings.ping_interval_s
        next_ping = time.monotonic() + interval
        while True:
            timeout = max(next_ping - time.monotonic(), 0) if connection.keepalive else None
            try:
                item = connection.outbox.get(timeout=timeout)
            except queue.Empty:
                item = None
            if isinstance(item, _Stop):
                return
            if connection.keepalive:
                silent = time.monotonic() - connection.last_heard
                if silent > self._settings.silence_limit_s:
                    log.warning(
                        "no message from the agent; dropping the connection",
                        extra={"job_id": self.job_id, "silent_s": round(silent, 2)},
                    )
                    if connection.call is not None:
                        connection.call.cancel()
                    return
            if item is not None:
                yield item
            if connection.keepalive and time.monotonic() >= next_ping:
                connection.pings_sent += 1
                next_ping = time.monotonic() + interval
                yield pb.WorkloadMessage(ping=pb.Ping(nonce=connection.pings_sent))

    def _registration(self) -> pb.WorkloadMessage:
        state = self.state()
        caps = self.capabilities
        return pb.WorkloadMessage(
            register=pb.RegisterWorkload(
                job_id=self.job_id,
                group=self.group,
                capabilities=pb.WorkloadCapabilities(
                    supported_modes=[pb.SuspendMode.Name(int(m)) for m in caps.supported_modes],
                    default_mode=pb.SuspendMode.Name(int(caps.default_mode or 0)),
                    tags=caps.tags,
                ),
                resident_tags=state.resident_tags,
                suspended=state.suspended,
                pid=os.getpid(),
                rank=self.rank,
                # The agent uses keepalive and our state report only because we declare them.
                features=pb.WorkloadFeatures(keepalive=True, reports_state=True),
            )
        )

    # ---- commands -----------------------------------------------------------------

    def _execute(self, connection: _Connection, command: pb.AgentCommand, received: float) -> None:
        try:
            result = self._commands.run(command, received)
        finally:
            with self._state:
                self.commands_executed += 1
                self._in_flight -= 1
                self._state.notify_all()
        # Answer on the stream the command came from; if it is gone, the agent has
        # already failed the command and the next registration reports the new state.
        connection.outbox.put(pb.WorkloadMessage(result=result))

    # ---- helpers ------------------------------------------------------------------

    def _open_channel(self) -> tuple[grpc.Channel, bool]:
        if isinstance(self._agent, str):
            return self._security.channel(self._agent), True
        return self._agent, False

    def _set_registered(self, value: bool) -> None:
        with self._state:
            self._registered = value
            self._state.notify_all()

    def _set_finished(self) -> None:
        with self._state:
            self._registered = False
            self._finished = True
            self._state.notify_all()

    def _fail(self, message: str) -> None:
        self.error = message
        log.error(message, extra={"job_id": self.job_id})

    def _wait_idle(self) -> None:
        # Re-register only once no command is running, so the reported state is settled.
        with self._state:
            self._state.wait_for(lambda: self._in_flight == 0 or self._stop.is_set())


#: The highest rank the agent accepts (``RegisterWorkload.rank``).
MAX_RANK = 4095


def register_workload(  # noqa: PLR0917 - llm-d's positional signature, kept for drop-in use
    agent: str | grpc.Channel | None,
    job_id: str,
    group: str = "",
    workload: object | None = None,
    on_snapshot: callbacks.SnapshotCallback | None = None,
    on_restore: callbacks.RestoreCallback | None = None,
    supported_modes: Iterable[ModeLike] | None = None,
    default_mode: ModeLike | None = None,
    tags: Iterable[str] | None = None,
    *,
    ping_interval_s: float = 5.0,
    missed_pings: int = 3,
    backoff_initial_s: float = 0.5,
    backoff_max_s: float = 30.0,
    register_socket: str | os.PathLike[str] | None = None,
    security: tls.ClientSecurity | None = None,
    rank: int = 0,
) -> WorkloadHandle:
    """Register this process's workload with the node agent and serve its commands.

    Args:
        agent: the agent address (``"127.0.0.1:9001"``, ``"unix:/run/tslice/agent.sock"``)
            or a ``grpc.Channel`` (not closed by the handle). ``None`` reads
            ``TSLICE_AGENT_ADDR`` (or llm-d's ``SNAPSHOT_AGENT_ADDR``).
        job_id: the job this workload belongs to (validated like every tslice id).
        group: the group whose device state this workload holds on this node. A job may
            register one workload per group (a sampler engine, a trainer process); the
            agent keys sessions by (job, group). "" (llm-d's default) = the job's only one.
        workload: what to drive: a ``torch.nn.Module``/optimizer/``(module, optimizer)``,
            a vLLM engine, an SGLang engine, any object with ``snapshot``/``restore``,
            or a :class:`~tslice.workload.adapters.base.WorkloadAdapter`.
        on_snapshot, on_restore: callbacks instead of ``workload`` (both required):
            ``on_snapshot(mode_name, tags)`` and ``on_restore(tags)``.
        supported_modes, default_mode, tags: override what the adapter declares; modes
            by name (``"offload"``, ``"SUSPEND_MODE_DISCARD"``) or number.
        ping_interval_s, missed_pings: keepalive towards the agent.
        backoff_initial_s, backoff_max_s: reconnect backoff bounds.
        register_socket: the agent's register socket, where this process binds its
            channel (needed over the agent's Unix socket). Default:
            ``$TSLICE_AGENT_REGISTER_SOCKET``, else ``register.sock`` next to a
            ``unix:`` agent socket; over TCP, none unless named.
        security: TLS and token (as ``tslice.Client(security=...)``); ``None`` reads
            ``$TSLICE_TLS_CA``, ``$TSLICE_TLS_CERT``/``$TSLICE_TLS_KEY`` and
            ``$TSLICE_TOKEN``/``$TSLICE_TOKEN_FILE``. TLS applies to a TCP address (not
            to ``unix:`` nor to a given channel); the token is sent on every stream.
        rank: which of the job's processes on this node (for this group) this is, for a
            job with one process per GPU (FSDP ranks, a tensor-parallel engine): each
            rank registers with its own number (0, 1, ...), and the agent moves every
            rank at once, all or nothing. 0 = the job's only workload (as before).

    Returns at once with the connection running in the background; call
    ``handle.wait_registered(timeout)`` to know the agent has accepted it.
    """
    validation.check_id("job_id", job_id)
    if group:
        validation.check_id("group", group)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_RANK:
        raise ValueError(
            f"rank must be an int between 0 and {MAX_RANK} (which of the job's processes "
            f"on this node), got {rank!r}"
        )
    target = agent_link.resolve_agent(agent)
    settings = ChannelSettings(ping_interval_s, missed_pings, backoff_initial_s, backoff_max_s)
    adapter = adapters.resolve_adapter(
        workload=workload, on_snapshot=on_snapshot, on_restore=on_restore
    )
    capabilities = base.overridden_capabilities(
        adapter.capabilities(), supported_modes, default_mode, tags
    )
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    handle = WorkloadHandle(
        agent=target,
        job_id=job_id,
        group=group,
        adapter=adapter,
        capabilities=capabilities,
        loop=loop,
        settings=settings,
        register_socket=agent_link.register_socket(target, register_socket),
        security=security,
        rank=rank,
    )
    return handle.start()
