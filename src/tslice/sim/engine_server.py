"""A real local HTTP server that speaks the vLLM and SGLang sleep/wake dialects.

It is the shipped test double of the ``app-endpoint`` backend (and usable by the demo): a
``ThreadingHTTPServer`` on 127.0.0.1 with an ephemeral port that

* answers exactly the requests of WIRE.md "Engine HTTP dialects" (plus vLLM's
  ``GET /is_sleeping`` and ``GET /health``), with the idempotency rules of the real engines:
  vLLM ignores ``/sleep`` while asleep (even partly) and ``/wake_up`` while awake, and ignores a
  wake whose tags are not all asleep; SGLang releases/resumes the given tags (all if none);
* tracks simulated memory per tag: which tags are resident on the device, how many bytes that
  is, and how many bytes are kept in host memory (vLLM level 1 and SGLang with weights CPU
  backup keep the weights; vLLM level 2 keeps nothing);
* records every request (method, path, query, body, content type) and counts TCP connections;
* injects faults: an error status, a delay, a dropped connection, a gate the test opens, for
  the next N requests (optionally of one path only), with or without the state change.

Like a real engine it does one memory operation at a time: a delayed request holds the engine,
so a request sent after a timed-out one waits behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Literal

log = logging.getLogger(__name__)

Dialect = Literal["vllm", "sglang"]
DEFAULT_MEMORY_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it."""

    method: str
    #: The request target exactly as sent (path and query string).
    target: str
    path: str
    query: tuple[tuple[str, str], ...]
    body: bytes
    content_type: str | None

    def json(self) -> Any:
        return json.loads(self.body)


@dataclasses.dataclass
class _Fault:
    status: int | None
    body: str
    delay_s: float
    gate: threading.Event | None
    drop: bool
    apply: bool
    path: str | None
    headers: Mapping[str, str]
    remaining: int


@dataclasses.dataclass(frozen=True)
class _Reply:
    status: int
    payload: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


class EngineServer:
    """A fake inference engine on ``http://127.0.0.1:<port>``; use as a context manager.

    ``tags`` are the engine's memory kinds and their device bytes (default: ``memory_bytes``
    split evenly between ``weights`` and ``kv_cache``). All tags start resident. With
    ``base_path`` (e.g. ``/engine0``) the engine answers under that prefix only, like a server
    behind a path-routing proxy.
    """

    def __init__(
        self,
        *,
        dialect: Dialect,
        memory_bytes: int | None = None,
        tags: Mapping[str, int] | None = None,
        weights_cpu_backup: bool = True,
        base_path: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if dialect not in ("vllm", "sglang"):
            raise ValueError(f"dialect must be 'vllm' or 'sglang', not {dialect!r}")
        if tags is None:
            total = DEFAULT_MEMORY_BYTES if memory_bytes is None else memory_bytes
            tags = {"weights": total // 2, "kv_cache": total - total // 2}
        elif memory_bytes is not None and memory_bytes != sum(tags.values()):
            raise ValueError("memory_bytes must equal the sum of the tag sizes (or be omitted)")
        if any(size < 0 for size in tags.values()):
            raise ValueError("tag sizes must be >= 0 bytes")
        self.dialect: Dialect = dialect
        self.tag_bytes: dict[str, int] = dict(tags)
        self.weights_cpu_backup = weights_cpu_backup
        self.base_path = base_path.rstrip("/")
        self._lock = threading.Condition()  # guards everything below
        self._engine = threading.Lock()  # one memory operation at a time, like a real engine
        self._resident: set[str] = set(self.tag_bytes)
        self._host: dict[str, int] = {}
        self._requests: list[RecordedRequest] = []
        self._faults: list[_Fault] = []
        self._gates: list[threading.Event] = []
        self._connections = 0
        self._open_sockets: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._httpd = _HTTPServer((host, port), _Handler, engine=self)
        self._thread: threading.Thread | None = None

    # -- lifecycle

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else host
        return f"http://[{text}]:{port}" if ":" in text else f"http://{text}:{port}"

    def start(self) -> EngineServer:
        if self._thread is None:
            # A short poll interval: stop() returns that much sooner (the stdlib default is 0.5 s).
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.02},
                name=f"engine-server-{self.dialect}",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; held and delayed requests are released, open connections closed."""
        self._stopping.set()
        with self._lock:
            for gate in self._gates:
                gate.set()
            sockets = list(self._open_sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self._httpd.join_handlers(timeout=5.0)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        with self._lock:
            return self._connections

    @property
    def resident_tags(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._resident)

    @property
    def device_bytes(self) -> int:
        with self._lock:
            return sum(self.tag_bytes[t] for t in self._resident)

    @property
    def host_bytes(self) -> int:
        with self._lock:
            return sum(self._host.values())

    @property
    def is_sleeping(self) -> bool:
        """True while any tag is off the device (vLLM's definition)."""
        with self._lock:
            return self._resident != set(self.tag_bytes)

    def wait_for_requests(self, count: int, *, timeout: float) -> bool:
        """Block until ``count`` requests have arrived (True) or ``timeout`` passed (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._requests) >= count, timeout=timeout)

    # -- fault injection

    def inject_fault(
        self,
        *,
        status: int | None = None,
        body: str = "injected fault",
        delay_s: float = 0.0,
        gate: threading.Event | None = None,
        drop: bool = False,
        apply: bool = False,
        path: str | None = None,
        headers: Mapping[str, str] | None = None,
        count: int = 1,
    ) -> None:
        """Apply a fault to the next ``count`` requests (to ``path`` only, if given).

        ``gate``: the request waits until the event is set (or the server stops).
        ``delay_s``: the engine takes that long (holding the engine) before it acts.
        ``status``: answer with that status and ``body`` instead of the normal answer.
        ``drop``: close the connection without any answer.
        ``apply``: with ``status`` or ``drop``, change the memory state anyway (the engine
        did the work but the answer was lost); by default the state is left alone.
        ``headers``: extra response headers with ``status`` (e.g. a redirect's Location).
        ``path`` is the full request path, base path included.
        """
        if count < 1:
            raise ValueError("count must be >= 1")
        with self._lock:
            self._faults.append(
                _Fault(status, body, delay_s, gate, drop, apply, path, dict(headers or {}), count)
            )
            if gate is not None:
                self._gates.append(gate)
                if self._stopping.is_set():
                    gate.set()

    # -- request handling (called from handler threads)

    def _on_connection(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections += 1
            self._open_sockets.add(sock)

    def _on_disconnect(self, sock: socket.socket) -> None:
        with self._lock:
            self._open_sockets.discard(sock)

    def _record(self, request: RecordedRequest) -> _Fault | None:
        with self._lock:
            self._requests.append(request)
            self._lock.notify_all()
            for fault in self._faults:
                if fault.remaining > 0 and fault.path in (None, request.path):
                    fault.remaining -= 1
                    return fault
            return None

    def _serve(self, request: RecordedRequest) -> _Reply | None:
        """Handle one request; ``None`` means drop the connection without an answer."""
        fault = self._record(request)
        if fault is not None and fault.gate is not None:
            fault.gate.wait()
        with self._engine:
            if fault is not None and fault.delay_s > 0:
                self._stopping.wait(fault.delay_s)
            if fault is not None and (fault.status is not None or fault.drop):
                if fault.apply:
                    self._dispatch(request)
                if fault.drop:
                    return None
                assert fault.status is not None
                return _Reply(fault.status, {"error": fault.body}, fault.headers)
            return self._dispatch(request)

    def _dispatch(self, request: RecordedRequest) -> _Reply:
        routes = _VLLM_ROUTES if self.dialect == "vllm" else _SGLANG_ROUTES
        path = request.path
        if self.base_path:
            inside = path.startswith(self.base_path + "/")
            path = path[len(self.base_path) :] if inside else ""
        route = routes.get(path)
        if route is None:
            if path == "/health" and request.method == "GET":
                return _Reply(200)
            return _Reply(404, {"detail": "Not Found"})
        method, handler = route
        if request.method != method:
            return _Reply(405, {"detail": "Method Not Allowed"})
        return handler(self, request)

    # vLLM --------------------------------------------------------------------------------

    def _vllm_sleep(self, request: RecordedRequest) -> _Reply:
        levels = [v for k, v in request.query if k == "level"] or ["1"]
        if levels[-1] not in ("1", "2"):
            return _Reply(400, {"detail": f"invalid sleep level {levels[-1]!r}"})
        with self._lock:
            if self._resident != set(self.tag_bytes):
                return _Reply(200, self._bytes(freed=0))  # vLLM: "already sleeping", no-op
            kept = {"weights"} if levels[-1] == "1" else set()
            freed = self._release(set(self.tag_bytes), keep_on_host=kept)
            return _Reply(200, self._bytes(freed=freed))

    def _vllm_wake_up(self, request: RecordedRequest) -> _Reply:
        tags = [v for k, v in request.query if k == "tags"]
        with self._lock:
            asleep = set(self.tag_bytes) - self._resident
            if not asleep or any(t not in asleep for t in tags):
                return _Reply(200, self._bytes(restored=0))  # vLLM logs a warning, no-op
            restored = self._resume(set(tags) if tags else asleep)
            return _Reply(200, self._bytes(restored=restored))

    def _vllm_is_sleeping(self, request: RecordedRequest) -> _Reply:
        return _Reply(200, {"is_sleeping": self.is_sleeping})

    # SGLang ------------------------------------------------------------------------------

    def _sglang_tags(self, request: RecordedRequest) -> list[str] | _Reply:
        if (request.content_type or "").split(";")[0].strip().lower() != "application/json":
            return _Reply(422, {"detail": "expected a JSON body (Content-Type: application/json)"})
        try:
            body = request.json()
        except ValueError:
            return _Reply(422, {"detail": "body is not valid JSON"})
        if not isinstance(body, dict):
            return _Reply(422, {"detail": "body must be a JSON object"})
        tags = body.get("tags")
        if tags is None:
            return list(self.tag_bytes)
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            return _Reply(422, {"detail": "tags must be a list of strings"})
        return tags or list(self.tag_bytes)

    def _sglang_release(self, request: RecordedRequest) -> _Reply:
        tags = self._sglang_tags(request)
        if isinstance(tags, _Reply):
            return tags
        with self._lock:
            kept = {"weights"} if self.weights_cpu_backup else set()
            freed = self._release(set(tags), keep_on_host=kept)
            return _Reply(200, {"success": True, **self._bytes(freed=freed)})

    def _sglang_resume(self, request: RecordedRequest) -> _Reply:
        tags = self._sglang_tags(request)
        if isinstance(tags, _Reply):
            return tags
        with self._lock:
            restored = self._resume(set(tags))
            return _Reply(200, {"success": True, **self._bytes(restored=restored)})

    # memory bookkeeping (callers hold self._lock) ----------------------------------------

    def _release(self, tags: set[str], *, keep_on_host: set[str]) -> int:
        going = tags & self._resident  # unknown or already released tags: nothing to do
        for tag in going:
            self._resident.discard(tag)
            if tag in keep_on_host:
                self._host[tag] = self.tag_bytes[tag]
        return sum(self.tag_bytes[t] for t in going)

    def _resume(self, tags: set[str]) -> int:
        coming = (tags & set(self.tag_bytes)) - self._resident
        for tag in coming:
            self._resident.add(tag)
            self._host.pop(tag, None)
        return sum(self.tag_bytes[t] for t in coming)

    def _bytes(self, *, freed: int | None = None, restored: int | None = None) -> dict[str, int]:
        payload = {"host_bytes": sum(self._host.values())}
        if freed is not None:
            payload["freed_bytes"] = freed
        if restored is not None:
            payload["restored_bytes"] = restored
        return payload


_Route = tuple[str, Callable[[EngineServer, RecordedRequest], _Reply]]
_VLLM_ROUTES: dict[str, _Route] = {
    "/sleep": ("POST", EngineServer._vllm_sleep),
    "/wake_up": ("POST", EngineServer._vllm_wake_up),
    "/is_sleeping": ("GET", EngineServer._vllm_is_sleeping),
}
_SGLANG_ROUTES: dict[str, _Route] = {
    "/release_memory_occupation": ("POST", EngineServer._sglang_release),
    "/resume_memory_occupation": ("POST", EngineServer._sglang_resume),
}


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[http.server.BaseHTTPRequestHandler],
        *,
        engine: EngineServer,
    ) -> None:
        self.engine = engine
        self._handlers: list[threading.Thread] = []
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Mirrors ThreadingMixIn.process_request but keeps the threads so stop() can join them.
        self.engine._on_connection(request)
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), daemon=True
        )
        self._handlers.append(thread)
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        self.engine._on_disconnect(request)
        super().shutdown_request(request)

    def join_handlers(self, *, timeout: float) -> None:
        for thread in self._handlers:
            thread.join(timeout)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn; every reply has a Content-Length
    server: _HTTPServer
    timeout = 60  # an idle keep-alive connection does not pin a thread forever
    # Headers and body go out in two writes; with Nagle each reply would wait ~40 ms for the
    # client's delayed ACK.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        # The raw target from the request line: the stdlib collapses a leading "//" in
        # self.path, which would hide a client bug that a real engine answers with 404.
        target = self.requestline.split(" ")[1]
        raw_path, _, raw_query = target.partition("?")
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        request = RecordedRequest(
            method=self.command,
            target=target,
            path=urllib.parse.unquote(raw_path),
            query=tuple(urllib.parse.parse_qsl(raw_query, keep_blank_values=True)),
            body=body,
            content_type=self.headers.get("Content-Type"),
        )
        reply = self.server.engine._serve(request)
        if reply is None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        data = b"" if reply.payload is None else json.dumps(reply.payload).encode()
        try:
            self.send_response(reply.status)
            if reply.payload is not None:
                self.send_header("Content-Type", "application/json")
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client gave up (timeout) before the engine answered; so would uvicorn.
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("engine-server: " + format, *args)
