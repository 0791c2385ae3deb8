"""AppChannelBackend: the agent's app-channel backend, driving a real registered workload.

A grpc.aio server delegates WorkloadChannel to a ChannelHub; the workload side is the
real ``register_workload`` (threads), so every blocking handle call goes through
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tslice.agent import channel
from tslice.agent.backends import app_channel, base, services
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.common import errors
from tslice.workload import WorkloadHandle, register_workload

OFFLOAD = pb.SUSPEND_MODE_OFFLOAD
DISCARD = pb.SUSPEND_MODE_DISCARD
UNSPECIFIED = pb.SUSPEND_MODE_UNSPECIFIED


class _Servicer(pb_grpc.SnapshotAgentServiceServicer):
    def __init__(self, hub: channel.ChannelHub) -> None:
        self.hub = hub

    async def WorkloadChannel(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for command in self.hub.handle_stream(request_iterator, context):
            yield command


class Agent:
    def __init__(self, hub: channel.ChannelHub, address: str) -> None:
        self.hub = hub
        self.address = address
        self.backend = app_channel.AppChannelBackend.create_on_node(
            {"command_timeout_s": 10, "register_wait_s": 0}, _services(hub)
        )


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    hub = channel.ChannelHub(ping_interval_s=0.2)
    server = grpc.aio.server()
    pb_grpc.add_SnapshotAgentServiceServicer_to_server(_Servicer(hub), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield Agent(hub, f"127.0.0.1:{port}")
    await hub.close()
    await server.stop(grace=None)


class Workload:
    """Callbacks that record calls and report bytes like an adapter would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, list[str]]] = []
        self.fail_with: Exception | None = None

    def on_snapshot(self, mode: str, tags: list[str]) -> dict[str, int]:
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append(("snapshot", mode, tags))
        return {"device_bytes": 4096, "host_bytes": 4000}

    def on_restore(self, tags: list[str]) -> dict[str, int]:
        self.calls.append(("restore", None, tags))
        return {"device_bytes": 2048}


Register = Callable[..., WorkloadHandle]


@pytest.fixture
async def register() -> AsyncIterator[Register]:
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


async def _connect(
    agent: Agent, register: Register, job_id: str, workload: Workload, **kwargs: Any
) -> WorkloadHandle:
    handle = register(
        agent.address,
        job_id,
        "g",
        on_snapshot=workload.on_snapshot,
        on_restore=workload.on_restore,
        **kwargs,
    )
    assert await asyncio.to_thread(handle.wait_registered, 10), handle.error
    await agent.hub.wait_registered(job_id, timeout=10)
    return handle


def _job(job_id: str, *, mode: int = UNSPECIFIED, tags: tuple[str, ...] = ()) -> base.JobContext:
    config = pb.BackendConfig(app_channel=pb.AppChannelConfig(mode=mode, tags=tags))
    return base.JobContext(job_id=job_id, group="g", config=config)


async def test_snapshot_and_restore_report_bytes_and_residency(
    agent: Agent, register: Register
) -> None:
    workload = Workload()
    await _connect(agent, register, "job-1", workload, supported_modes=["offload", "discard"])
    saved = await agent.backend.snapshot(_job("job-1"), UNSPECIFIED)
    assert (saved.device_bytes, saved.host_bytes) == (4096, 4000)
    assert saved.state == {
        "residency": "none",
        "resident_tags": [],
        "missing_tags": [],
        "suspended": True,
    }
    back = await agent.backend.restore(_job("job-1"))
    assert back.device_bytes == 2048 and back.state["residency"] == "full"
    # Mode: the Snapshot call's argument wins over the request config.
    await agent.backend.snapshot(_job("job-1", mode=OFFLOAD), DISCARD)
    assert workload.calls == [
        ("snapshot", "offload", []),
        ("restore", None, []),
        ("snapshot", "discard", []),
    ]
    assert agent.backend.name == "app-channel"


async def test_staged_restore_reports_partial_then_full_residency(
    agent: Agent, register: Register
) -> None:
    workload = Workload()
    await _connect(agent, register, "job-s", workload, tags=["weights", "kv_cache"])
    await agent.backend.snapshot(_job("job-s"), UNSPECIFIED)
    weights = await agent.backend.restore(_job("job-s", tags=("weights",)))
    assert weights.state == {
        "residency": "partial",
        "resident_tags": ["weights"],
        "missing_tags": ["kv_cache"],
        "suspended": True,
    }
    # The job is partly resident: the agent must be able to recover it as RUNNING.
    assert await agent.backend.recover(_job("job-s")) == pb.JOB_STATE_RUNNING
    kv = await agent.backend.restore(_job("job-s", tags=("kv_cache",)))
    assert kv.state["residency"] == "full" and kv.state["missing_tags"] == []
    assert workload.calls == [
        ("snapshot", "offload", []),
        ("restore", None, ["weights"]),
        ("restore", None, ["kv_cache"]),
    ]


async def test_partial_snapshot_leaves_the_job_partly_resident(
    agent: Agent, register: Register
) -> None:
    workload = Workload()
    await _connect(agent, register, "job-p", workload, tags=["weights", "kv_cache"])
    result = await agent.backend.snapshot(_job("job-p", tags=("kv_cache",)), UNSPECIFIED)
    assert result.state["residency"] == "partial"
    assert result.state["resident_tags"] == ["weights"]


async def test_restore_of_a_workload_that_reports_itself_resident_sends_nothing(
    agent: Agent, register: Register
) -> None:
    workload = Workload()
    await _connect(agent, register, "job-r", workload)
    result = await agent.backend.restore(_job("job-r"))
    assert result.state["residency"] == "full"
    assert workload.calls == [] and agent.hub.commands_sent == 0


async def test_workload_failure_is_fatal_with_its_message(agent: Agent, register: Register) -> None:
    workload = Workload()
    workload.fail_with = RuntimeError("pinned memory exhausted")
    await _connect(agent, register, "job-f", workload)
    with pytest.raises(base.FatalBackendError) as info:
        await agent.backend.snapshot(_job("job-f"), UNSPECIFIED)
    message = str(info.value)
    assert message.startswith("workload 'job-f' failed snapshot command ")
    assert message.endswith(": RuntimeError: pinned memory exhausted")


async def test_no_workload_fails_clearly_without_changing_anything(agent: Agent) -> None:
    with pytest.raises(app_channel.WorkloadNotRegisteredError) as info:
        await agent.backend.snapshot(_job("nobody"), UNSPECIFIED)
    assert "no workload channel registered for job 'nobody'" in str(info.value)
    assert "register_workload" in str(info.value)
    assert isinstance(info.value, base.RefusedBackendError)


async def test_a_reconnecting_workload_is_waited_for(agent: Agent, register: Register) -> None:
    backend = app_channel.AppChannelBackend(hub=agent.hub, register_wait_s=30)
    workload = Workload()
    operation = asyncio.create_task(backend.snapshot(_job("job-late"), UNSPECIFIED))
    await _connect(agent, register, "job-late", workload)
    result = await asyncio.wait_for(operation, 30)
    assert result.state["residency"] == "none"


async def test_undeclared_mode_is_refused_before_sending(agent: Agent, register: Register) -> None:
    workload = Workload()
    await _connect(agent, register, "job-m", workload, supported_modes=["offload"])
    with pytest.raises(
        app_channel.CommandRefusedError, match="does not support suspend mode"
    ) as info:
        await agent.backend.snapshot(_job("job-m", mode=DISCARD), UNSPECIFIED)
    assert isinstance(info.value, base.RefusedBackendError)
    assert workload.calls == [] and agent.hub.commands_sent == 0


async def test_validate_refuses_undeclared_modes_and_tags(agent: Agent, register: Register) -> None:
    await _connect(
        agent, register, "job-v", Workload(), supported_modes=["offload"], tags=["weights"]
    )
    with pytest.raises(base.BackendConfigRefusedError, match="does not support suspend mode"):
        await agent.backend.validate(_job("job-v", mode=DISCARD))
    with pytest.raises(base.BackendConfigRefusedError, match=r"unknown tags \['kv_cache'\]"):
        await agent.backend.validate(_job("job-v", tags=("kv_cache",)))
    # Accepted: a declared mode and tag, or no mode at all (resolved at snapshot time).
    await agent.backend.validate(_job("job-v", mode=OFFLOAD, tags=("weights",)))
    await agent.backend.validate(_job("job-v"))
    # Nothing to check against without a workload.
    await agent.backend.validate(_job("nobody", mode=DISCARD, tags=("x",)))
    assert agent.hub.commands_sent == 0


async def test_unanswered_command_is_fatal_at_its_deadline(
    agent: Agent, register: Register
) -> None:
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stuck(mode: str, tags: list[str]) -> None:
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(30)

    handle = register(agent.address, "job-t", on_snapshot=stuck, on_restore=lambda t: None)
    assert await asyncio.to_thread(handle.wait_registered, 10)
    backend = app_channel.AppChannelBackend(hub=agent.hub, command_timeout_s=0.3)
    try:
        with pytest.raises(
            base.FatalBackendError, match=r"did not answer snapshot command .* 0\.3 s"
        ):
            await backend.snapshot(_job("job-t"), UNSPECIFIED)
    finally:
        release.set()


async def test_recover_reads_what_the_workload_reports(agent: Agent, register: Register) -> None:
    assert await agent.backend.recover(_job("job-x")) is None  # nobody connected
    workload = Workload()
    await _connect(agent, register, "job-x", workload)
    assert await agent.backend.recover(_job("job-x")) == pb.JOB_STATE_RUNNING
    await agent.backend.snapshot(_job("job-x"), UNSPECIFIED)
    assert await agent.backend.recover(_job("job-x")) == pb.JOB_STATE_SAVED


async def test_recover_can_wait_for_the_workload_to_come_back(
    agent: Agent, register: Register
) -> None:
    backend = app_channel.AppChannelBackend(hub=agent.hub, recover_wait_s=30)
    recovering = asyncio.create_task(backend.recover(_job("job-w")))
    await _connect(agent, register, "job-w", Workload())
    assert await asyncio.wait_for(recovering, 30) == pb.JOB_STATE_RUNNING


async def test_recover_does_not_guess_for_a_legacy_workload(agent: Agent) -> None:
    # llm-d's client registers without pid or residency: the backend cannot tell.
    client = grpc.aio.insecure_channel(agent.address)
    call = pb_grpc.SnapshotAgentServiceStub(client).WorkloadChannel()
    try:
        await call.write(pb.WorkloadMessage(register=pb.RegisterWorkload(job_id="job-legacy")))
        await agent.hub.wait_registered("job-legacy", timeout=10)
        assert await agent.backend.recover(_job("job-legacy")) is None
    finally:
        call.cancel()
        await client.close()


async def test_each_group_of_a_job_reaches_its_own_workload(
    agent: Agent, register: Register
) -> None:
    # One job, a sampler engine and a trainer process on the same node.
    sampler, trainer = Workload(), Workload()
    handles = {}
    for group, workload in (("sampler", sampler), ("trainer", trainer)):
        handles[group] = register(
            agent.address,
            "job-2g",
            group,
            on_snapshot=workload.on_snapshot,
            on_restore=workload.on_restore,
        )
        assert await asyncio.to_thread(handles[group].wait_registered, 10), handles[group].error
    for group in ("sampler", "trainer"):
        await agent.hub.wait_registered("job-2g", group, timeout=10)

    in_sampler = base.JobContext(job_id="job-2g", group="sampler")
    in_trainer = base.JobContext(job_id="job-2g", group="trainer")
    saved = await agent.backend.snapshot(in_sampler, UNSPECIFIED)
    assert saved.state["residency"] == "none"
    assert [c[0] for c in sampler.calls] == ["snapshot"] and trainer.calls == []
    assert await agent.backend.recover(in_sampler) == pb.JOB_STATE_SAVED
    assert await agent.backend.recover(in_trainer) == pb.JOB_STATE_RUNNING
    await agent.backend.restore(in_sampler)
    assert [c[0] for c in sampler.calls] == ["snapshot", "restore"] and trainer.calls == []
    # Neither registration replaced the other.
    assert handles["sampler"].error is None and handles["trainer"].error is None


def _services(hub: channel.ChannelHub) -> services.NodeServices:
    return services.NodeServices(
        node="node-a",
        state_dir=Path("/nonexistent"),
        hub=hub,
        processes=registration.ProcessRegistry(),
    )


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"command_timeout": 5}, "unknown app-channel setting"),
        ({"hub": "from a file"}, "unknown app-channel setting"),
        ({"command_timeout_s": 0}, "command_timeout_s must be > 0"),
        ({"register_wait_s": -1}, ">= 0"),
    ],
    ids=["unknown-key", "hub-is-no-setting", "zero-timeout", "negative-wait"],
)
def test_bad_settings_are_config_errors(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        app_channel.AppChannelBackend.create_on_node(settings, _services(channel.ChannelHub()))


def test_without_the_agent_s_hub_it_says_how_to_build_it() -> None:
    with pytest.raises(errors.ConfigError, match="create_on_node"):
        app_channel.AppChannelBackend.create({"command_timeout_s": 5})
