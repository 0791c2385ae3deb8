"""ChannelHub against a raw gRPC workload stream (real grpc.aio server, TCP and Unix socket).

The raw client lets the tests see exactly what crosses the wire: which commands
were sent, with which ids, modes, tags and deadlines, and what happens when the
peer goes silent, disconnects or is replaced.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.agent.raw_workload import (
    DISCARD,
    OFFLOAD,
    UNSPECIFIED,
    HubServer,
    RawWorkload,
    start_hub,
)
from tslice.agent import channel
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import residency


@pytest.fixture
async def hub_server() -> AsyncIterator[HubServer]:
    running = await start_hub(
        channel.ChannelHub(ping_interval_s=0.2, missed_pings=3), "127.0.0.1:0"
    )
    yield running
    await running.hub.close()
    await running.server.stop(grace=None)


@pytest.fixture
async def raw(hub_server: HubServer) -> AsyncIterator[RawWorkload]:
    workload = RawWorkload(hub_server.address)
    yield workload
    await workload.close()


async def _status_of_refused(address: str, message: pb.WorkloadMessage) -> grpc.aio.AioRpcError:
    workload = RawWorkload(address)
    try:
        await workload.call.write(message)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await workload.call.read()
        return info.value
    finally:
        await workload.close()


# ---- registration -------------------------------------------------------------------


async def test_first_message_must_be_a_registration(hub_server: HubServer) -> None:
    err = await _status_of_refused(
        hub_server.address, pb.WorkloadMessage(result=pb.CommandResult(command_id="x", ok=True))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first WorkloadChannel message must be a RegisterWorkload" in (err.details() or "")
    assert hub_server.hub.known_jobs() == []


@pytest.mark.parametrize(
    ("register", "expected"),
    [
        (pb.RegisterWorkload(job_id=""), "job_id is required"),
        (pb.RegisterWorkload(job_id="bad id"), "job_id 'bad id' is malformed"),
        (pb.RegisterWorkload(job_id="j", group="bad group"), "group 'bad group' is malformed"),
        (
            pb.RegisterWorkload(
                job_id="j", capabilities=pb.WorkloadCapabilities(supported_modes=[UNSPECIFIED])
            ),
            "supported_modes contains SUSPEND_MODE_UNSPECIFIED",
        ),
        (
            pb.RegisterWorkload(
                job_id="j",
                capabilities=pb.WorkloadCapabilities(
                    supported_modes=[OFFLOAD], default_mode=DISCARD
                ),
            ),
            "default_mode SUSPEND_MODE_DISCARD is not among supported_modes",
        ),
        (
            pb.RegisterWorkload(
                job_id="j",
                capabilities=pb.WorkloadCapabilities(tags=["weights"]),
                resident_tags=["kv"],
            ),
            "resident_tags ['kv'] are not among the declared tags",
        ),
        (
            pb.RegisterWorkload(job_id="j", rank=-1),
            "rank must be between 0 and 4095 (which of the job's processes on this node), got -1",
        ),
        (pb.RegisterWorkload(job_id="j", rank=4096), "rank must be between 0 and 4095"),
    ],
    ids=[
        "empty-id",
        "bad-id",
        "bad-group",
        "unspecified-mode",
        "default-not-supported",
        "stray-tag",
        "negative-rank",
        "rank-too-high",
    ],
)
async def test_bad_registration_is_refused_with_a_precise_message(
    hub_server: HubServer, register: pb.RegisterWorkload, expected: str
) -> None:
    err = await _status_of_refused(hub_server.address, pb.WorkloadMessage(register=register))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in (err.details() or "")
    assert hub_server.hub.known_jobs() == []


async def test_registration_is_acknowledged_by_a_ping_and_reported(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    events: list[channel.ChannelEvent] = []
    hub_server.hub.add_listener(events.append)
    await raw.register("job-a", modes=[OFFLOAD], tags=["weights", "kv_cache"], pid=1234)
    state = await hub_server.hub.wait_registered("job-a", timeout=5)
    assert hub_server.hub.is_registered("job-a")
    assert hub_server.hub.known_jobs() == ["job-a"]
    # Over TCP the pid field is never trusted (nothing bound this process): not known.
    assert state.group == "g" and state.pid == 0
    assert state.tags == ("weights", "kv_cache")
    assert state.residency == residency.FULL and state.state_reported
    assert [e.kind for e in events] == ["registered"]


async def test_second_registration_on_the_same_stream_is_refused(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a")
    await raw.call.write(pb.WorkloadMessage(register=pb.RegisterWorkload(job_id="job-a")))
    assert await raw.final_status() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already registered on this stream" in (await raw.call.details() or "")
    await hub_server.hub.wait_unregistered("job-a", timeout=5)


# ---- commands -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "default", "expected"),
    [
        (DISCARD, OFFLOAD, DISCARD),
        (UNSPECIFIED, DISCARD, DISCARD),
        (UNSPECIFIED, UNSPECIFIED, OFFLOAD),
    ],
    ids=["request-wins", "workload-default", "offload-fallback"],
)
async def test_snapshot_mode_is_resolved_before_sending(
    hub_server: HubServer, raw: RawWorkload, requested: int, default: int, expected: int
) -> None:
    await raw.register("job-a", default_mode=default)
    task = asyncio.create_task(hub_server.hub.snapshot("job-a", mode=requested, timeout_s=5))
    command = await raw.next_command()
    assert command.WhichOneof("command") == "snapshot"
    assert command.snapshot.mode == expected
    await raw.answer(command)
    outcome = await task
    assert outcome.ok and outcome.mode == expected


async def test_command_carries_uuid_and_deadline_and_result_is_routed(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", tags=["weights", "kv_cache"])
    task = asyncio.create_task(hub_server.hub.snapshot("job-a", tags=["kv_cache"], timeout_s=7.5))
    command = await raw.next_command()
    uuid.UUID(command.command_id)
    assert command.deadline_ms == 7500
    assert list(command.snapshot.tags) == ["kv_cache"]
    await raw.call.write(
        pb.WorkloadMessage(
            result=pb.CommandResult(
                command_id=command.command_id, ok=True, device_bytes=123, host_bytes=45
            )
        )
    )
    outcome = await task
    assert (outcome.command_id, outcome.device_bytes, outcome.host_bytes) == (
        command.command_id,
        123,
        45,
    )
    # Only the KV cache left the device: partly resident.
    assert outcome.state.residency == residency.PARTIAL
    assert outcome.state.resident_tags == ("weights",)
    assert outcome.state.missing_tags == ("kv_cache",)


async def test_failed_result_is_returned_with_the_workload_error(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a")
    task = asyncio.create_task(hub_server.hub.restore("job-a", timeout_s=5))
    command = await raw.next_command()
    assert command.WhichOneof("command") == "restore"
    await raw.answer(command, ok=False, error="RuntimeError: CUDA out of memory")
    outcome = await task
    assert not outcome.ok and outcome.error == "RuntimeError: CUDA out of memory"


async def test_unsupported_mode_is_refused_before_anything_is_sent(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", modes=[OFFLOAD])
    with pytest.raises(channel.CommandRefusedError, match="does not support suspend mode"):
        await hub_server.hub.snapshot("job-a", mode=DISCARD, timeout_s=5)
    assert hub_server.hub.commands_sent == 0
    # The next command on the wire is the one sent after the refusal: nothing went before it.
    task = asyncio.create_task(hub_server.hub.restore("job-a", timeout_s=5))
    command = await raw.next_command()
    assert command.WhichOneof("command") == "restore"
    await raw.answer(command)
    await task
    assert hub_server.hub.commands_sent == 1


async def test_unknown_tag_is_refused_before_anything_is_sent(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", tags=["weights", "kv_cache"])
    with pytest.raises(channel.CommandRefusedError, match=r"unknown tags \['lora'\]"):
        await hub_server.hub.restore("job-a", tags=["weights", "lora"], timeout_s=5)
    with pytest.raises(channel.CommandRefusedError, match="unknown tags"):
        await hub_server.hub.snapshot("job-a", tags=["optimizer"], timeout_s=5)
    assert hub_server.hub.commands_sent == 0


async def test_tags_are_free_when_the_workload_declared_none(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a")
    task = asyncio.create_task(hub_server.hub.restore("job-a", tags=["anything"], timeout_s=5))
    command = await raw.next_command()
    assert list(command.restore.tags) == ["anything"]
    await raw.answer(command)
    assert (await task).ok


async def test_no_workload_is_a_clear_error(hub_server: HubServer) -> None:
    with pytest.raises(channel.NoWorkloadError, match="register_workload"):
        await hub_server.hub.snapshot("nobody", timeout_s=1)


async def test_timeout_fails_the_command_and_a_late_success_still_counts(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", modes=[OFFLOAD], pid=7)
    task = asyncio.create_task(hub_server.hub.snapshot("job-a", timeout_s=0.3))
    command = await raw.next_command()
    with pytest.raises(channel.CommandTimeoutError) as info:
        await task
    assert f"did not answer snapshot command {command.command_id} within 0.3 s" in str(info.value)
    state = hub_server.hub.session_state("job-a")
    assert state is not None and not state.suspended
    # The workload finished after all: the hub now knows its state is off the device.
    await raw.answer(command)
    await raw.sync()
    state = hub_server.hub.session_state("job-a")
    assert state is not None and state.suspended and state.residency == residency.NONE


async def test_unknown_result_ids_are_dropped(hub_server: HubServer, raw: RawWorkload) -> None:
    await raw.register("job-a")
    await raw.call.write(
        pb.WorkloadMessage(result=pb.CommandResult(command_id="no-such-command", ok=True))
    )
    await raw.sync()
    state = hub_server.hub.session_state("job-a")
    assert state is not None and not state.suspended


async def test_disconnect_mid_command_fails_it_promptly(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a")
    task = asyncio.create_task(hub_server.hub.snapshot("job-a", timeout_s=60))
    await raw.next_command()
    raw.call.cancel()
    with pytest.raises(channel.WorkloadDisconnectedError, match="disconnected before answering"):
        await asyncio.wait_for(task, 10)
    await hub_server.hub.wait_unregistered("job-a", timeout=5)


async def test_a_new_stream_of_the_same_workload_supersedes_it_and_reconciles(
    hub_server: HubServer,
) -> None:
    events: list[channel.ChannelEvent] = []
    hub_server.hub.add_listener(events.append)
    first = RawWorkload(hub_server.address, instance="instance-1")
    await first.register("job-a", tags=["weights", "kv_cache"])
    task = asyncio.create_task(hub_server.hub.snapshot("job-a", timeout_s=60))
    await first.next_command()

    # The same workload (its instance token) reconnecting on a new stream.
    second = RawWorkload(hub_server.address, instance="instance-1")
    try:
        await second.register(
            "job-a", tags=["weights", "kv_cache"], suspended=True, resident_tags=["weights"]
        )
        with pytest.raises(channel.WorkloadDisconnectedError, match="superseded"):
            await asyncio.wait_for(task, 10)
        assert await first.final_status() == grpc.StatusCode.ABORTED
        assert "superseded by a new stream" in (await first.call.details() or "")
        state = hub_server.hub.session_state("job-a")
        assert state is not None
        assert (state.suspended, state.resident_tags, state.residency) == (
            True,
            ("weights",),
            residency.PARTIAL,
        )
        assert [e.kind for e in events] == ["registered", "closed", "registered"]
        # The superseded stream ending must not unregister the new session.
        assert hub_server.hub.known_jobs() == ["job-a"]
        task2 = asyncio.create_task(hub_server.hub.restore("job-a", tags=["kv_cache"], timeout_s=5))
        command = await second.next_command()
        await second.answer(command)
        assert (await task2).state.residency == residency.FULL
    finally:
        await first.close()
        await second.close()


async def test_reported_suspension_without_tags_means_nothing_resident(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", suspended=True, pid=3)
    state = await hub_server.hub.wait_registered("job-a", timeout=5)
    assert state.suspended and state.residency == residency.NONE


async def test_legacy_registration_reports_no_state(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    # llm-d's client sends neither pid nor residency: the hub must not pretend to know.
    await raw.register("job-a", features=None)
    state = await hub_server.hub.wait_registered("job-a", timeout=5)
    assert not state.state_reported and not state.keepalive


async def test_a_pid_alone_does_not_declare_a_state_report(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", pid=42, features=pb.WorkloadFeatures(keepalive=True))
    state = await hub_server.hub.wait_registered("job-a", timeout=5)
    assert state.pid == 0 and not state.state_reported  # a claimed pid is not trusted


async def test_reported_state_without_the_declaration_is_refused(hub_server: HubServer) -> None:
    register = pb.RegisterWorkload(job_id="job-a", suspended=True)
    err = await _status_of_refused(hub_server.address, pb.WorkloadMessage(register=register))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "features.reports_state" in (err.details() or "")
    assert hub_server.hub.known_jobs() == []


async def test_declared_features_are_known_from_the_registration_on(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    events: list[channel.ChannelEvent] = []
    hub_server.hub.add_listener(events.append)
    await raw.register("job-a", ack=False)
    await hub_server.hub.wait_registered("job-a", timeout=5)
    # Before the workload answered anything.
    assert events[0].state.keepalive and events[0].state.state_reported


# ---- one session per (job, group) -----------------------------------------------------


async def test_one_job_registers_one_workload_per_group(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    # A sampler engine and a trainer process of the same job on one node.
    trainer = RawWorkload(hub_server.address)
    try:
        await raw.register("job-a", group="sampler", pid=1)
        await trainer.register("job-a", group="trainer", pid=2)
        sampler_state = await hub_server.hub.wait_registered("job-a", "sampler", timeout=5)
        trainer_state = await hub_server.hub.wait_registered("job-a", "trainer", timeout=5)
        assert (sampler_state.group, trainer_state.group) == ("sampler", "trainer")
        assert hub_server.hub.known_sessions() == [("job-a", "sampler"), ("job-a", "trainer")]
        assert hub_server.hub.known_jobs() == ["job-a"]
        # Neither registration replaced the other: both streams are still served.
        await raw.sync()
        await trainer.sync()
    finally:
        await trainer.close()


async def test_a_snapshot_for_one_group_reaches_only_that_workload(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    trainer = RawWorkload(hub_server.address)
    try:
        await raw.register("job-a", group="sampler")
        # No keepalive: the trainer's stream carries nothing but commands meant for it.
        await trainer.register(
            "job-a", group="trainer", features=pb.WorkloadFeatures(reports_state=True)
        )
        await hub_server.hub.wait_registered("job-a", "trainer", timeout=5)
        trainer_inbox = Inbox(trainer)
        task = asyncio.create_task(hub_server.hub.snapshot("job-a", "sampler", timeout_s=5))
        command = await raw.next_command()
        assert command.WhichOneof("command") == "snapshot"
        await raw.answer(command, device_bytes=7)
        outcome = await task
        assert outcome.device_bytes == 7 and outcome.state.group == "sampler"
        await trainer_inbox.assert_nothing_arrives(0.3)
        await trainer_inbox.close()
        sampler = hub_server.hub.session_state("job-a", "sampler")
        untouched = hub_server.hub.session_state("job-a", "trainer")
        assert sampler is not None and sampler.residency == residency.NONE
        assert untouched is not None and untouched.residency == residency.FULL
    finally:
        await trainer.close()


async def test_a_second_workload_of_a_group_is_refused_another_groups_is_not(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    trainer = RawWorkload(hub_server.address)
    newer = RawWorkload(hub_server.address, instance="someone-else")
    try:
        await raw.register("job-a", group="sampler")
        await trainer.register("job-a", group="trainer")
        await newer.register("job-a", group="sampler", ack=False)
        assert await newer.final_status() == grpc.StatusCode.ALREADY_EXISTS
        details = await newer.call.details() or ""
        assert "job 'job-a' (group 'sampler') already has a live workload" in details
        await raw.sync()  # the live session of the group lives on
        await trainer.sync()
        assert hub_server.hub.known_sessions() == [("job-a", "sampler"), ("job-a", "trainer")]
    finally:
        await trainer.close()
        await newer.close()


async def test_a_request_without_a_group_is_refused_when_the_job_has_several(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    trainer = RawWorkload(hub_server.address)
    try:
        await raw.register("job-a", group="sampler")
        await trainer.register("job-a", group="trainer")
        assert hub_server.hub.is_registered("job-a")
        assert hub_server.hub.session_state("job-a") is None
        sent = hub_server.hub.commands_sent
        with pytest.raises(channel.CommandRefusedError, match=r"sampler, trainer.*name the group"):
            await hub_server.hub.snapshot("job-a", timeout_s=5)
        assert hub_server.hub.commands_sent == sent
    finally:
        await trainer.close()


async def test_a_group_without_its_own_session_means_the_jobs_only_one(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    # llm-d's workloads register without a group: that session serves every group's request.
    await raw.register("job-a", group="", features=None)
    await hub_server.hub.wait_registered("job-a", timeout=5)
    assert hub_server.hub.is_registered("job-a", "sampler")
    task = asyncio.create_task(hub_server.hub.restore("job-a", "sampler", timeout_s=5))
    command = await raw.next_command()
    await raw.answer(command)
    assert (await task).ok
    assert not hub_server.hub.is_registered("job-b", "sampler")


async def test_a_session_of_another_group_does_not_serve_a_group(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", group="sampler")
    assert not hub_server.hub.is_registered("job-a", "trainer")
    with pytest.raises(channel.NoWorkloadError, match="group 'trainer'"):
        await hub_server.hub.snapshot("job-a", "trainer", timeout_s=5)
    with pytest.raises(TimeoutError):
        await hub_server.hub.wait_registered("job-a", "trainer", timeout=0.05)


# ---- keepalive ----------------------------------------------------------------------


async def test_workload_ping_is_answered_with_pong(hub_server: HubServer, raw: RawWorkload) -> None:
    await raw.register("job-a")
    await raw.sync()


async def test_silent_peer_is_closed_after_missed_pings() -> None:
    running = await start_hub(
        channel.ChannelHub(ping_interval_s=0.05, missed_pings=2), "127.0.0.1:0"
    )
    workload = RawWorkload(running.address)
    try:
        await workload.register("job-a")  # answers the first ping, so keepalive is on
        task = asyncio.create_task(running.hub.snapshot("job-a", timeout_s=60))
        # Never answer anything again.
        with pytest.raises(channel.WorkloadDisconnectedError, match="no message from workload"):
            await asyncio.wait_for(task, 10)
        await running.hub.wait_unregistered("job-a", timeout=5)
        code = await workload.final_status()
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        await workload.close()
        await running.hub.close()
        await running.server.stop(grace=None)


async def test_pings_continue_while_a_command_runs_and_keep_the_session() -> None:
    running = await start_hub(
        channel.ChannelHub(ping_interval_s=0.1, missed_pings=3), "127.0.0.1:0"
    )
    workload = RawWorkload(running.address)
    try:
        await workload.register("job-a")
        task = asyncio.create_task(running.hub.snapshot("job-a", timeout_s=60))
        command = await workload.next_command()
        # Answer ten pings (ten intervals, over three times the silence limit) before the result.
        for _ in range(10):
            message = await workload.call.read()
            assert message.WhichOneof("command") == "ping"
            await workload.call.write(pb.WorkloadMessage(pong=message.ping))
        await workload.answer(command)
        assert (await task).ok
        assert running.hub.is_registered("job-a")
    finally:
        await workload.close()
        await running.hub.close()
        await running.server.stop(grace=None)


class Inbox:
    """Reads the stream in the background (a cancelled ``read()`` would cancel the call)."""

    def __init__(self, workload: RawWorkload) -> None:
        self.received: asyncio.Queue[pb.AgentCommand] = asyncio.Queue()
        self._task = asyncio.create_task(self._read(workload))

    async def _read(self, workload: RawWorkload) -> None:
        while (message := await workload.call.read()) is not grpc.aio.EOF:
            await self.received.put(message)

    async def next(self) -> pb.AgentCommand:
        return await asyncio.wait_for(self.received.get(), 10)

    async def assert_nothing_arrives(self, window_s: float) -> None:
        with pytest.raises(asyncio.TimeoutError):
            message = await asyncio.wait_for(self.received.get(), window_s)
            pytest.fail(f"the agent sent {message}")

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_llmd_workload_gets_nothing_but_snapshot_and_restore() -> None:
    # llm-d's workload library logs an error for every command it does not know.
    running = await start_hub(
        channel.ChannelHub(ping_interval_s=0.02, missed_pings=1), "127.0.0.1:0"
    )
    workload = RawWorkload(running.address)
    try:
        await workload.register("job-a", modes=[OFFLOAD], features=None)
        await running.hub.wait_registered("job-a", timeout=5)
        inbox = Inbox(workload)
        # 25 ping intervals: a keepalive peer would have been pinged, and closed for silence.
        await inbox.assert_nothing_arrives(0.5)
        for kind in ("snapshot", "restore"):
            task = asyncio.create_task(getattr(running.hub, kind)("job-a", timeout_s=5))
            command = await inbox.next()
            assert command.WhichOneof("command") == kind
            await workload.answer(command)
            assert (await task).ok
        await inbox.assert_nothing_arrives(0.5)
        await inbox.close()
        state = running.hub.session_state("job-a")
        assert state is not None and not state.keepalive
    finally:
        await workload.close()
        await running.hub.close()
        await running.server.stop(grace=None)


async def test_undeclared_peer_that_pings_is_answered_but_never_pinged() -> None:
    running = await start_hub(
        channel.ChannelHub(ping_interval_s=0.02, missed_pings=1), "127.0.0.1:0"
    )
    workload = RawWorkload(running.address)
    try:
        await workload.register("job-a", features=None)
        await workload.sync()  # its own ping is answered
        inbox = Inbox(workload)
        await inbox.assert_nothing_arrives(0.5)
        await inbox.close()
        state = running.hub.session_state("job-a")
        # A pong-shaped conversation does not turn keepalive on: only the declaration does.
        assert state is not None and not state.keepalive
    finally:
        await workload.close()
        await running.hub.close()
        await running.server.stop(grace=None)


async def test_hub_close_ends_streams_with_unavailable(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a")
    await hub_server.hub.close()
    assert await raw.final_status() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (await raw.call.details() or "")
    assert hub_server.hub.known_jobs() == []


async def test_cancelled_caller_leaves_late_result_applied(
    hub_server: HubServer, raw: RawWorkload
) -> None:
    await raw.register("job-a", pid=5)
    task = asyncio.create_task(hub_server.hub.snapshot("job-a", timeout_s=60))
    command = await raw.next_command()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await raw.answer(command)
    await raw.sync()
    state = hub_server.hub.session_state("job-a")
    assert state is not None and state.suspended


async def test_wait_registered_times_out_with_a_message(hub_server: HubServer) -> None:
    with pytest.raises(TimeoutError, match="waiting for workload nobody registered"):
        await hub_server.hub.wait_registered("nobody", timeout=0.05)


# ---- Unix socket --------------------------------------------------------------------


async def test_channel_over_a_unix_socket() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "agent.sock")
        running = await start_hub(channel.ChannelHub(), f"unix:{path}")
        workload = RawWorkload(f"unix:{path}")
        try:
            await workload.register("job-u", modes=[OFFLOAD, DISCARD])
            task = asyncio.create_task(running.hub.snapshot("job-u", mode=DISCARD, timeout_s=5))
            command = await workload.next_command()
            assert command.snapshot.mode == DISCARD
            await workload.answer(command, device_bytes=99)
            assert (await task).device_bytes == 99
        finally:
            await workload.close()
            await running.hub.close()
            await running.server.stop(grace=None)
