"""Self-registration of a job's processes over a Unix socket, PID from peer credentials.

Why: the cuda backend must know which processes to checkpoint. Asking users for
PIDs is error-prone, and a process scan cannot tell jobs apart outside
Kubernetes. So each process of a job says "I belong to job X" once, over a
node-local Unix socket, and the agent takes the PID from the kernel
(``SO_PEERCRED``), never from the message: a process can only register itself.

Protocol (one exchange per connection, UTF-8 JSON lines):

    client → {"job_id": "rl-a", "group": "pool-0"}           (group optional)
    server → {"ok": true, "pid": 4242, "job_id": "rl-a"}
          or {"ok": false, "error": "<what to fix>"}

A registration is keyed by PID plus process start time, so a reused PID never
inherits an old registration; processes that exit are dropped lazily.

A process that has workload hooks (quiesce before the cuda backend locks it, resume
after) sends ``"hooks": true`` too; the connection then stays open for the agent's
hook calls (:mod:`tslice.agent.channel.quiesce`) until the process closes it or exits.

The same socket binds a workload channel to its process (gRPC reports a Unix peer as
``unix:`` only, with no credentials): a workload sends
``{"job_id": ..., "group": ..., "channel_instance": "<token>"}`` with the random
instance token it then presents on ``WorkloadChannel`` (metadata
``tslice-workload-instance``). The agent records the token against the connecting
process (pid, uid and start time from ``SO_PEERCRED``, never from the message) and
the job; the hub (:mod:`tslice.agent.channel`) takes the registration's process from
that record. Where the agent knows the job's processes (they announced themselves
here), the binding process must be one of them or a descendant of one. A binding
is not an announcement: it does not make the process a cuda target.

Agent side::

    server = registration.RegistrationServer(path=state_dir / "register.sock")
    await server.start()            # registry: registration.default_registry()
    ...
    registration.default_registry().pids("rl-a")   # registration order, live only
    await server.close()

Workload side: :func:`tslice.workload.process.announce_process`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
import struct
import threading
from pathlib import Path
from typing import Any

from tslice.agent import discovery
from tslice.agent.channel import quiesce
from tslice.common import validation

log = logging.getLogger(__name__)

#: File name of the socket inside the agent's state directory.
DEFAULT_SOCKET_NAME = "register.sock"
#: Environment variable that tells workloads where the socket is.
SOCKET_ENV = "TSLICE_AGENT_REGISTER_SOCKET"
_MAX_LINE = 4096
_READ_TIMEOUT_S = 5.0
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
#: Channel bindings remembered (those of exited processes are dropped first).
CHANNEL_BINDINGS_KEPT = 4096


@dataclasses.dataclass(frozen=True)
class Registration:
    job_id: str
    group: str
    pid: int
    uid: int
    start_time: int | None


@dataclasses.dataclass(frozen=True)
class ChannelBinding:
    """A workload channel instance token bound to the process that presented it."""

    instance: str
    job_id: str
    group: str
    pid: int
    uid: int
    start_time: int | None


class RegistrationError(ValueError):
    """A registration was refused; the message is sent back to the workload."""


class ProcessRegistry:
    """Which live processes belong to which job (thread-safe)."""

    def __init__(self, *, proc_root: str | os.PathLike[str] = "/proc") -> None:
        self._proc_root = proc_root
        self._lock = threading.Lock()
        # Insertion order of the dict = registration order.
        self._by_pid: dict[int, Registration] = {}
        self._bindings: dict[str, ChannelBinding] = {}
        #: Quiesce/resume hooks of the processes that announced them.
        self.hooks = quiesce.ProcessHooks()

    def _alive(self, reg: Registration | ChannelBinding) -> bool:
        now = discovery.process_start_time(reg.pid, proc_root=self._proc_root)
        if now is None or not discovery.process_exists(reg.pid, proc_root=self._proc_root):
            return False
        return reg.start_time is None or now == reg.start_time

    def _checked(self, *, job_id: str, group: str, pid: int, **more_ids: str) -> int | None:
        """The process's start time, once the ids are valid and the process is visible."""
        try:
            for name, value in (("job_id", job_id), *more_ids.items()):
                validation.check_id(name, value)
            if group:
                validation.check_id("group", group)
        except validation.InvalidIdError as exc:
            raise RegistrationError(str(exc)) from exc
        start = discovery.process_start_time(pid, proc_root=self._proc_root)
        if start is None:
            raise RegistrationError(
                f"process {pid} is not visible to the agent (no {self._proc_root}/{pid}/stat)"
            )
        return start

    def register(self, *, job_id: str, pid: int, group: str = "", uid: int = -1) -> Registration:
        """Record that ``pid`` belongs to ``job_id`` (and ``group``, "" = not said);
        idempotent for the same job. The same process naming another group moves there.

        Raises RegistrationError if the process is gone or already belongs to
        another live job.
        """
        start = self._checked(job_id=job_id, group=group, pid=pid)
        reg = Registration(job_id, group, pid, uid, start)
        with self._lock:
            old = self._by_pid.get(pid)
            if old is not None and old.job_id != job_id and self._alive(old):
                raise RegistrationError(
                    f"process {pid} is already registered to job {old.job_id!r}; "
                    "a process belongs to one job"
                )
            if old is not None and old.job_id == job_id and old.start_time == start:
                if old.group != group:
                    self._by_pid[pid] = reg  # keeps its place in registration order
                return self._by_pid[pid]
            self._by_pid.pop(pid, None)
            self._by_pid[pid] = reg
        return reg

    def bind_channel(
        self, *, instance: str, job_id: str, pid: int, group: str = "", uid: int = -1
    ) -> ChannelBinding:
        """Bind a workload channel ``instance`` token to process ``pid`` of ``job_id``.

        Raises RegistrationError if the process is gone, belongs to another job, is not
        one of the job's known processes (nor a descendant of one), or the token is
        bound to another live process.
        """
        start = self._checked(job_id=job_id, group=group, pid=pid, channel_instance=instance)
        binding = ChannelBinding(instance, job_id, group, pid, uid, start)
        with self._lock:
            announced = [r for r in self._by_pid.values() if self._alive(r)]
            mine = next((r for r in announced if r.pid == pid), None)
            if mine is not None and mine.job_id != job_id:
                raise RegistrationError(
                    f"process {pid} belongs to job {mine.job_id!r}; it cannot register a "
                    f"workload of job {job_id!r}"
                )
            known = [r.pid for r in announced if r.job_id == job_id]
            if known and not discovery.descends_from(pid, known, proc_root=self._proc_root):
                raise RegistrationError(
                    f"process {pid} is not one of the processes of job {job_id!r} known to "
                    f"this agent ({', '.join(map(str, known[:8]))}) nor a child of one; "
                    "register the workload from the job's own processes"
                )
            held = self._bindings.get(instance)
            if held is not None and held.pid != pid and self._alive(held):
                raise RegistrationError(
                    "this channel instance token is bound to another process; a workload "
                    "generates its own token (tslice.workload.register_workload does)"
                )
            self._bindings.pop(instance, None)
            self._bindings[instance] = binding
            if len(self._bindings) > CHANNEL_BINDINGS_KEPT:
                self._bindings = {k: b for k, b in self._bindings.items() if self._alive(b)}
            while len(self._bindings) > CHANNEL_BINDINGS_KEPT:
                del self._bindings[next(iter(self._bindings))]
        return binding

    def channel_binding(self, instance: str) -> ChannelBinding | None:
        """The live process bound to ``instance``, if any."""
        with self._lock:
            binding = self._bindings.get(instance)
            if binding is not None and not self._alive(binding):
                del self._bindings[instance]
                return None
            return binding

    def _prune(self) -> None:
        with self._lock:
            for pid, reg in list(self._by_pid.items()):
                if not self._alive(reg):
                    del self._by_pid[pid]

    def pids(self, job_id: str) -> list[int]:
        """Live PIDs registered for ``job_id``, in registration order."""
        self._prune()
        with self._lock:
            return [r.pid for r in self._by_pid.values() if r.job_id == job_id]

    def job_of(self, pid: int) -> str | None:
        """The job a live process registered for, if any."""
        self._prune()
        with self._lock:
            reg = self._by_pid.get(pid)
            return reg.job_id if reg is not None else None

    def registrations(self) -> list[Registration]:
        self._prune()
        with self._lock:
            return list(self._by_pid.values())

    def forget(self, job_id: str, group: str = "") -> None:
        """Drop the registrations of ``job_id`` that named ``group`` ("" = every one)."""
        with self._lock:
            for pid, reg in list(self._by_pid.items()):
                if reg.job_id == job_id and (not group or reg.group == group):
                    del self._by_pid[pid]


_default = ProcessRegistry()


def default_registry() -> ProcessRegistry:
    """The registry shared by the agent's RegistrationServer and the cuda backend."""
    return _default


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is None:
        raise OSError("SO_PEERCRED is not available on this platform (Linux only)")
    raw = sock.getsockopt(socket.SOL_SOCKET, so_peercred, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return int(pid), int(uid), int(gid)


class RegistrationServer:
    """asyncio Unix-socket server feeding a :class:`ProcessRegistry`."""

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        registry: ProcessRegistry | None = None,
        mode: int = 0o660,
    ) -> None:
        self.path = Path(path)
        self.registry = registry if registry is not None else default_registry()
        self._mode = mode
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Bind and listen. A stale socket file left by a killed agent is replaced."""
        if getattr(socket, "SO_PEERCRED", None) is None:
            raise OSError("process registration needs SO_PEERCRED (Linux)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            existing = self.path.lstat()
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(existing.st_mode):
                raise FileExistsError(
                    f"{self.path} exists and is not a socket; remove it or choose another "
                    "registration socket path"
                )
            self.path.unlink()
        self._server = await asyncio.start_unix_server(
            self._handle, path=str(self.path), limit=_MAX_LINE
        )
        os.chmod(self.path, self._mode)
        log.info("process registration listening", extra={"socket": str(self.path)})

    async def close(self) -> None:
        """Stop listening and remove the socket file (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await self.registry.hooks.close()  # kept connections, or wait_closed() waits on them
        await server.wait_closed()
        try:
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()
        except FileNotFoundError:
            pass

    async def __aenter__(self) -> RegistrationServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep = False
        try:
            reply = await self._exchange(reader, writer)
        except Exception as exc:  # one bad client must not disturb the server
            log.warning("process registration failed", exc_info=exc)
            reply = {"ok": False, "error": f"internal error: {exc}"}
        hooks_of = reply.pop("_hooks_of", None)
        try:
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
            if isinstance(hooks_of, int):
                # The connection stays open for the process's hooks (tslice.agent.channel.quiesce).
                self.registry.hooks.attach(hooks_of, reader, writer)
                keep = True
        except OSError:
            pass  # the client went away; nothing to tell it
        finally:
            if not keep:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, Any]:
        pid, uid, _gid = peer_credentials(writer.get_extra_info("socket"))
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=_READ_TIMEOUT_S)
        except asyncio.TimeoutError:
            return {"ok": False, "error": f"no registration line within {_READ_TIMEOUT_S:g} s"}
        except ValueError:  # longer than the stream limit
            return {"ok": False, "error": f"registration line longer than {_MAX_LINE} bytes"}
        try:
            message = json.loads(line)
        except json.JSONDecodeError as exc:
            return {
                "ok": False,
                "error": f"registration is not JSON ({exc.msg}); send "
                '{"job_id": "...", "group": "..."} and a newline',
            }
        if not isinstance(message, dict):
            return {"ok": False, "error": "registration must be a JSON object"}
        job_id = message.get("job_id")
        group = message.get("group", "") or ""
        claimed = message.get("pid")
        if not isinstance(job_id, str) or not isinstance(group, str):
            return {"ok": False, "error": "job_id (string) is required; group must be a string"}
        if claimed is not None and claimed != pid:
            return {
                "ok": False,
                "error": f"claimed pid {claimed} is not the connecting "
                f"process ({pid}); a process can only register itself",
            }
        instance = message.get("channel_instance")
        if instance is not None:
            return self._bind(instance, job_id=job_id, group=group, pid=pid, uid=uid)
        try:
            reg = self.registry.register(job_id=job_id, pid=pid, group=group, uid=uid)
        except RegistrationError as exc:
            return {"ok": False, "error": str(exc)}
        hooks = message.get("hooks") is True
        log.info(
            "process registered",
            extra={
                "job_id": reg.job_id,
                "group_id": reg.group,
                "pid": pid,
                "uid": uid,
                "hooks": hooks,
            },
        )
        reply: dict[str, Any] = {"ok": True, "pid": pid, "job_id": reg.job_id}
        if hooks:
            reply["_hooks_of"] = pid
        return reply

    def _bind(
        self, instance: object, *, job_id: str, group: str, pid: int, uid: int
    ) -> dict[str, Any]:
        if not isinstance(instance, str):
            return {"ok": False, "error": "channel_instance must be a string"}
        try:
            binding = self.registry.bind_channel(
                instance=instance, job_id=job_id, group=group, pid=pid, uid=uid
            )
        except RegistrationError as exc:
            return {"ok": False, "error": str(exc)}
        log.info(
            "workload channel bound",
            extra={"job_id": job_id, "group_id": group, "pid": pid, "uid": uid},
        )
        return {"ok": True, "pid": binding.pid, "job_id": binding.job_id}
