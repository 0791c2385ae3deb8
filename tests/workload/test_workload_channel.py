"""register_workload / WorkloadHandle against a real agent-side ChannelHub over gRPC.

Every blocking handle call goes through ``asyncio.to_thread`` so that the server
keeps serving on the test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from tests.workload import workload_support
from tests.workload.workload_support import HubServer
from tslice.agent import channel
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.common import residency
from tslice.workload import WorkloadHandle, register_workload

OFFLOAD = pb.SUSPEND_MODE_OFFLOAD
DISCARD = pb.SUSPEND_MODE_DISCARD

Register = Callable[..., WorkloadHandle]


@pytest.fixture
async def register() -> AsyncIterator[Register]:
    """register_workload, with every handle closed (off the loop) at the end."""
    handles: list[WorkloadHandle] = []

    def _register(*args: Any, **kwargs: Any) -> WorkloadHandle:
        kwargs.setdefault("ping_interval_s", 0.2)
        kwargs.setdefault("backoff_initial_s", 0.05)
        handle = register_workload(*args, **kwargs)
        handles.append(handle)
        return handle

    yield _register
    for handle in handles:
        await asyncio.to_thread(handle.close)


class Recorder:
    def __init__(self, result: Any = None) -> None:
        self.calls: list[tuple[str, Any, Any]] = []
        self.result = result

    def on_snapshot(self, mode: str, tags: list[str]) -> Any:
        self.calls.append(("snapshot", mode, tags))
        return self.result

    def on_restore(self, tags: list[str]) -> Any:
        self.calls.append(("restore", None, tags))
        return self.result


def _ignore(*args: Any) -> None:
    return None


async def _registered(hub: HubServer, handle: WorkloadHandle) -> channel.WorkloadState:
    assert await asyncio.to_thread(handle.wait_registered, 10), handle.error
    return await hub.hub.wait_registered(handle.job_id, timeout=10)


# ---- registration -------------------------------------------------------------------


async def test_callbacks_round_trip_over_tcp_and_unix_socket(
    agent_hub: HubServer, register: Register
) -> None:
    recorder = Recorder(result={"device_bytes": 1000, "host_bytes": 900})
    handle = register(
        agent_hub.address,
        "job-cb",
        "pool",
        on_snapshot=recorder.on_snapshot,
        on_restore=recorder.on_restore,
    )
    state = await _registered(agent_hub, handle)
    # Over the Unix socket the handle bound itself (register socket): the agent knows its
    # process. Over TCP the registration's pid is never trusted.
    bound = agent_hub.address.startswith("unix:")
    assert state.group == "pool" and state.state_reported
    assert state.pid == (os.getpid() if bound else 0)

    snap = await agent_hub.hub.snapshot("job-cb", timeout_s=10)
    assert snap.ok and (snap.device_bytes, snap.host_bytes) == (1000, 900)
    rest = await agent_hub.hub.restore("job-cb", tags=["weights"], timeout_s=10)
    assert rest.ok
    assert recorder.calls == [("snapshot", "offload", []), ("restore", None, ["weights"])]
    assert handle.commands_executed == 2


async def test_registration_declares_keepalive_and_state_report(
    tcp_hub: HubServer, register: Register
) -> None:
    registered: list[channel.WorkloadState] = []
    tcp_hub.hub.add_listener(
        lambda event: registered.append(event.state) if event.kind == "registered" else None
    )
    handle = register(tcp_hub.address, "job-feat", on_snapshot=_ignore, on_restore=_ignore)
    await _registered(tcp_hub, handle)
    # Known from the registration itself, before the workload answered any ping.
    assert registered[0].keepalive and registered[0].state_reported
    assert handle.pings_received >= 1  # the agent pings a workload that declared keepalive


async def test_registration_reports_capabilities_given_as_names_or_numbers(
    tcp_hub: HubServer, register: Register
) -> None:
    recorder = Recorder()
    handle = register(
        tcp_hub.address,
        "job-caps",
        on_snapshot=recorder.on_snapshot,
        on_restore=recorder.on_restore,
        supported_modes=[1, "discard"],
        default_mode="SUSPEND_MODE_DISCARD",
        tags=["weights", "kv_cache", "weights"],
    )
    state = await _registered(tcp_hub, handle)
    assert state.supported_modes == (OFFLOAD, DISCARD)
    assert state.default_mode == DISCARD
    assert state.tags == ("weights", "kv_cache")
    assert state.residency == residency.FULL
    outcome = await tcp_hub.hub.snapshot("job-caps", timeout_s=10)
    assert outcome.mode == DISCARD
    assert recorder.calls == [("snapshot", "discard", [])]


async def test_a_single_declared_mode_becomes_the_default(
    tcp_hub: HubServer, register: Register
) -> None:
    recorder = Recorder()
    handle = register(
        tcp_hub.address,
        "job-one",
        on_snapshot=recorder.on_snapshot,
        on_restore=recorder.on_restore,
        supported_modes=["discard"],
    )
    state = await _registered(tcp_hub, handle)
    assert state.default_mode == DISCARD
    assert (await tcp_hub.hub.snapshot("job-one", timeout_s=10)).ok
    assert recorder.calls == [("snapshot", "discard", [])]


async def test_wait_registered_is_false_while_no_agent_answers(register: Register) -> None:
    recorder = Recorder()
    # Nothing listens on this socket path.
    handle = register(
        "unix:/nonexistent-dir/agent.sock",
        "job-x",
        on_snapshot=recorder.on_snapshot,
        on_restore=recorder.on_restore,
    )
    assert not await asyncio.to_thread(handle.wait_registered, 0.3)
    assert not handle.registered


async def test_close_ends_the_stream_cleanly_and_is_idempotent(
    tcp_hub: HubServer, register: Register
) -> None:
    events: list[channel.ChannelEvent] = []
    tcp_hub.hub.add_listener(events.append)
    recorder = Recorder()
    handle = register(
        tcp_hub.address, "job-c", on_snapshot=recorder.on_snapshot, on_restore=recorder.on_restore
    )
    await _registered(tcp_hub, handle)
    started = time.monotonic()
    await asyncio.to_thread(handle.close)
    assert time.monotonic() - started < 2.5  # the graceful path, not the cancel fallback
    await tcp_hub.hub.wait_unregistered("job-c", timeout=5)
    assert events[-1].kind == "closed"
    assert events[-1].reason == "the workload closed the channel"
    await asyncio.to_thread(handle.close)
    assert await asyncio.to_thread(handle.wait_stopped, 1)


# ---- commands -----------------------------------------------------------------------


async def test_workload_exception_is_reported_as_a_failed_command(
    tcp_hub: HubServer, register: Register
) -> None:
    def boom(mode: str, tags: list[str]) -> None:
        raise RuntimeError("CUDA out of memory")

    handle = register(tcp_hub.address, "job-f", on_snapshot=boom, on_restore=lambda tags: None)
    await _registered(tcp_hub, handle)
    outcome = await tcp_hub.hub.snapshot("job-f", timeout_s=10)
    assert not outcome.ok
    assert outcome.error == "RuntimeError: CUDA out of memory"
    # A failed snapshot did not change what the workload holds.
    assert outcome.state.residency == residency.FULL


async def test_unsupported_mode_never_reaches_the_engine(
    tcp_hub: HubServer, register: Register
) -> None:
    engine = workload_support.FakeSglang()
    handle = register(tcp_hub.address, "job-sg", workload=engine)
    state = await _registered(tcp_hub, handle)
    assert state.supported_modes == (OFFLOAD,)
    with pytest.raises(channel.CommandRefusedError, match="does not support suspend mode"):
        await tcp_hub.hub.snapshot("job-sg", mode=DISCARD, timeout_s=10)
    with pytest.raises(channel.CommandRefusedError, match="unknown tags"):
        await tcp_hub.hub.restore("job-sg", tags=["lora"], timeout_s=10)
    assert engine.calls == []
    assert handle.commands_executed == 0


async def test_vllm_engine_levels_and_staged_restore(
    tcp_hub: HubServer, register: Register
) -> None:
    engine = workload_support.FakeVllm()
    handle = register(tcp_hub.address, "job-vllm", workload=engine)
    state = await _registered(tcp_hub, handle)
    assert state.tags == ("weights", "kv_cache")

    assert (await tcp_hub.hub.snapshot("job-vllm", timeout_s=10)).state.residency == "none"
    staged = await tcp_hub.hub.restore("job-vllm", tags=["weights"], timeout_s=10)
    assert staged.ok
    assert staged.state.residency == residency.PARTIAL
    assert staged.state.missing_tags == ("kv_cache",)
    assert handle.state().resident_tags == ("weights",)
    # ... the weight sync would run here, then the KV cache comes back.
    done = await tcp_hub.hub.restore("job-vllm", tags=["kv_cache"], timeout_s=10)
    assert done.state.residency == residency.FULL
    await tcp_hub.hub.snapshot("job-vllm", mode=DISCARD, timeout_s=10)
    await tcp_hub.hub.restore("job-vllm", timeout_s=10)
    assert engine.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
        ("sleep", 2),
        ("wake_up", None),
    ]


async def test_vllm_partial_sleep_is_refused_by_the_adapter(
    tcp_hub: HubServer, register: Register
) -> None:
    engine = workload_support.FakeVllm()
    handle = register(tcp_hub.address, "job-vp", workload=engine)
    await _registered(tcp_hub, handle)
    outcome = await tcp_hub.hub.snapshot("job-vp", tags=["kv_cache"], timeout_s=10)
    assert not outcome.ok and "vLLM sleeps the whole engine" in outcome.error
    assert engine.calls == []


async def test_async_engine_runs_on_the_loop_captured_at_registration(
    tcp_hub: HubServer, register: Register
) -> None:
    engine = workload_support.FakeAsyncVllm()
    handle = register(tcp_hub.address, "job-async", workload=engine)
    await _registered(tcp_hub, handle)
    assert (await tcp_hub.hub.snapshot("job-async", timeout_s=10)).ok
    assert (await tcp_hub.hub.restore("job-async", tags=["weights"], timeout_s=10)).ok
    assert engine.calls == [("sleep", 1), ("wake_up", ["weights"])]
    assert engine.loops == [asyncio.get_running_loop()] * 2


async def test_async_engine_without_a_loop_runs_on_a_private_loop(
    tcp_hub: HubServer, register: Register
) -> None:
    engine = workload_support.FakeAsyncVllm()
    # Registered from a plain thread: no running loop to capture.
    handle = await asyncio.to_thread(register, tcp_hub.address, "job-priv", workload=engine)
    await _registered(tcp_hub, handle)
    assert (await tcp_hub.hub.snapshot("job-priv", timeout_s=10)).ok
    assert (await tcp_hub.hub.restore("job-priv", timeout_s=10)).ok
    assert len(engine.loops) == 2 and engine.loops[0] is engine.loops[1]
    assert engine.loops[0] is not asyncio.get_running_loop()


async def test_sglang_tags_pass_through(tcp_hub: HubServer, register: Register) -> None:
    engine = workload_support.FakeSglang()
    handle = register(tcp_hub.address, "job-sgt", workload=engine)
    await _registered(tcp_hub, handle)
    partial = await tcp_hub.hub.snapshot("job-sgt", tags=["kv_cache"], timeout_s=10)
    assert partial.state.residency == residency.PARTIAL
    await tcp_hub.hub.restore("job-sgt", timeout_s=10)
    assert engine.calls == [("release", ["kv_cache"]), ("resume", None)]


async def test_async_command_is_cancelled_at_its_deadline(
    tcp_hub: HubServer, register: Register
) -> None:
    cancelled = threading.Event()

    async def never(mode: str, tags: list[str]) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    handle = register(tcp_hub.address, "job-dl", on_snapshot=never, on_restore=lambda t: None)
    await _registered(tcp_hub, handle)
    try:
        outcome = await tcp_hub.hub.snapshot("job-dl", timeout_s=0.3)
    except channel.CommandTimeoutError as err:
        assert "within 0.3 s" in str(err)
    else:
        # The workload's own deadline (0.3 s from when it got the command) answered
        # first: an agent loop stalled under load reads that answer before its timer.
        assert not outcome.ok and "Timeout" in outcome.error, outcome
    assert await asyncio.to_thread(cancelled.wait, 10)
    state = tcp_hub.hub.session_state("job-dl")
    assert state is not None and state.residency == residency.FULL


async def test_pings_keep_flowing_while_a_long_command_runs(register: Register) -> None:
    running = await HubServer.start("127.0.0.1:0", ping_interval_s=0.2, missed_pings=5)
    try:
        pings_during: list[int] = []
        holder: list[WorkloadHandle] = []

        def slow_snapshot(mode: str, tags: list[str]) -> None:
            before = holder[0].pings_received
            time.sleep(2.0)  # the "offload": 10 ping intervals, twice the silence limit
            pings_during.append(holder[0].pings_received - before)

        handle = register(
            running.address,
            "job-slow",
            on_snapshot=slow_snapshot,
            on_restore=lambda tags: None,
            ping_interval_s=0.2,
            missed_pings=5,
        )
        holder.append(handle)
        await _registered(running, handle)
        outcome = await running.hub.snapshot("job-slow", timeout_s=10)
        assert outcome.ok
        assert pings_during[0] >= 4
        state = running.hub.session_state("job-slow")
        assert state is not None and state.keepalive
        assert handle.connections == 1
    finally:
        await running.stop()


# ---- failures and reconnects ---------------------------------------------------------


_BLOCKING_WORKLOAD = textwrap.dedent(
    """
    import sys, threading
    from tslice.workload import register_workload

    def on_snapshot(mode, tags):
        print("snapshot-started", flush=True)
        threading.Event().wait()

    handle = register_workload(sys.argv[1], "job-proc", on_snapshot=on_snapshot,
                               on_restore=lambda tags: None)
    assert handle.wait_registered(30)
    print("registered", flush=True)
    threading.Event().wait()
    """
)


async def test_workload_process_killed_mid_command_fails_it_promptly(tcp_hub: HubServer) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _BLOCKING_WORKLOAD,
        tcp_hub.address,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"registered\n"
        task = asyncio.create_task(tcp_hub.hub.snapshot("job-proc", timeout_s=120))
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"snapshot-started\n"
        proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(
            channel.WorkloadDisconnectedError, match="disconnected before answering"
        ):
            await asyncio.wait_for(task, 30)
        assert time.monotonic() - started < 5
        assert not tcp_hub.hub.is_registered("job-proc")
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_reconnect_re_registers_with_what_the_workload_holds(
    socket_path: str, register: Register
) -> None:
    first = await HubServer.start(f"unix:{socket_path}")
    engine = workload_support.FakeVllm()
    handle = register(f"unix:{socket_path}", "job-rc", workload=engine)
    await _registered(first, handle)
    await first.hub.snapshot("job-rc", timeout_s=10)
    await first.hub.restore("job-rc", tags=["weights"], timeout_s=10)
    await first.stop()  # the agent goes away (e.g. restarted)

    second = await HubServer.start(f"unix:{socket_path}")
    try:
        state = await second.hub.wait_registered("job-rc", timeout=30)
        assert (state.suspended, state.resident_tags, state.residency) == (
            True,
            ("weights",),
            residency.PARTIAL,
        )
        assert handle.connections >= 2
        assert await asyncio.to_thread(handle.wait_registered, 10)
        # The new agent can finish the staged restore.
        outcome = await second.hub.restore("job-rc", tags=["kv_cache"], timeout_s=10)
        assert outcome.state.residency == residency.FULL
    finally:
        await second.stop()


async def test_a_second_handle_waits_until_the_first_is_gone(
    tcp_hub: HubServer, register: Register
) -> None:
    # A second workload of the same (job, group) never takes over the live one: the agent
    # refuses it (ALREADY_EXISTS) and it retries; once the first closed, it gets in.
    old = register(tcp_hub.address, "job-dup", workload=workload_support.FakeSglang())
    await _registered(tcp_hub, old)
    new = register(
        tcp_hub.address,
        "job-dup",
        workload=workload_support.FakeSglang(),
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    refusal = await asyncio.to_thread(new.wait_refused, 10)
    assert refusal is not None and "already has a live workload" in refusal
    assert "Close the first" in refusal and not new.registered
    assert old.registered and old.error is None
    await asyncio.to_thread(old.close)
    assert await asyncio.to_thread(new.wait_registered, 10), new.refusal
    assert new.refusal is None and new.error is None
    state = await tcp_hub.hub.wait_registered("job-dup", timeout=5)
    assert state.pid == 0  # over TCP, with nothing bound, the process is not known


async def test_two_groups_of_one_job_register_side_by_side(
    tcp_hub: HubServer, register: Register
) -> None:
    sampler, trainer = Recorder(), Recorder()
    handles = [
        register(
            tcp_hub.address, "job-2g", group, on_snapshot=r.on_snapshot, on_restore=r.on_restore
        )
        for group, r in (("sampler", sampler), ("trainer", trainer))
    ]
    for handle in handles:
        assert await asyncio.to_thread(handle.wait_registered, 10), handle.error
    await tcp_hub.hub.wait_registered("job-2g", "trainer", timeout=5)
    assert (await tcp_hub.hub.snapshot("job-2g", "trainer", timeout_s=10)).ok
    assert sampler.calls == [] and [c[0] for c in trainer.calls] == ["snapshot"]
    # Neither stopped the other: both are still registered, neither was told it was replaced.
    assert all(h.registered and h.error is None for h in handles)


class _MuteAgent(pb_grpc.SnapshotAgentServiceServicer):
    """Acknowledges a registration, then never says anything again."""

    def __init__(self) -> None:
        self.streams = 0
        self.second_stream = asyncio.Event()

    async def WorkloadChannel(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self.streams += 1
        if self.streams == 2:
            self.second_stream.set()
        await request_iterator.__anext__()
        yield pb.AgentCommand(ping=pb.Ping(nonce=1))
        await asyncio.Event().wait()


async def test_workload_drops_a_silent_agent_and_reconnects(register: Register) -> None:
    mute = _MuteAgent()
    server = grpc.aio.server()
    pb_grpc.add_SnapshotAgentServiceServicer_to_server(mute, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        handle = register(
            f"127.0.0.1:{port}",
            "job-mute",
            on_snapshot=lambda m, t: None,
            on_restore=lambda t: None,
            ping_interval_s=0.05,
            missed_pings=2,
        )
        assert await asyncio.to_thread(handle.wait_registered, 10)
        await asyncio.wait_for(mute.second_stream.wait(), 10)
        assert handle.connections >= 2
    finally:
        await server.stop(grace=None)


# ---- argument checking --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"job_id": "bad id"}, ValueError, "job_id 'bad id' is malformed"),
        ({"group": "a b"}, ValueError, "group 'a b' is malformed"),
        ({"workload": workload_support.FakeVllm()}, ValueError, "not both"),
        ({"on_restore": None}, ValueError, "on_restore is required"),
        ({"supported_modes": ["offload"], "default_mode": "discard"}, ValueError, "not among"),
        ({"supported_modes": ["hibernate"]}, ValueError, "unknown suspend mode 'hibernate'"),
        ({"tags": ["weights", " "]}, ValueError, "not a non-empty string"),
    ],
    ids=[
        "bad-job",
        "bad-group",
        "workload-and-callbacks",
        "one-callback",
        "default",
        "mode",
        "tag",
    ],
)
def test_bad_arguments_fail_before_connecting(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments: dict[str, Any] = {
        "agent": "127.0.0.1:1",
        "job_id": "job",
        "on_snapshot": lambda m, t: None,
        "on_restore": lambda t: None,
    }
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        register_workload(**arguments)


def test_agent_address_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TSLICE_AGENT_ADDR", raising=False)
    monkeypatch.delenv("SNAPSHOT_AGENT_ADDR", raising=False)
    with pytest.raises(ValueError, match="no agent address"):
        register_workload(None, "job", on_snapshot=lambda m, t: None, on_restore=lambda t: None)
    monkeypatch.setenv("SNAPSHOT_AGENT_ADDR", "unix:/nonexistent-dir/a.sock")
    handle = register_workload(
        None, "job", on_snapshot=lambda m, t: None, on_restore=lambda t: None
    )
    handle.close()
    assert handle.wait_stopped(5)


def test_unknown_workload_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot drive a object"):
        register_workload("127.0.0.1:1", "job", workload=object())


async def test_a_caller_owned_channel_is_used_and_left_open(
    tcp_hub: HubServer, register: Register
) -> None:
    owned = grpc.insecure_channel(tcp_hub.address)
    try:
        recorder = Recorder()
        handle = register(
            owned, "job-own", on_snapshot=recorder.on_snapshot, on_restore=recorder.on_restore
        )
        await _registered(tcp_hub, handle)
        assert (await tcp_hub.hub.snapshot("job-own", timeout_s=10)).ok
        await asyncio.to_thread(handle.close)
        # Still usable by its owner after the handle closed.
        again = register(
            owned, "job-own", on_snapshot=recorder.on_snapshot, on_restore=recorder.on_restore
        )
        await _registered(tcp_hub, again)
        assert len(recorder.calls) == 1
        await asyncio.to_thread(again.close)
    finally:
        owned.close()


async def test_closing_the_callers_channel_stops_the_handle_with_a_reason(
    tcp_hub: HubServer, register: Register
) -> None:
    owned = grpc.insecure_channel(tcp_hub.address)
    handle = register(owned, "job-gone", on_snapshot=lambda m, t: None, on_restore=lambda t: None)
    await _registered(tcp_hub, handle)
    owned.close()
    assert await asyncio.to_thread(handle.wait_stopped, 10)
    assert handle.error is not None and "unusable" in handle.error


async def test_close_returns_while_a_command_hangs_after_a_disconnect(register: Register) -> None:
    running = await HubServer.start("127.0.0.1:0")
    release = threading.Event()
    try:
        handle = register(
            running.address,
            "job-hang",
            on_snapshot=lambda m, t: release.wait(30),
            on_restore=lambda t: None,
        )
        await _registered(running, handle)
        with pytest.raises(channel.CommandTimeoutError):
            await running.hub.snapshot("job-hang", timeout_s=0.2)
        await running.hub.close()  # the stream ends; the reconnect waits for the command
        started = time.monotonic()
        await asyncio.to_thread(handle.close, 4.0)
        # Prompt even though the worker is stuck in the adapter (a connection thread that
        # did not notice the stop would cost close() its 2 s join, then a cancel).
        assert time.monotonic() - started < 1.5
    finally:
        release.set()
        await running.stop()
