"""The app-endpoint backend against real local engine servers (tslice.sim.engine_server).

Exact requests of both dialects, concurrent endpoints, compensation after partial failure,
timeouts, and the allow-list (refused before any socket is opened, checked with an audit hook).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from tslice.agent.backends import app_endpoint, app_endpoint_dialects, base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.sim import engine_server

GiB = 1 << 30
TAGS = {"weights": 3 * GiB, "kv_cache": GiB}
APPS = {"vllm": pb.APP_VLLM, "sglang": pb.APP_SGLANG}
#: The engine servers listen on ports the system picks: allow them all, explicitly.
EPHEMERAL = {"allowed_hosts": ["127.0.0.1:1024-65535"]}

# --------------------------------------------------------------------------- fixtures

_socket_events: list[tuple[str, tuple[Any, ...]]] = []
_recording = threading.Event()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _recording.is_set() and event in ("socket.connect", "socket.getaddrinfo"):
        _socket_events.append((event, args))


@functools.cache
def _install_audit_hook() -> None:
    # Audit hooks cannot be removed: install one for the process, switch it on and off.
    sys.addaudithook(_audit)


@pytest.fixture
def socket_audit() -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    """Record every outgoing connect and name lookup made by this process meanwhile."""
    _install_audit_hook()
    _socket_events.clear()
    _recording.set()
    try:
        yield _socket_events
    finally:
        _recording.clear()


Engines = Callable[..., engine_server.EngineServer]


@pytest.fixture
def engines() -> Iterator[Engines]:
    started: list[engine_server.EngineServer] = []

    def start(dialect: engine_server.Dialect = "vllm", **kwargs: Any) -> engine_server.EngineServer:
        kwargs.setdefault("tags", TAGS)
        server = engine_server.EngineServer(dialect=dialect, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
async def backend() -> AsyncIterator[app_endpoint.AppEndpointBackend]:
    instance = app_endpoint.AppEndpointBackend.create(
        {**EPHEMERAL, "timeout_s": 10, "connect_timeout_s": 5}
    )
    yield instance
    await instance.close()


def job(
    app: str,
    *servers: engine_server.EngineServer | str,
    mode: int = pb.SUSPEND_MODE_UNSPECIFIED,
    tags: tuple[str, ...] = (),
    state: dict[str, Any] | None = None,
) -> base.JobContext:
    endpoints = [s if isinstance(s, str) else s.url for s in servers]
    config = pb.BackendConfig(
        app_endpoint=pb.AppEndpointConfig(
            app=APPS[app],
            endpoints=endpoints,
            mode=mode,  # type: ignore[arg-type]
            tags=list(tags),
        )
    )
    return base.JobContext(job_id="job-a", group="pool", config=config, state=state or {})


def paths(server: engine_server.EngineServer) -> list[str]:
    return [r.target for r in server.requests]


async def arrived(server: engine_server.EngineServer, count: int = 1) -> None:
    assert await asyncio.to_thread(server.wait_for_requests, count, timeout=10)


# --------------------------------------------------------------------------- exact requests


@pytest.mark.parametrize(
    ("arg_mode", "config_mode", "level"),
    [
        (pb.SUSPEND_MODE_UNSPECIFIED, pb.SUSPEND_MODE_UNSPECIFIED, "1"),
        (pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD, "1"),
        (pb.SUSPEND_MODE_DISCARD, pb.SUSPEND_MODE_UNSPECIFIED, "2"),
        (pb.SUSPEND_MODE_UNSPECIFIED, pb.SUSPEND_MODE_DISCARD, "2"),
    ],
    ids=["unspecified", "argument-wins", "discard", "config-mode"],
)
async def test_vllm_sleep_request(
    backend: app_endpoint.AppEndpointBackend,
    engines: Engines,
    arg_mode: pb.SuspendMode,
    config_mode: int,
    level: str,
) -> None:
    server = engines("vllm")
    result = await backend.snapshot(
        job("vllm", server, mode=config_mode, tags=("weights",)), arg_mode
    )
    (request,) = server.requests
    assert (request.method, request.target, request.body) == ("POST", f"/sleep?level={level}", b"")
    assert request.content_type is None
    assert result.device_bytes == 4 * GiB
    assert result.host_bytes == (3 * GiB if level == "1" else 0)
    assert result.state == {"app": "vllm", "endpoints": [server.url], "level": int(level)}
    assert server.device_bytes == 0


@pytest.mark.parametrize(
    ("tags", "target"),
    [((), "/wake_up"), (("weights", "kv_cache"), "/wake_up?tags=weights&tags=kv_cache")],
    ids=["no-tags", "tags-in-order"],
)
async def test_vllm_wake_request(
    backend: app_endpoint.AppEndpointBackend,
    engines: Engines,
    tags: tuple[str, ...],
    target: str,
) -> None:
    server = engines("vllm")
    saved = await backend.snapshot(job("vllm", server), pb.SUSPEND_MODE_OFFLOAD)
    result = await backend.restore(job("vllm", server, tags=tags, state=saved.state))
    request = server.requests[-1]
    assert (request.method, request.target, request.body) == ("POST", target, b"")
    assert result.device_bytes == 4 * GiB and result.host_bytes == 0
    assert not server.is_sleeping


@pytest.mark.parametrize(
    ("tags", "body"), [((), b"{}"), (("kv_cache",), b'{"tags":["kv_cache"]}')], ids=["all", "tags"]
)
async def test_sglang_requests(
    backend: app_endpoint.AppEndpointBackend, engines: Engines, tags: tuple[str, ...], body: bytes
) -> None:
    server = engines("sglang")
    # SGLang's mode is fixed at its launch: DISCARD changes nothing in the request.
    saved = await backend.snapshot(job("sglang", server, tags=tags), pb.SUSPEND_MODE_DISCARD)
    await backend.restore(job("sglang", server, tags=tags, state=saved.state))
    release, resume = server.requests
    for request, path in (
        (release, "/release_memory_occupation"),
        (resume, "/resume_memory_occupation"),
    ):
        assert (request.method, request.target, request.body) == ("POST", path, body)
        assert request.content_type == "application/json"
    expected_freed = GiB if tags else 4 * GiB
    assert saved.device_bytes == expected_freed
    assert server.device_bytes == 4 * GiB


@pytest.mark.parametrize("path", ["/engine0", "/admin/../sleep", "/v1/"])
async def test_a_callers_path_is_refused_before_any_io(
    backend: app_endpoint.AppEndpointBackend,
    engines: Engines,
    socket_audit: list[tuple[str, tuple[Any, ...]]],
    path: str,
) -> None:
    # Issue 10: the path is the dialect's own; a caller's prefix aimed the agent's POSTs
    # at any route of an allowed server (today's main sent POST /engine0/sleep).
    server = engines("vllm", base_path="/engine0")
    with pytest.raises(app_endpoint_dialects.InvalidEndpointConfigError, match="without a path"):
        await backend.snapshot(job("vllm", f"{server.url}{path}"), pb.SUSPEND_MODE_OFFLOAD)
    assert server.requests == [] and socket_audit == []


async def test_staged_wake_sends_the_tags_it_is_given(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    server = engines("vllm")
    saved = await backend.snapshot(job("vllm", server), pb.SUSPEND_MODE_OFFLOAD)
    weights = await backend.restore(job("vllm", server, tags=("weights",), state=saved.state))
    assert server.resident_tags == {"weights"} and weights.device_bytes == 3 * GiB
    kv = await backend.restore(job("vllm", server, tags=("kv_cache",), state=weights.state))
    assert kv.device_bytes == GiB and not server.is_sleeping
    assert paths(server)[1:] == ["/wake_up?tags=weights", "/wake_up?tags=kv_cache"]


async def test_staged_wake_state_drives_missing_tags(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    server = engines("vllm")
    both = ["weights", "kv_cache"]
    awake = await backend.restore(job("vllm", server))  # a full wake of an awake engine
    assert await backend.missing_tags(job("vllm", server, state=awake.state), both) == []
    saved = await backend.snapshot(job("vllm", server), pb.SUSPEND_MODE_OFFLOAD)
    weights = await backend.restore(job("vllm", server, tags=("weights",), state=saved.state))
    assert weights.state["awake_tags"] == ["weights"]
    assert await backend.missing_tags(job("vllm", server, state=weights.state), both) == [
        "kv_cache"
    ]
    kv = await backend.restore(job("vllm", server, tags=("kv_cache",), state=weights.state))
    assert await backend.missing_tags(job("vllm", server, state=kv.state), both) == []


async def test_snapshot_during_a_staged_wake_frees_everything(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    server = engines("vllm")
    saved = await backend.snapshot(job("vllm", server), pb.SUSPEND_MODE_OFFLOAD)
    weights = await backend.restore(job("vllm", server, tags=("weights",), state=saved.state))
    assert server.device_bytes == 3 * GiB
    # vLLM would ignore a bare /sleep here (it is still partly asleep) and keep the weights.
    again = await backend.snapshot(
        job("vllm", server, state=weights.state), pb.SUSPEND_MODE_OFFLOAD
    )
    assert paths(server)[-2:] == ["/wake_up", "/sleep?level=1"]
    assert server.device_bytes == 0 and again.device_bytes == 4 * GiB
    assert "awake_tags" not in again.state


async def test_engine_without_byte_counts_reports_zero(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    server = engines("vllm")
    server.inject_fault(status=200, body="ok")  # a 2xx answer carrying no numbers
    result = await backend.snapshot(job("vllm", server), pb.SUSPEND_MODE_OFFLOAD)
    assert (result.device_bytes, result.host_bytes) == (0, 0)


# --------------------------------------------------------------------------- concurrency


async def test_endpoints_are_driven_concurrently(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    servers = [engines("vllm") for _ in range(3)]
    gate = threading.Event()
    for server in servers:
        server.inject_fault(gate=gate)
    task = asyncio.ensure_future(backend.snapshot(job("vllm", *servers), pb.SUSPEND_MODE_OFFLOAD))
    try:
        # Every engine has the request while none has answered: the calls overlap.
        for server in servers:
            await arrived(server)
        assert not task.done()
    finally:
        gate.set()
    result = await task
    assert result.device_bytes == 3 * 4 * GiB
    assert all(s.is_sleeping and paths(s) == ["/sleep?level=1"] for s in servers)


# --------------------------------------------------------------------------- partial failure


async def test_partial_snapshot_failure_resumes_the_suspended(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    good1, bad, good2 = engines("vllm"), engines("vllm"), engines("vllm")
    bad.inject_fault(status=503, body="engine busy")
    with pytest.raises(app_endpoint.EngineRejectedError) as info:
        await backend.snapshot(job("vllm", good1, bad, good2), pb.SUSPEND_MODE_OFFLOAD)
    error = info.value
    assert isinstance(error, base.TransientBackendError)
    assert isinstance(error, base.TransientBackendError)
    text = str(error)
    assert f"{bad.url}: POST /sleep?level=1 returned HTTP 503 Service Unavailable;" in text
    assert "engine busy" not in text  # the status line only, never the body
    assert "could not suspend 1 of 3" in text
    assert f"resumed 2 endpoint(s) that had (or may have) changed: {good1.url}, {good2.url}" in text
    assert paths(good1) == paths(good2) == ["/sleep?level=1", "/wake_up"]
    assert paths(bad) == ["/sleep?level=1"]  # refused: nothing to undo
    assert not any(s.is_sleeping for s in (good1, bad, good2))


async def test_permanent_refusal_is_not_retried(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    server = engines("vllm")
    server.inject_fault(status=404, body="x" * 5000)
    with pytest.raises(app_endpoint.EngineRefusedError) as info:
        await backend.snapshot(job("vllm", server), pb.SUSPEND_MODE_OFFLOAD)
    assert not isinstance(info.value, base.TransientBackendError)
    assert "returned HTTP 404 Not Found;" in str(info.value) and "xxx" not in str(info.value)


async def test_another_services_answer_never_reaches_the_caller(engines: Engines) -> None:
    # Issue 10: another local service on an allowed host answered 403 with its own words,
    # and the agent put them in the caller's error. Now its port must be listed, and a
    # listed server's answer comes back as a status line only.
    other = engines("vllm")
    other.inject_fault(status=403, body="secret-token-of-another-service", count=1000)
    port = int(other.url.rsplit(":", 1)[1])
    default = app_endpoint.AppEndpointBackend.create({})
    listed = app_endpoint.AppEndpointBackend.create({"allowed_hosts": [f"127.0.0.1:{port}"]})
    try:
        with pytest.raises(app_endpoint_dialects.EndpointNotAllowedError) as refused:
            await default.snapshot(job("vllm", other), pb.SUSPEND_MODE_OFFLOAD)
        assert f"port {port} is not in" in str(refused.value)
        assert f"as '127.0.0.1:{port}'" in str(refused.value)
        assert other.connections == 0
        with pytest.raises(app_endpoint.EngineRefusedError) as answered:
            await listed.snapshot(job("vllm", other), pb.SUSPEND_MODE_OFFLOAD)
    finally:
        await default.close()
        await listed.close()
    text = str(answered.value)
    assert "POST /sleep?level=1 returned HTTP 403 Forbidden;" in text
    assert "secret" not in text


async def test_lost_answer_is_compensated_too(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    good, lost = engines("sglang"), engines("sglang")
    lost.inject_fault(drop=True, apply=True)  # it released, but the answer never came
    with pytest.raises(app_endpoint.EngineRejectedError, match="RemoteProtocolError"):
        await backend.snapshot(
            job("sglang", good, lost, tags=("kv_cache",)), pb.SUSPEND_MODE_OFFLOAD
        )
    for server in (good, lost):
        assert [r.path for r in server.requests] == [
            "/release_memory_occupation",
            "/resume_memory_occupation",
        ]
        assert server.requests[-1].body == b'{"tags":["kv_cache"]}'
        assert server.device_bytes == 4 * GiB


async def test_failed_compensation_is_fatal_and_names_the_mixed_endpoint(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    stuck, bad = engines("vllm"), engines("vllm")
    bad.inject_fault(status=503)
    stuck.inject_fault(status=503, path="/wake_up", body="cannot wake")
    with pytest.raises(base.FatalBackendError) as info:
        await backend.snapshot(job("vllm", stuck, bad), pb.SUSPEND_MODE_OFFLOAD)
    text = str(info.value)
    assert "mixed state" in text and f"{stuck.url}: POST /wake_up returned HTTP 503" in text
    assert stuck.is_sleeping and not bad.is_sleeping


async def test_partial_vllm_restore_puts_the_woken_back_to_sleep(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    woke, bad = engines("vllm"), engines("vllm")
    saved = await backend.snapshot(job("vllm", woke, bad), pb.SUSPEND_MODE_DISCARD)
    bad.inject_fault(status=503, path="/wake_up")
    with pytest.raises(app_endpoint.EngineRejectedError) as info:
        await backend.restore(job("vllm", woke, bad, tags=("weights",), state=saved.state))
    assert f"suspended again 1 endpoint(s) that had (or may have) changed: {woke.url}" in str(
        info.value
    )
    assert "the job is unchanged" in str(info.value)
    # A partly woken vLLM ignores /sleep, so it is woken fully first, then slept at the
    # level the job was suspended with (DISCARD = 2).
    assert paths(woke) == ["/sleep?level=2", "/wake_up?tags=weights", "/wake_up", "/sleep?level=2"]
    assert woke.device_bytes == bad.device_bytes == 0
    assert woke.host_bytes == bad.host_bytes == 0


async def test_partial_sglang_restore_releases_what_it_resumed(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    woke, bad = engines("sglang"), engines("sglang")
    saved = await backend.snapshot(job("sglang", woke, bad), pb.SUSPEND_MODE_OFFLOAD)
    bad.inject_fault(status=400, path="/resume_memory_occupation")
    with pytest.raises(app_endpoint.EngineRefusedError):
        await backend.restore(job("sglang", woke, bad, tags=("weights",), state=saved.state))
    assert [(r.path, r.body) for r in woke.requests[1:]] == [
        ("/resume_memory_occupation", b'{"tags":["weights"]}'),
        ("/release_memory_occupation", b'{"tags":["weights"]}'),
    ]
    assert woke.device_bytes == bad.device_bytes == 0


async def test_unreachable_endpoint_is_transient(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    gone = engines("vllm")
    url = gone.url
    gone.stop()
    live = engines("vllm")
    with pytest.raises(app_endpoint.EngineRejectedError) as info:
        await backend.snapshot(job("vllm", live, url), pb.SUSPEND_MODE_OFFLOAD)
    assert f"{url}: POST /sleep?level=1: cannot connect" in str(info.value)
    assert not live.is_sleeping


async def test_timeout_is_configurable_and_reported(engines: Engines) -> None:
    slow = engines("vllm")
    slow.inject_fault(delay_s=30, path="/sleep")  # the engine holds itself for 30 s
    backend = app_endpoint.AppEndpointBackend.create({**EPHEMERAL, "timeout_s": 0.3})
    try:
        with pytest.raises(base.FatalBackendError) as info:
            await backend.snapshot(job("vllm", slow), pb.SUSPEND_MODE_OFFLOAD)
    finally:
        await backend.close()
    text = str(info.value)
    # The sleep may still happen, so the backend tries to wake the engine; that wake queues
    # behind the sleep and times out as well: the state is unknown, hence fatal.
    assert "POST /sleep?level=1: no answer within 0.3 s" in text
    assert "POST /wake_up: no answer within 0.3 s" in text


# --------------------------------------------------------------------------- allow-list


@pytest.mark.parametrize(
    "refused", ["http://example.com:8000", "http://10.0.0.1", "http://2130706433:8000"]
)
@pytest.mark.parametrize("operation", ["validate", "snapshot", "restore"])
async def test_refused_host_sends_nothing(
    backend: app_endpoint.AppEndpointBackend,
    engines: Engines,
    socket_audit: list[tuple[str, tuple[Any, ...]]],
    refused: str,
    operation: str,
) -> None:
    local = engines("vllm")
    target = job("vllm", local, refused)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "validate": lambda: backend.validate(target),
        "snapshot": lambda: backend.snapshot(target, pb.SUSPEND_MODE_OFFLOAD),
        "restore": lambda: backend.restore(target),
    }
    with pytest.raises(app_endpoint_dialects.EndpointNotAllowedError, match="is refused"):
        await calls[operation]()
    assert socket_audit == []  # no connect, no DNS lookup, anywhere in this process
    assert local.requests == [] and local.connections == 0


async def test_audit_hook_would_see_a_request(
    backend: app_endpoint.AppEndpointBackend,
    engines: Engines,
    socket_audit: list[tuple[str, tuple[Any, ...]]],
) -> None:
    # Guards the test above against a hook that records nothing.
    server = engines("vllm")
    await backend.snapshot(job("vllm", server), pb.SUSPEND_MODE_OFFLOAD)
    assert any(event == "socket.connect" for event, _ in socket_audit)


async def test_allow_list_with_port(engines: Engines) -> None:
    allowed, other = engines("vllm"), engines("vllm")
    port = allowed.url.rsplit(":", 1)[1]
    backend = app_endpoint.AppEndpointBackend.create({"allowed_hosts": [f"127.0.0.1:{port}"]})
    try:
        await backend.snapshot(job("vllm", allowed), pb.SUSPEND_MODE_OFFLOAD)
        with pytest.raises(app_endpoint_dialects.EndpointNotAllowedError):
            await backend.snapshot(job("vllm", other), pb.SUSPEND_MODE_OFFLOAD)
    finally:
        await backend.close()
    assert allowed.is_sleeping and other.connections == 0


async def test_redirects_are_not_followed(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    first, elsewhere = engines("vllm"), engines("vllm")
    first.inject_fault(status=307, headers={"Location": f"{elsewhere.url}/sleep?level=1"})
    with pytest.raises(app_endpoint.EngineRefusedError, match="HTTP 307"):
        await backend.snapshot(job("vllm", first), pb.SUSPEND_MODE_OFFLOAD)
    assert elsewhere.connections == 0


async def test_invalid_config_is_refused_before_io(
    backend: app_endpoint.AppEndpointBackend,
) -> None:
    empty = base.JobContext(job_id="job-a", group="pool", config=None)
    with pytest.raises(app_endpoint_dialects.InvalidEndpointConfigError, match="job 'job-a'"):
        await backend.snapshot(empty, pb.SUSPEND_MODE_OFFLOAD)
    with pytest.raises(app_endpoint_dialects.InvalidEndpointConfigError):
        await backend.validate(empty)


# --------------------------------------------------------------------------- recover


async def test_recover_reads_vllm_sleep_state(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    a, b = engines("vllm"), engines("vllm")
    assert await backend.recover(job("vllm", a, b)) == pb.JOB_STATE_RUNNING
    await backend.snapshot(job("vllm", a), pb.SUSPEND_MODE_OFFLOAD)
    assert await backend.recover(job("vllm", a, b)) is None  # mixed: cannot tell
    await backend.snapshot(job("vllm", b), pb.SUSPEND_MODE_OFFLOAD)
    assert await backend.recover(job("vllm", a, b)) == pb.JOB_STATE_SAVED
    b.stop()
    assert await backend.recover(job("vllm", a, b)) is None  # unreachable: cannot tell


async def test_recover_cannot_tell_for_sglang_or_bad_config(
    backend: app_endpoint.AppEndpointBackend, engines: Engines
) -> None:
    server = engines("sglang")
    assert await backend.recover(job("sglang", server)) is None
    assert await backend.recover(job("vllm", "http://example.com")) is None
    assert server.requests == []
