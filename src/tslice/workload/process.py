"""Tell the node agent "this process belongs to job X" (for the cuda backend).

Each process of a job that holds GPU memory calls :func:`announce_process` once
at start-up. The agent learns the PID from the Unix socket's peer credentials,
so the call needs no PID and cannot register another process. Protocol: see
``tslice.agent.channel.registration`` (one JSON line each way).

Ranks that talk to each other (NCCL communicators, CUDA IPC) must be quiesced before
the agent locks them: pass ``quiesce=`` and ``resume=`` (see :func:`announce_process`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tslice.common import errors, validation

#: Environment variable naming the agent's registration socket.
SOCKET_ENV = "TSLICE_AGENT_REGISTER_SOCKET"
#: Where the socket is when neither ``socket_path`` nor the variable says otherwise.
DEFAULT_SOCKET_PATH = "/run/tslice/register.sock"
_MAX_REPLY = 4096
#: How long a process with hooks waits before announcing itself again to an agent that
#: went away (an agent restart loses its connections), seconds.
REANNOUNCE_S = 2.0

log = logging.getLogger(__name__)


class RegistrationError(errors.TsliceError):
    """The agent refused the registration or could not be reached; the message says why."""


def _resolve(socket_path: str | os.PathLike[str] | None) -> Path:
    if socket_path is not None:
        return Path(socket_path)
    env = os.environ.get(SOCKET_ENV)
    return Path(env) if env else Path(DEFAULT_SOCKET_PATH)


def announce_process(
    job_id: str,
    *,
    group: str = "",
    socket_path: str | os.PathLike[str] | None = None,
    timeout: float = 5.0,
    quiesce: Callable[[], None] | None = None,
    resume: Callable[[], None] | None = None,
) -> int:
    """Register the calling process with the node agent as part of ``job_id``.

    ``group`` names the group whose device state this process holds (the cuda backend
    then moves it only in that group's switches); without it, the agent matches the
    process to a group by the devices it holds memory on, where the topology names them.

    ``quiesce`` and ``resume`` are this process's hooks for the cuda backend, needed by
    jobs whose ranks talk to each other (NCCL, CUDA IPC): the agent calls ``quiesce``
    in every process of the job (all at once) before it locks any, and ``resume`` once
    every process is running again. ``quiesce`` must return only once this rank makes
    no CUDA call that waits for another rank (communicators suspended, e.g.
    ``ncclCommSuspend``, or the rank parked at a point that every rank reaches, such as
    the end of a step); raise to refuse the snapshot. The hooks run on a thread of
    their own; the registration's connection stays open for them (announced again
    every ``REANNOUNCE_S`` after the agent goes away).

    ``socket_path`` defaults to ``$TSLICE_AGENT_REGISTER_SOCKET``, then
    ``/run/tslice/register.sock``. Returns the PID the agent recorded (this
    process's, as the kernel reports it to the agent). Idempotent. Raises
    :class:`RegistrationError` if the agent refuses or cannot be reached.
    """
    try:
        validation.check_id("job_id", job_id)
    except validation.InvalidIdError as exc:
        raise RegistrationError(str(exc)) from exc
    request: dict[str, object] = {"job_id": job_id, "group": group}
    what = f"registration of job {job_id!r}"
    path = _resolve(socket_path)
    if quiesce is None and resume is None:
        return _exchange(request, path, timeout, what)
    hooks = _Hooks(quiesce=quiesce, resume=resume)
    sock, pid = _open_hooks({**request, "hooks": True}, path, timeout, what)
    threading.Thread(
        target=hooks.serve,
        args=(sock, lambda: _open_hooks({**request, "hooks": True}, path, timeout, what)[0]),
        name="tslice-process-hooks",
        daemon=True,
    ).start()
    return pid


class _Hooks:
    """Answers the agent's hook calls on the kept registration connection."""

    def __init__(
        self, *, quiesce: Callable[[], None] | None, resume: Callable[[], None] | None
    ) -> None:
        self._calls = {"quiesce": quiesce, "resume": resume}

    def serve(self, sock: socket.socket, reconnect: Callable[[], socket.socket]) -> None:
        while True:
            with contextlib.suppress(OSError), sock, sock.makefile("rwb") as stream:
                for line in stream:
                    stream.write(json.dumps(self._answer(line)).encode() + b"\n")
                    stream.flush()
            # The agent went away (restart): announce again once it is back.
            while True:
                time.sleep(REANNOUNCE_S)
                try:
                    sock = reconnect()
                except RegistrationError:
                    continue
                break

    def _answer(self, line: bytes) -> dict[str, object]:
        try:
            message = json.loads(line)
            request_id = message["id"]
            call = self._calls[message["call"]]
        except (ValueError, KeyError, TypeError) as exc:
            return {"ok": False, "error": f"unreadable hook call ({exc})"}
        if call is None:
            return {"id": request_id, "ok": True}
        try:
            call()
        except Exception as exc:  # told to the agent, which refuses the snapshot
            log.warning("tslice: a %s hook failed: %s", message["call"], exc)
            return {"id": request_id, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"id": request_id, "ok": True}


def _open_hooks(
    request: dict[str, object], path: Path, timeout: float, what: str
) -> tuple[socket.socket, int]:
    """A registration whose connection stays open; (the socket, the recorded PID)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        pid = _talk(sock, request, path, what)
        sock.settimeout(None)  # hook calls come whenever the agent moves the job
    except BaseException:
        sock.close()
        raise
    return sock, pid


def bind_channel(
    job_id: str,
    *,
    instance: str,
    group: str = "",
    socket_path: str | os.PathLike[str],
    timeout: float = 5.0,
) -> int:
    """Bind a workload channel's ``instance`` token to this process (for ``job_id``,
    ``group``) on the agent's register socket, so that the agent knows which process
    registers on its Unix socket (the kernel names it; see ``tslice.agent.channel.registration``).
    Returns the PID the agent recorded. Raises :class:`RegistrationError`."""
    request: dict[str, object] = {"job_id": job_id, "group": group, "channel_instance": instance}
    return _exchange(request, Path(socket_path), timeout, f"channel binding of job {job_id!r}")


def _exchange(request: dict[str, object], path: Path, timeout: float, what: str) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        return _talk(sock, request, path, what)


def _talk(sock: socket.socket, request: dict[str, object], path: Path, what: str) -> int:
    """Send one registration over ``sock`` and read the agent's answer; the PID."""
    line = json.dumps(request).encode() + b"\n"
    try:
        sock.connect(str(path))
        sock.sendall(line)
        reply = _read_line(sock)
    except FileNotFoundError as exc:
        raise RegistrationError(
            f"no agent registration socket at {path}; start the agent on this node, or pass "
            f"socket_path= / set {SOCKET_ENV} to the agent's <state_dir>/register.sock"
        ) from exc
    except OSError as exc:
        raise RegistrationError(f"cannot register with the agent at {path}: {exc}") from exc
    try:
        answer = json.loads(reply)
    except json.JSONDecodeError as exc:
        raise RegistrationError(f"the agent at {path} sent an unreadable reply {reply!r}") from exc
    if not isinstance(answer, dict) or not answer.get("ok"):
        detail = answer.get("error") if isinstance(answer, dict) else answer
        raise RegistrationError(f"the agent refused the {what}: {detail}")
    return int(answer["pid"])


def _read_line(sock: socket.socket) -> bytes:
    # Byte by byte: on a connection kept for hooks, the agent's first call may follow
    # the reply at once, and must not be read here.
    data = bytearray()
    while len(data) < _MAX_REPLY:
        byte = sock.recv(1)
        if not byte or byte == b"\n":
            break
        data += byte
    return bytes(data)
