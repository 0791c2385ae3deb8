"""A loopback TCP forwarder a test can cut: every connection through it ends at once, as
when a peer's network goes away (the workload-channel tests cut a workload's link)."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    """Loopback TCP forwarder in front of an address; :meth:`cut` ends every connection
    through it at once (both ends see the connection close), :meth:`refuse` makes new
    ones close at once too, :meth:`reopen` lets them through again."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Condition()
        self._live: list[socket.socket] = []
        self._refusing = False
        #: Connections forwarded so far (the workload's reconnects show here).
        self.connections = 0
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    def refuse(self) -> None:
        with self._lock:
            self._refusing = True

    def reopen(self) -> None:
        with self._lock:
            self._refusing = False

    def wait_connections(self, count: int, timeout: float) -> bool:
        """Block until ``count`` connections were forwarded; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self.connections >= count, timeout)

    def cut(self) -> None:
        with self._lock:
            live, self._live = self._live, []
        for sock in live:
            _shut(sock)

    def close(self) -> None:
        self.refuse()
        self._listener.close()
        self.cut()
        self._thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refusing = self._refusing
            if refusing:
                _shut(client)
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                _shut(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._live += [client, upstream]
                self.connections += 1
                self._lock.notify_all()
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _shut(src)
    _shut(dst)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
