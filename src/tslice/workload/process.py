"""Tell the node agent "this process belongs to job X" (for the cuda backend).

Each process of a job that holds GPU memory calls :func:`announce_process` once
at start-up. The agent learns the PID from the Unix socket's peer credentials,
so the call needs no PID and cannot register another process. Protocol: see
``tslice.agent.registration`` (one JSON line each way).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from tslice.common import errors, ids

#: Environment variable naming the agent's registration socket.
SOCKET_ENV = "TSLICE_AGENT_REGISTER_SOCKET"
#: Where the socket is when neither ``socket_path`` nor the variable says otherwise.
DEFAULT_SOCKET_PATH = "/run/tslice/register.sock"
_MAX_REPLY = 4096


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
) -> int:
    """Register the calling process with the node agent as part of ``job_id``.

    ``group`` names the group whose device state this process holds (the cuda backend
    then moves it only in that group's switches); without it, the agent matches the
    process to a group by the devices it holds memory on, where the topology names them.

    ``socket_path`` defaults to ``$TSLICE_AGENT_REGISTER_SOCKET``, then
    ``/run/tslice/register.sock``. Returns the PID the agent recorded (this
    process's, as the kernel reports it to the agent). Idempotent. Raises
    :class:`RegistrationError` if the agent refuses or cannot be reached.
    """
    try:
        ids.check_id("job_id", job_id)
    except ids.InvalidIdError as exc:
        raise RegistrationError(str(exc)) from exc
    request = {"job_id": job_id, "group": group}
    return _exchange(request, _resolve(socket_path), timeout, f"registration of job {job_id!r}")


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
    registers on its Unix socket (the kernel names it; see ``tslice.agent.registration``).
    Returns the PID the agent recorded. Raises :class:`RegistrationError`."""
    request = {"job_id": job_id, "group": group, "channel_instance": instance}
    return _exchange(request, Path(socket_path), timeout, f"channel binding of job {job_id!r}")


def _exchange(request: dict[str, str], path: Path, timeout: float, what: str) -> int:
    line = json.dumps(request).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
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
    data = b""
    while b"\n" not in data and len(data) < _MAX_REPLY:
        chunk = sock.recv(_MAX_REPLY)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]
