"""A Kubernetes API-server emulator on loopback, for tests that run a real client library.

No kube-apiserver binary can be installed from the registries CI reaches, and ``kmock``
(PyPI, 0.8) serves lists without a real resourceVersion, has no selectors, bookmarks,
410 Gone or conflicts, so this is a small one: real HTTP/1.1 (the stdlib threading
server), JSON, the paths of ``/api/v1`` and ``/apis/<group>/<version>`` for nodes, pods,
configmaps and leases (tests/kube/apistore.py), and:

- get, list (``labelSelector``, ``fieldSelector``, pages by ``limit`` and ``continue``;
  the list's resourceVersion);
- watch (``?watch=true``): from ``resourceVersion`` (absent or "0": the current objects
  as ADDED first), ``allowWatchBookmarks`` (a BOOKMARK on :meth:`bookmark`),
  ``timeoutSeconds``, an ERROR event with a 410 Status for a compacted version;
- create (409 AlreadyExists), update and patch (merge, strategic-as-merge, JSON patch;
  409 Conflict on a stale ``metadata.resourceVersion``), delete;
- faults a test triggers: :meth:`close_watches` (the server ends every watch cleanly),
  :meth:`drop_watches` (connections cut mid-stream), :meth:`expire_watches` (history
  compacted, open watches told 410 Gone), :meth:`refuse` (the next requests answer 500),
  :meth:`stall` (one client's requests of one kind hang until :meth:`unstall`: an API
  server slow for that client alone, e.g. a leader whose Lease renewals do not get
  through while another replica's do).

Each kubeconfig names its user (:meth:`write_kubeconfig`): a request's user is the one
whose token it carries.

Every request is recorded in :attr:`requests` (method, path, query) for assertions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.kube import apistore
from tests.kube.apistore import ApiFailure, Obj

#: Longest wait of a watch between checks of the server's stop flag, seconds.
_WAKE_S = 1.0


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    #: Whose token the request carried (see :meth:`ApiServerEmulator.write_kubeconfig`).
    user: str = ""


_TOKEN_PREFIX = "emulator-token-"


@dataclasses.dataclass(frozen=True)
class _Target:
    plural: str
    namespace: str | None  # None: all namespaces (or a cluster-scoped kind)
    name: str | None


def _parse_path(path: str) -> _Target:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        rest = parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        rest = parts[3:]
    else:
        raise ApiFailure(404, "NotFound", f"the server could not find {path}")
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if rest and rest[-1] == "status" and len(rest) == 3:
        rest = rest[:2]  # the status subresource: the object itself here
    if not rest or len(rest) > 2 or rest[0] not in apistore.KINDS:
        raise ApiFailure(404, "NotFound", f"the server could not find {path}")
    kind = apistore.KINDS[rest[0]]
    if kind.namespaced and namespace is None and len(rest) == 2:
        raise ApiFailure(404, "NotFound", f"{rest[0]} are namespaced: {path}")
    return _Target(
        rest[0], namespace if kind.namespaced else None, rest[1] if len(rest) == 2 else None
    )


class _Watch:
    """What a watch saw of the emulator's fault counters when it started."""

    def __init__(self, emulator: ApiServerEmulator) -> None:
        self.closes = emulator._closes
        self.drops = emulator._drops
        self.expiries = emulator._expiries
        self.bookmarks = emulator._bookmarks


class ApiServerEmulator:
    """``with ApiServerEmulator() as api:`` serves on ``api.url`` until the block ends."""

    def __init__(self) -> None:
        self.store = apistore.Store()
        self.requests: list[Request] = []
        self._closes = self._drops = self._expiries = self._bookmarks = 0
        self._refusals = 0
        #: (user, plural) whose requests hang until unstalled.
        self._stalls: set[tuple[str, str]] = set()
        #: Watches being served now.
        self._open_watches = 0
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> ApiServerEmulator:
        handler = type("Handler", (_Handler,), {"emulator": self})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="apiserver",
            daemon=True,
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.store.changed:
            self._stopping = True
            self.store.changed.notify_all()
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def write_kubeconfig(
        self, path: pathlib.Path, *, namespace: str = "default", user: str = "tester"
    ) -> pathlib.Path:
        """A kubeconfig whose current context points at this emulator (a bearer token
        naming ``user``)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": user, "user": {"token": f"{_TOKEN_PREFIX}{user}"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": user, "namespace": namespace},
                }
            ],
            "current-context": "emulator",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # ---- faults a test triggers ---------------------------------------------------------

    def _bump(self, counter: str) -> None:
        with self.store.changed:
            setattr(self, counter, getattr(self, counter) + 1)
            self.store.changed.notify_all()

    def close_watches(self) -> None:
        """The server ends every open watch cleanly (as at its timeout)."""
        self._bump("_closes")

    def drop_watches(self) -> None:
        """Every open watch's connection is cut mid-stream (no final chunk)."""
        self._bump("_drops")

    def expire_watches(self) -> None:
        """Compact the history and tell every open watch 410 Gone."""
        self.store.compact()
        self._bump("_expiries")

    def bookmark(self) -> None:
        """Every open watch that allowed bookmarks gets a BOOKMARK at the current version."""
        self._bump("_bookmarks")

    def refuse(self, count: int) -> None:
        """The next ``count`` requests are answered 500 (an API server in trouble); 0
        ends it."""
        with self.store.changed:
            self._refusals = count

    def stall(self, user: str, plural: str) -> None:
        """Requests of ``user`` on ``plural`` (e.g. "leases") hang from now until
        :meth:`unstall` (or the emulator stops); their clients time out as they would."""
        with self.store.changed:
            self._stalls.add((user, plural))

    def unstall(self) -> None:
        """Every stalled request goes on."""
        with self.store.changed:
            self._stalls.clear()
            self.store.changed.notify_all()

    def wait_unless_stalled(self, user: str, plural: str) -> None:
        with self.store.changed:
            self.store.changed.wait_for(
                lambda: self._stopping or (user, plural) not in self._stalls
            )

    def wait_for_watches(self, count: int, timeout_s: float = 10.0) -> None:
        """Until at least ``count`` watches are open (a fault sent before would miss them)."""
        with self.store.changed:
            if not self.store.changed.wait_for(lambda: self._open_watches >= count, timeout_s):
                raise AssertionError(f"{self._open_watches} watches open, not {count}")

    def watch_requests(self, plural: str) -> list[Request]:
        return [r for r in list(self.requests) if r.query.get("watch") and plural in r.path]

    # ---- helpers for tests (the same code path as HTTP writes) ----------------------------

    def apply(self, obj: Obj) -> Obj:
        """Create ``obj``, or replace the object of its name (whatever its version)."""
        kind = next(k for k in apistore.KINDS.values() if k.kind == obj["kind"])
        meta = obj["metadata"]
        namespace = meta.get("namespace", "default") if kind.namespaced else ""
        try:
            return self.store.create(kind.plural, namespace, obj)
        except ApiFailure as err:
            if err.code != 409:
                raise
        return self.store.update(kind.plural, namespace, meta["name"], obj)

    # ---- serving (called by the handler) ------------------------------------------------

    def take_refusal(self) -> bool:
        with self.store.changed:
            if self._refusals > 0:
                self._refusals -= 1
                return True
            return False

    def watch_lines(self, target: _Target, query: dict[str, str]) -> Iterator[bytes | None]:
        """The lines of a watch; ``None`` means "cut the connection now"."""
        store = self.store
        selects = _selects(query)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(query.get("timeoutSeconds") or 0)
        deadline = time.monotonic() + timeout if timeout > 0 else None
        since = query.get("resourceVersion") or "0"
        with store.changed:
            seen = _Watch(self)
            self._open_watches += 1
            store.changed.notify_all()
        try:
            yield from self._watch_lines(
                target, selects, seen, since=since, bookmarks=bookmarks, deadline=deadline
            )
        finally:
            with store.changed:
                self._open_watches -= 1

    def _watch_lines(
        self,
        target: _Target,
        selects: apistore.Predicate,
        seen: _Watch,
        *,
        since: str,
        bookmarks: bool,
        deadline: float | None,
    ) -> Iterator[bytes | None]:
        store = self.store
        with store.changed:
            if since == "0":
                version, items = store.list(target.plural, target.namespace, selects)
                pending = [_line("ADDED", o) for o in items]
            else:
                version = int(since)
                try:
                    changes = store.changes_after(version)
                except ApiFailure as err:
                    yield _line("ERROR", err.status())
                    return
                pending = [
                    _line(t, o)
                    for t, o in apistore.matching(changes, target.plural, target.namespace, selects)
                ]
                version = changes[-1].version if changes else version
        while True:
            yield from pending
            pending = []
            with store.changed:
                while True:
                    if self._stopping or seen.closes != self._closes:
                        return
                    if seen.drops != self._drops:
                        yield None
                        return
                    if seen.expiries != self._expiries:
                        yield _line("ERROR", apistore.gone(version).status())
                        return
                    if deadline is not None and time.monotonic() >= deadline:
                        return
                    try:
                        changes = store.changes_after(version)
                    except ApiFailure as err:
                        yield _line("ERROR", err.status())
                        return
                    if changes:
                        version = changes[-1].version
                        pending = [
                            _line(t, o)
                            for t, o in apistore.matching(
                                changes, target.plural, target.namespace, selects
                            )
                        ]
                        if pending:
                            break
                        continue
                    if seen.bookmarks != self._bookmarks:
                        seen.bookmarks = self._bookmarks
                        if bookmarks:
                            pending = [_bookmark(target.plural, store.version)]
                            version = store.version
                            break
                        continue
                    wait = (
                        _WAKE_S if deadline is None else min(_WAKE_S, deadline - time.monotonic())
                    )
                    store.changed.wait(max(wait, 0.0))


def _selects(query: dict[str, str]) -> apistore.Predicate:
    labels = apistore.label_selector(query.get("labelSelector"))
    fields = apistore.field_selector(query.get("fieldSelector"))
    return lambda obj: labels(obj) and fields(obj)


def _line(type_: str, obj: Obj) -> bytes:
    return json.dumps({"type": type_, "object": obj}).encode() + b"\n"


def _bookmark(plural: str, version: int) -> bytes:
    kind = apistore.KINDS[plural]
    obj = {
        "kind": kind.kind,
        "apiVersion": kind.api_version,
        "metadata": {"resourceVersion": str(version)},
    }
    return _line("BOOKMARK", obj)


class _Handler(BaseHTTPRequestHandler):
    emulator: ApiServerEmulator
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        emu = self.emulator
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
        user = token.removeprefix(_TOKEN_PREFIX)
        emu.requests.append(Request(method, url.path, query, user))
        try:
            if emu.take_refusal():
                raise ApiFailure(500, "InternalError", "the emulator was told to refuse")
            target = _parse_path(url.path)
            emu.wait_unless_stalled(user, target.plural)
            if method == "GET" and target.name is None and query.get("watch") in ("true", "1"):
                self._stream(emu.watch_lines(target, query))
                return
            self._send(200 if method != "POST" else 201, self._answer(method, target, query, body))
        except ApiFailure as err:
            self._send(err.code, err.status())

    def _answer(self, method: str, t: _Target, query: dict[str, str], body: Any) -> Obj:
        store = self.emulator.store
        namespace = t.namespace or ""
        if method == "GET" and t.name is None:
            version, items = store.list(t.plural, t.namespace, _selects(query))
            kind = apistore.KINDS[t.plural]
            meta: Obj = {"resourceVersion": str(version)}
            # Pages: ``limit`` and the ``continue`` token (here: the version and an offset).
            if query.get("continue"):
                token_version, offset = (int(p) for p in query["continue"].split(":"))
                meta["resourceVersion"] = str(token_version)
                items = items[offset:]
            else:
                token_version, offset = version, 0
            limit = int(query.get("limit") or 0)
            if 0 < limit < len(items):
                items = items[:limit]
                meta["continue"] = f"{token_version}:{offset + limit}"
            return {
                "kind": f"{kind.kind}List",
                "apiVersion": kind.api_version,
                "metadata": meta,
                "items": items,
            }
        if method == "POST" and t.name is None:
            return store.create(t.plural, namespace, body)
        if t.name is None:
            raise ApiFailure(405, "MethodNotAllowed", f"{method} needs an object name")
        if method == "GET":
            return store.get(t.plural, namespace, t.name)
        if method == "PUT":
            return store.update(t.plural, namespace, t.name, body)
        if method == "PATCH":
            content_type = self.headers.get("Content-Type", "")
            return store.patch(t.plural, namespace, t.name, body, content_type)
        if method == "DELETE":
            return store.delete(t.plural, namespace, t.name)
        raise ApiFailure(405, "MethodNotAllowed", f"{method} is not served")

    def _send(self, code: int, obj: Obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:
            # The client left first (a chaos test SIGKILLs it): as for an API server,
            # nobody is left to answer, and that is no error of the server's.
            self.close_connection = True

    def _stream(self, lines: Iterator[bytes | None]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for line in lines:
                if line is None:  # cut: no final chunk, the client sees a broken stream
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away
