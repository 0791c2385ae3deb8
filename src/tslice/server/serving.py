"""What every tslice server process does the same way: one process per port and per state
directory, run until SIGTERM/SIGINT, and publish its address in a ready file once it
accepts calls.

gRPC servers set SO_REUSEPORT by default, so a second orchestrator started on a busy
port would start too and clients would alternate between two states; servers here
refuse a port in use instead. Likewise a state directory is locked (``flock``) for the
life of the process: two orchestrators or two agents never share one, and the kernel
drops the lock when the process dies, even by SIGKILL, so a restart just works.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import pathlib
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from tslice.common import errors, tasks
from tslice.security import identities, roles, tls
from tslice.server import gc_pauses

if TYPE_CHECKING:
    import grpc

#: ``serve(ready=..., stop=...)`` of the orchestrator or the agent, bound to its config.
Serve = Callable[[Callable[[str], None], asyncio.Event], Awaitable[None]]

#: Options every tslice gRPC server is created with: a port in use is refused.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.so_reuseport", 0),)

#: The lock file inside a state directory (holds the pid of the process that owns it).
LOCK_FILE = "tslice.lock"


class InUseError(errors.ConfigError):
    """A port or a state directory that another process holds."""


def default_state_dir(component: str) -> pathlib.Path:
    """Absolute default state directory of a long-running server (``orchestrator``, ``agent``).

    ``$XDG_STATE_HOME/tslice/<component>`` when that is set (absolute), else
    ``/var/lib/tslice/<component>`` for root (system services) and
    ``~/.local/state/tslice/<component>`` for anyone else. Never relative: a server must
    find its state again whatever directory it is started from.
    """
    xdg = os.environ.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        base = pathlib.Path(xdg)
    elif os.geteuid() == 0:
        return pathlib.Path("/var/lib/tslice") / component
    else:
        base = pathlib.Path.home() / ".local" / "state"
    return base / "tslice" / component


@contextlib.contextmanager
def locked_state_dir(state_dir: pathlib.Path, *, what: str) -> Iterator[None]:
    """Create ``state_dir`` and hold its lock until the block ends (or the process dies).

    ``what`` names the server ("orchestrator", "agent") in the error a second one gets.
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise errors.ConfigError(
            f"cannot use state directory {state_dir} ({err.strerror or err}); fix its "
            "permissions or choose another --state-dir"
        ) from err
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            by = f"pid {holder}" if holder else "another process"
            raise InUseError(
                f"state directory {state_dir} is in use by another {what} ({by}); stop it, "
                f"or give this {what} its own --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the lock; the file stays (unlinking it would race a waiter)


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_port(host: str, port: int) -> str:
    """``host:port`` with an IPv6 host in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` already (0 is never in use).

    Probed with a plain socket first so that the user sees our one-line error rather
    than gRPC's own log lines; the bind itself still has the last word.
    """
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # As servers do: connections in TIME_WAIT do not keep a restart off its port.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return True
    return False


def in_use_error(*, host: str, port: int, flag: str, what: str, off: bool = False) -> InUseError:
    """The error of a port in use, saying which and what to do."""
    hint = f"{flag} 0 = off" if off else f"{flag} 0 = any free port"
    return InUseError(
        f"cannot listen on {host_port(host, port)} ({what}): port {port} is in use; stop the "
        f"process that holds it or choose another {flag} ({hint})"
    )


def bind_grpc(
    grpc_server: grpc.aio.Server,
    *,
    host: str,
    port: int,
    what: str,
    server_tls: tls.ServerTLS | None = None,
    insecure: bool = False,
) -> int:
    """Bind ``grpc_server`` (made with :data:`SERVER_OPTIONS`) to ``host:port``; the port.

    With ``server_tls`` the port serves TLS (mutual TLS with a client CA); without it a
    non-loopback ``host`` is refused unless ``insecure`` (see :func:`tls.check_listen`).
    """
    tls.check_listen(host, tls=server_tls, insecure=insecure, what=what)
    if port_in_use(host, port):
        raise in_use_error(host=host, port=port, flag="--port", what=what)
    address = host_port(host, port)
    try:
        if server_tls is None:
            bound = int(grpc_server.add_insecure_port(address))
        else:
            bound = int(grpc_server.add_secure_port(address, server_tls.credentials()))
    except RuntimeError as err:
        raise InUseError(
            f"cannot listen on {host_port(host, port)} ({what}): {err}; stop the process that "
            "holds the port or choose another --port (--port 0 = any free port)"
        ) from err
    if bound == 0:
        raise in_use_error(host=host, port=port, flag="--port", what=what)
    return bound


def auth_interceptors(
    settings: identities.AuthSettings | None, rules: Mapping[str, roles.Rule], server: str
) -> list[roles.Interceptor]:
    """The interceptors of a server's gRPC port(s): none when authentication is off."""
    if settings is None:
        return []
    return [roles.Interceptor(settings.build(), rules, server=server)]


def transport_name(server_tls: tls.ServerTLS | None) -> str:
    """How a gRPC port is served, for a server's start line."""
    if server_tls is None:
        return "plaintext"
    return "mutual TLS" if server_tls.mutual else "TLS"


def metrics_bind_error(host: str, port: int, err: OSError) -> InUseError:
    """What a failed Prometheus bind becomes (its own error names no port)."""
    if err.errno == errno.EADDRINUSE:
        return in_use_error(host=host, port=port, flag="--metrics-port", what="metrics", off=True)
    return InUseError(
        f"cannot serve metrics on {host_port(host, port)} ({err.strerror or err}); choose "
        "another --metrics-port (--metrics-port 0 = off)"
    )


def write_ready_file(path: pathlib.Path, address: str) -> None:
    """Atomically publish ``{"address", "pid"}`` (tmp + rename): waiters never read half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    os.replace(tmp, path)


def run_until_signalled(serve: Serve, *, ready_file: pathlib.Path | None = None) -> None:
    """Run ``serve`` in a fresh event loop; SIGTERM/SIGINT set its stop event. The process
    is a server's own: its heap is frozen now and then (``gc_pauses``)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)

        def ready(address: str) -> None:
            if ready_file is not None:
                write_ready_file(ready_file, address)

        freezer = gc_pauses.from_environment()
        if freezer is not None:
            tasks.spawn(freezer.run(stop), name="gc-freeze")
        await serve(ready, stop)

    asyncio.run(main())
