"""Real servers for the client tests (a helper module, not a test module).

:class:`Servers` runs real agents and a real orchestrator with their own ``serve()`` on
an event loop in a background thread, bound to 127.0.0.1:0, so that blocking clients
call them from the test thread and async clients from the test's loop, over real
sockets. Readiness is each server's own ``ready`` callback (its address, once serving).

The orchestrator's servicer may be :class:`Scripted`: the real servicer (its lock, its
Session stream, its refusals) with only what a real server cannot be made to do on
demand added, for the tests of the client's transport:

- fail the next calls of a method with a given status (``fail_next``), as a restarting
  or broken server would; a scripted UNAVAILABLE runs nothing, as a follower or a dead
  socket;
- lose the reply of a call whose effect happened (``lose_reply``): the connection
  broke after the orchestrator acted;
- have no ``Session`` and no ``AcquireSet`` RPC (``llm_d=True``), as llm-d's
  orchestrator: the client then takes llm-d's unary calls, and slices their groups one
  by one.

It also records every Acquire and Yield (by either path), the metadata of every call,
and the Session streams opened, so that tests see what went over the wire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import pathlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

import tslice
from tslice.agent import app as agent_app
from tslice.agent import config as agent_config
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import app as orch_app
from tslice.orchestrator import config as orch_config
from tslice.orchestrator import server as orch_server

#: Small fast simulated devices: a switch takes milliseconds.
FAST_SIM: dict[str, Any] = {"capacity": "4GiB", "bandwidth": "2TB/s", "latency_s": 0.001}
QUEUED = opb.OrchestratorEvent.KIND_QUEUED


@dataclasses.dataclass(frozen=True)
class Call:
    """One Acquire or Yield the orchestrator received (``via``: "unary" or "session"),
    or another unary call (``via`` "unary")."""

    method: str
    job_id: str
    group_id: str
    via: str
    footprint_bytes: int = 0


class Script:
    """What :class:`Scripted` does beyond the real servicer, and what it saw (thread-safe:
    the servers' loop writes, the test reads)."""

    def __init__(self, *, llm_d: bool = False) -> None:
        self.llm_d = llm_d
        self.calls: list[Call] = []
        #: The metadata of every unary call and Session stream, in order.
        self.metadata: list[dict[str, str]] = []
        self.sessions = 0
        #: Session streams refused as unimplemented (``llm_d``).
        self.sessions_refused = 0
        self._failures: dict[str, collections.deque[tuple[grpc.StatusCode, str]]] = (
            collections.defaultdict(collections.deque)
        )
        self._lost: dict[str, collections.deque[grpc.StatusCode]] = collections.defaultdict(
            collections.deque
        )
        self._guard = threading.Lock()

    def fail_next(self, method: str, code: grpc.StatusCode, details: str, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` (either path) fail with ``code``; nothing runs."""
        with self._guard:
            self._failures[method].extend([(code, details)] * times)

    def lose_reply(self, method: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """The next call of ``method`` takes effect, then its reply is lost: the call (or
        its Session stream) ends with ``code``, as a connection reset there does."""
        with self._guard:
            self._lost[method].append(code)

    def calls_of(self, method: str) -> list[Call]:
        with self._guard:
            return [call for call in self.calls if call.method == method]

    def _record(self, call: Call) -> tuple[grpc.StatusCode, str] | None:
        with self._guard:
            self.calls.append(call)
            return self._failures[call.method].popleft() if self._failures[call.method] else None

    def _loses(self, method: str) -> grpc.StatusCode | None:
        with self._guard:
            return self._lost[method].popleft() if self._lost[method] else None

    def _saw(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        with self._guard:
            self.metadata.append(dict(context.invocation_metadata() or ()))


#: A Session reply's field -> the method it answers.
_REPLIES = {"acquire": "Acquire", "release": "Yield", "acquire_set": "AcquireSet"}


class Scripted(orch_server.OrchestratorServicer):
    """The real orchestrator servicer with a :class:`Script` (see the module docstring)."""

    script = Script()

    def _call(self, method: str, request: Any, via: str) -> tuple[grpc.StatusCode, str] | None:
        """Record the call; the failure scripted for it, if any."""
        return self.script._record(
            Call(
                method,
                getattr(request, "job_id", ""),
                getattr(request, "group_id", ""),
                via,
                getattr(request, "footprint_bytes", 0),
            )
        )

    async def _unary(self, method: str, request: Any, context: Any, handler: Any) -> Any:
        self.script._saw(context)
        failure = self._call(method, request, "unary")
        if failure is not None:
            await context.abort(*failure)
        reply = await handler(request, context)
        lost = self.script._loses(method)
        if lost is not None:
            await context.abort(lost, "connection reset (reply lost)")
        return reply

    async def Acquire(self, request: Any, context: Any) -> Any:
        return await self._unary("Acquire", request, context, super().Acquire)

    async def Yield(self, request: Any, context: Any) -> Any:
        return await self._unary("Yield", request, context, super().Yield)

    async def AcquireSet(self, request: Any, context: Any) -> Any:
        if self.script.llm_d:
            self._call("AcquireSet", request, "unary")
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return await self._unary("AcquireSet", request, context, super().AcquireSet)

    async def ListGroups(self, request: Any, context: Any) -> Any:
        return await self._unary("ListGroups", request, context, super().ListGroups)

    async def GetGroupStatus(self, request: Any, context: Any) -> Any:
        return await self._unary("GetGroupStatus", request, context, super().GetGroupStatus)

    async def Session(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        if self.script.llm_d:
            with self.script._guard:
                self.script.sessions_refused += 1
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.script._saw(context)
        with self.script._guard:
            self.script.sessions += 1
        async for reply in super().Session(request_iterator, context):
            answered = next((m for f, m in _REPLIES.items() if reply.HasField(f)), "")
            lost = self.script._loses(answered) if answered else None
            if lost is not None:
                # The request took effect; its reply goes down with the stream.
                await context.abort(lost, "connection reset (reply lost)")
            yield reply

    def _session_start(self, request: opb.SessionRequest) -> Awaitable[Any]:
        kind = request.WhichOneof("call")
        method = _REPLIES.get(kind or "", "")
        failure = self._call(method, getattr(request, kind or ""), "session") if method else None
        if failure is None:
            return super()._session_start(request)
        failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        failed.set_exception(_ScriptedFailure(*failure))
        return failed

    @staticmethod
    def _session_answer(request: opb.SessionRequest, done: asyncio.Future[Any]) -> Any:
        failure = done.exception()
        if isinstance(failure, _ScriptedFailure):
            return opb.SessionResponse(
                request_id=request.request_id,
                status_code=failure.code.value[0],
                status_message=failure.details,
            )
        return orch_server.OrchestratorServicer._session_answer(request, done)


class _ScriptedFailure(Exception):
    """A Session request's scripted failure, on its way to the request's reply."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Servers:
    """Real agents and orchestrator on an event loop in a background thread."""

    def __init__(self, tmp_path: pathlib.Path) -> None:
        self.tmp_path = tmp_path
        self.loop = asyncio.new_event_loop()
        self._thread = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="servers")
        self._thread.submit(self.loop.run_forever)
        self.agents: dict[str, str] = {}
        self._running: list[tuple[asyncio.Event, futures.Future[None]]] = []
        self.orchestrator = ""
        self._orchestrator: tuple[asyncio.Event, futures.Future[None]] | None = None
        self._orchestrator_config: orch_config.OrchestratorConfig | None = None
        self._servicer: type[orch_server.OrchestratorServicer] | None = None
        self.orchestrator_port = 0

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run ``coro`` on the servers' loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _serve(self, start: Callable[..., Any]) -> tuple[str, asyncio.Event, futures.Future[None]]:
        ready: futures.Future[str] = futures.Future()

        async def make_stop() -> asyncio.Event:
            return asyncio.Event()

        stop = self.run(make_stop())
        task = asyncio.run_coroutine_threadsafe(start(ready.set_result, stop), self.loop)
        done, _ = futures.wait({ready, task}, timeout=30, return_when=futures.FIRST_COMPLETED)
        if task in done:
            task.result()
            raise AssertionError("server stopped before it was ready")
        return ready.result(0), stop, task

    def start_agent(self, name: str, **overrides: Any) -> str:
        cfg = agent_config.load(
            overrides={
                "node_name": name,
                "host": "127.0.0.1",
                "port": 0,
                "state_dir": str(self.tmp_path / f"agent-{name}"),
                "default_backend": "sim",
                "sim": dict(FAST_SIM),
                "grace_period_s": 1.0,
                **overrides,
            }
        )
        address, stop, task = self._serve(
            lambda ready, stop: agent_app.serve(cfg, ready=ready, stop=stop)
        )
        self.agents[name] = address
        self._running.append((stop, task))
        return address

    def start_orchestrator(
        self,
        *,
        port: int = 0,
        servicer: type[orch_server.OrchestratorServicer] | None = None,
        groups: dict[str, tuple[str, ...]] | None = None,
        **settings: Any,
    ) -> str:
        """The orchestrator over the agents started (local mode), or in topology mode over
        ``groups`` (group -> nodes: each group its own device of each node, so that groups
        never share a device); ``servicer`` instead of the real one (a subclass)."""
        values: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": port,
            "state_dir": str(self.tmp_path / "orchestrator"),
            "metrics_port": 0,
            "shutdown_grace_s": 1.0,
            **settings,
        }
        if groups is None:
            values["local_agents"] = [f"{name}={address}" for name, address in self.agents.items()]
        else:
            values["topology"] = {
                "groups": {
                    group: {
                        "nodes": [
                            {"name": node, "agent": self.agents[node], "devices": [index]}
                            for node in nodes
                        ]
                    }
                    for index, (group, nodes) in enumerate(groups.items())
                }
            }
        self._servicer = servicer
        self._orchestrator_config = orch_config.build(overrides=values)
        return self._start_orchestrator()

    def _start_orchestrator(self) -> str:
        cfg = self._orchestrator_config
        assert cfg is not None
        servicer = self._servicer
        real = orch_server.OrchestratorServicer
        if servicer is not None:
            # The servicer class is read while the server starts (before it is ready).
            orch_server.OrchestratorServicer = servicer  # type: ignore[misc]
        try:
            address, stop, task = self._serve(
                lambda ready, stop: orch_app.serve(cfg, ready=ready, stop=stop)
            )
        finally:
            orch_server.OrchestratorServicer = real  # type: ignore[misc]
        self.orchestrator = address
        self.orchestrator_port = int(address.rsplit(":", 1)[1])
        self._orchestrator = (stop, task)
        return address

    def stop_orchestrator(self) -> None:
        assert self._orchestrator is not None
        stop, task = self._orchestrator
        self.loop.call_soon_threadsafe(stop.set)
        task.result(30)
        self._orchestrator = None

    def restart_orchestrator(self) -> str:
        """The same orchestrator again (its port, its state), after a stop."""
        if self._orchestrator is not None:
            self.stop_orchestrator()
        cfg = self._orchestrator_config
        assert cfg is not None
        self._orchestrator_config = dataclasses.replace(cfg, port=self.orchestrator_port)
        return self._start_orchestrator()

    def close(self) -> None:
        if self._orchestrator is not None:
            self.stop_orchestrator()
        for stop, task in self._running:
            self.loop.call_soon_threadsafe(stop.set)
            task.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.shutdown(wait=True)
        self.loop.close()


#: The groups of the ``orchestrator`` fixture, each on its own device of node-a.
GROUPS = ("g", "a", "b")


@dataclasses.dataclass
class Orchestrator:
    """A real orchestrator (groups g, a and b on one noop agent) and its :class:`Script`."""

    servers: Servers
    script: Script
    observer: tslice.Client

    @property
    def address(self) -> str:
        return self.servers.orchestrator

    @property
    def port(self) -> int:
        return self.servers.orchestrator_port

    def holder(self, group: str) -> str:
        return self.observer.status(group).locking_job

    def holders(self) -> dict[str, str]:
        return {group: self.holder(group) for group in GROUPS}

    def waiting(self, group: str) -> tuple[str, ...]:
        return self.observer.status(group).waiting_jobs

    def until(self, condition: Callable[[], bool], within_s: float = 30.0) -> None:
        """Read ``condition`` until it holds (the orchestrator's state, read over the wire)."""
        deadline = time.monotonic() + within_s
        while not condition():
            assert time.monotonic() < deadline, "the orchestrator never got there"
            time.sleep(0.01)

    def lock_calls(self) -> list[tuple[str, str]]:
        """(method, group) of every Acquire and Yield it received, in order."""
        return [
            (call.method, call.group_id)
            for call in self.script.calls
            if call.method in {"Acquire", "Yield"}
        ]

    def stop(self) -> None:
        self.servers.stop_orchestrator()

    def restart(self) -> None:
        self.servers.restart_orchestrator()


def running_orchestrator(tmp_path: pathlib.Path, script: Script) -> Iterator[Orchestrator]:
    """A real, scripted orchestrator over one noop agent, stopped at the end."""
    servers = Servers(tmp_path)
    # A class of its own per orchestrator: its servicer is made by the server, and two
    # orchestrators of one test keep two scripts.
    servicer = type("Scripted", (Scripted,), {"script": script})
    try:
        servers.start_agent("node-a", default_backend="noop")
        servers.start_orchestrator(servicer=servicer, groups=dict.fromkeys(GROUPS, ("node-a",)))
        with tslice.Client(servers.orchestrator, job_id=None) as observer:
            yield Orchestrator(servers, script, observer)
    finally:
        servers.close()


@contextlib.contextmanager
def watching(address: str, group: str) -> Iterator[Any]:
    """An orchestrator event stream that is subscribed when the block starts.

    Uses the raw stub (the escape hatch): our orchestrator sends the response headers
    once the subscription exists, so waiting for them rules out a race with the events
    the block then causes.
    """
    with tslice.Client(address, job_id="watcher") as client:
        call = client.orchestrator_stub.WatchEvents(
            opb.WatchEventsRequest(group_id=group), timeout=60
        )
        call.initial_metadata()
        try:
            yield call
        finally:
            call.cancel()


def wait_for_event(events: Any, kind: int, job: str) -> None:
    for event in events:
        if event.kind == kind and event.job_id == job:
            return
    name = opb.OrchestratorEvent.Kind.Name(kind)  # type: ignore[arg-type]
    raise AssertionError(f"the stream ended before {job} was {name}")
