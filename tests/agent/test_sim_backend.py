"""Simulated devices (tslice.agent.backends.simdevice) and the sim backend, without a server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from tests.agent.sim_backends import ctx, fast
from tslice.agent import app, channel
from tslice.agent import config as agent_config
from tslice.agent.backends import base, sim
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

GiB = 1024**3


# ---- SimNode --------------------------------------------------------------------------------


def test_capacity_error_names_the_device_the_need_and_the_holder() -> None:
    node = device.SimNode(node="n1", devices=2, capacity_bytes=100)
    node.allocate(job="a", group="g", bytes_per_device=60)
    with pytest.raises(device.CapacityError) as info:
        node.allocate(job="b", group="g", bytes_per_device=50)
    assert str(info.value) == (
        "restore of job b (group g) on sim0 (node n1) would need 50 bytes; "
        "60 of 100 in use by job a of group g (60 bytes)"
    )
    assert node.resident_bytes(job="b", group="g") is None
    assert node.used_bytes() == 60
    with pytest.raises(device.CapacityError, match="lower the job's footprint"):
        node.allocate(job="c", group="g", bytes_per_device=101)


def test_state_persists_and_the_journal_records_every_change(tmp_path: Path) -> None:
    node = device.SimNode(node="n1", devices=2, capacity_bytes=100, state_dir=tmp_path)
    node.allocate(job="a", group="g", bytes_per_device=60)
    saved = device.SavedState(footprint_bytes=60, host_bytes=120)
    node.park(job="a", group="g", saved=saved)
    node.allocate(job="b", group="g", bytes_per_device=30)

    reborn = device.SimNode(node="n1", devices=2, capacity_bytes=100, state_dir=tmp_path)
    assert reborn.saved(job="a", group="g") == saved
    assert reborn.resident_bytes(job="b", group="g") == 30
    assert reborn.resident_bytes(job="a", group="g") is None

    events = device.read_journal(tmp_path / device.JOURNAL_FILE)
    assert [(e.job, e.event, e.device, e.bytes) for e in events] == [
        ("a", "alloc", "sim0", 60),
        ("a", "alloc", "sim1", 60),
        ("a", "free", "sim0", 60),
        ("a", "free", "sim1", 60),
        ("b", "alloc", "sim0", 30),
        ("b", "alloc", "sim1", 30),
    ]
    assert all(e.node == "n1" and e.group == "g" for e in events)
    assert events == sorted(events, key=lambda e: e.t)


def test_one_jobs_groups_are_separate_allocations(tmp_path: Path) -> None:
    node = device.SimNode(node="n1", capacity_bytes=100, state_dir=tmp_path)
    node.allocate(job="a", group="sampler", bytes_per_device=40)
    node.allocate(job="a", group="trainer", bytes_per_device=50)
    assert node.used_bytes() == 90
    with pytest.raises(device.CapacityError, match="job a of group sampler"):
        node.allocate(job="b", group="sampler", bytes_per_device=20)
    node.park(job="a", group="trainer", saved=device.SavedState(50, 50))
    reborn = device.SimNode(node="n1", capacity_bytes=100, state_dir=tmp_path)
    assert reborn.resident_bytes(job="a", group="sampler") == 40
    assert reborn.resident_bytes(job="a", group="trainer") is None
    assert reborn.saved(job="a", group="trainer") == device.SavedState(50, 50)
    # The file keeps the shape every earlier (job, group) version wrote and read.
    assert json.loads((tmp_path / device.STATE_FILE).read_text()) == {
        "node": "n1",
        "resident": [{"job": "a", "group": "sampler", "bytes_per_device": 40}],
        "saved": [{"job": "a", "group": "trainer", "footprint_bytes": 50, "host_bytes": 50}],
    }


def test_state_file_of_the_job_keyed_format_is_read(tmp_path: Path) -> None:
    legacy = {
        "node": "n1",
        "resident": {"a": {"group": "g", "bytes_per_device": 7}},
        "saved": {"b": {"group": "h", "footprint_bytes": 5, "host_bytes": 5}},
    }
    (tmp_path / device.STATE_FILE).write_text(json.dumps(legacy))
    node = device.SimNode(node="n1", capacity_bytes=100, state_dir=tmp_path)
    assert node.resident_bytes(job="a", group="g") == 7
    assert node.saved(job="b", group="h") == device.SavedState(5, 5)


def test_read_journal_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / device.JOURNAL_FILE
    node = device.SimNode(node="n1", capacity_bytes=100, state_dir=tmp_path)
    node.allocate(job="a", group="g", bytes_per_device=1)
    with path.open("a") as f:
        f.write('{"t": 1, "node": "n1", "gr')
    assert len(device.read_journal(path)) == 1
    assert device.read_journal(tmp_path / "missing.jsonl") == []


def test_unreadable_state_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / device.STATE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="delete it to start with empty devices"):
        device.SimNode(node="n1", state_dir=tmp_path)


# ---- CopySpeed -----------------------------------------------------------------------------


def test_copy_speed_times_each_direction_at_its_own_rate() -> None:
    speed = device.CopySpeed(
        bandwidth_bytes_per_s=100, restore_bandwidth_bytes_per_s=400, latency_s=0.5
    )
    assert speed.seconds(bytes_per_device=200, direction="snapshot") == pytest.approx(2.5)
    assert speed.seconds(bytes_per_device=200, direction="restore") == pytest.approx(1.0)
    same = device.CopySpeed(bandwidth_bytes_per_s=100, latency_s=0.0)
    assert same.rate("restore") == same.rate("snapshot") == 100


def test_copy_speed_matching_reproduces_the_target_durations() -> None:
    speed = device.CopySpeed.matching(
        bytes_per_device=60 * GiB, snapshot_s=0.092, restore_s=0.030, latency_s=0.002
    )
    assert speed.latency_s == 0.002
    targets: list[tuple[device.Direction, float]] = [("snapshot", 0.092), ("restore", 0.030)]
    for direction, target in targets:
        seconds = speed.seconds(bytes_per_device=60 * GiB, direction=direction)
        assert seconds == pytest.approx(target, rel=1e-6)
    # A target below the fixed cost cannot be met: the copy part is clamped, not negative.
    floor = device.CopySpeed.matching(
        bytes_per_device=GiB, snapshot_s=0.001, restore_s=0.001, latency_s=0.002
    )
    assert floor.rate("snapshot") == floor.rate("restore") == int(GiB / 1e-4)


@pytest.mark.parametrize(
    "bad",
    [
        {"bandwidth_bytes_per_s": 0},
        {"restore_bandwidth_bytes_per_s": -1},
        {"latency_s": -0.1},
    ],
)
def test_copy_speed_refuses_impossible_rates(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        device.CopySpeed(**bad)  # type: ignore[arg-type]


# ---- SimBackend ------------------------------------------------------------------------------


async def test_restore_copies_at_the_restore_bandwidth(tmp_path: Path) -> None:
    # Snapshot ~3 ms, restore 100x slower (~0.3 s): a restore at the snapshot's bandwidth
    # would be done long before 0.25 s. (Only lower bounds: a busy machine makes copies
    # longer, never shorter, than their bandwidth says.)
    backend = fast(
        tmp_path,
        bandwidth_bytes_per_s=int(GiB / 0.003),
        restore_bandwidth_bytes_per_s=int(GiB / 0.3),
    )
    await backend.activate(ctx(footprint=GiB))
    await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD)
    began = time.monotonic()
    await backend.restore(ctx())
    assert time.monotonic() - began >= 0.25
    assert backend.node.used_bytes() == GiB


async def test_restore_bandwidth_defaults_to_the_snapshot_bandwidth() -> None:
    backend = fast(bandwidth_bytes_per_s=7 * 10**9)
    assert backend.speed.rate("restore") == backend.speed.rate("snapshot") == 7 * 10**9
    faster = fast(bandwidth_bytes_per_s=7 * 10**9, restore_bandwidth_bytes_per_s=21 * 10**9)
    assert (faster.speed.rate("snapshot"), faster.speed.rate("restore")) == (
        7 * 10**9,
        21 * 10**9,
    )


async def test_footprint_precedence() -> None:
    backend = fast(default_footprint_bytes=3 * GiB)
    assert backend.footprint(ctx()) == 3 * GiB
    assert backend.footprint(ctx(footprint=2 * GiB)) == 2 * GiB
    config = pb.BackendConfig(sim=pb.SimBackendConfig(footprint_bytes=GiB))
    assert backend.footprint(ctx(footprint=2 * GiB, config=config)) == GiB
    assert fast().default_footprint_bytes == int(10 * GiB * 0.4)


async def test_snapshot_modes_and_node_totals(tmp_path: Path) -> None:
    backend = fast(tmp_path, devices=2)
    activated = await backend.activate(ctx(footprint=GiB))
    assert activated.device_bytes == 2 * GiB
    assert await backend.activate(ctx(footprint=GiB)) == base.OpResult(device_bytes=2 * GiB)
    offload = await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD)
    assert (offload.device_bytes, offload.host_bytes) == (2 * GiB, 2 * GiB)
    assert await backend.recover(ctx()) == pb.JOB_STATE_SAVED
    restored = await backend.restore(ctx())
    assert restored.device_bytes == 2 * GiB
    discard = await backend.snapshot(ctx(), pb.SUSPEND_MODE_DISCARD)
    assert (discard.device_bytes, discard.host_bytes) == (2 * GiB, 0)
    accelerators = await backend.accelerators()
    assert [(a.id, a.memory_used_bytes) for a in accelerators] == [("sim0", 0), ("sim1", 0)]


async def test_failed_restore_gives_its_bytes_back_and_stays_saved(tmp_path: Path) -> None:
    backend = fast(tmp_path)
    await backend.activate(ctx(footprint=GiB))
    await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD)
    backend.fail_probability = 1.0
    with pytest.raises(base.FatalBackendError, match="injected failure"):
        await backend.restore(ctx())
    assert backend.node.used_bytes() == 0
    assert await backend.recover(ctx()) == pb.JOB_STATE_SAVED


async def test_failed_snapshot_leaves_the_job_resident(tmp_path: Path) -> None:
    backend = fast(tmp_path, fail_probability=1.0)
    await backend.activate(ctx(footprint=GiB))
    with pytest.raises(base.FatalBackendError):
        await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD)
    assert await backend.recover(ctx()) == pb.JOB_STATE_RUNNING


async def test_hang_lasts_until_cancelled_and_a_cut_restore_frees_its_bytes(tmp_path: Path) -> None:
    backend = fast(tmp_path)
    await backend.activate(ctx(footprint=GiB))
    await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD)
    backend.hang_probability = 1.0
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(backend.restore(ctx()), timeout=0.05)
    assert backend.node.used_bytes() == 0
    assert await backend.recover(ctx()) == pb.JOB_STATE_SAVED


async def test_recover_after_a_crash_mid_restore(tmp_path: Path) -> None:
    # As left by an agent killed mid-restore: the bytes landed, the saved copy remains.
    node = device.SimNode(node="n1", capacity_bytes=10 * GiB, state_dir=tmp_path)
    node.allocate(job="a", group="g", bytes_per_device=GiB)
    node.park(job="a", group="g", saved=device.SavedState(footprint_bytes=GiB, host_bytes=GiB))
    node.allocate(job="a", group="g", bytes_per_device=GiB)
    backend = fast(tmp_path)
    assert await backend.recover(ctx()) == pb.JOB_STATE_SAVED
    assert backend.node.used_bytes() == 0
    assert await backend.recover(ctx("other")) == pb.JOB_STATE_IDLE


async def test_restore_and_snapshot_refuse_what_the_node_does_not_hold() -> None:
    backend = fast()
    with pytest.raises(base.FatalBackendError, match="holds no memory"):
        await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD)
    with pytest.raises(base.FatalBackendError, match="no saved state"):
        await backend.restore(ctx())
    await backend.activate(ctx(footprint=GiB))
    await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD)
    with pytest.raises(base.FatalBackendError, match="restore it instead"):
        await backend.activate(ctx())
    await backend.forget(ctx())
    assert await backend.recover(ctx()) == pb.JOB_STATE_IDLE


@pytest.mark.parametrize(
    "bad",
    [
        {"bandwidth_bytes_per_s": 0},
        {"restore_bandwidth_bytes_per_s": 0},
        {"extra_latency_s": -1},
        {"fail_probability": 1.5},
        {"default_footprint_bytes": 11 * GiB},
        {"devices": 0},
        {"latency_s": -1},
    ],
)
def test_invalid_settings_are_value_errors(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        fast(**bad)


async def test_noop_backend_moves_nothing() -> None:
    from tslice.agent.backends import noop

    backend = noop.NoopBackend.create({"delay_s": 0.0})
    assert await backend.snapshot(ctx(), pb.SUSPEND_MODE_OFFLOAD) == base.OpResult()
    assert await backend.restore(ctx()) == base.OpResult()
    assert await backend.recover(ctx()) is None
    with pytest.raises(ValueError):
        noop.NoopBackend(delay_s=-1)


async def test_on_an_agent_the_devices_are_the_nodes_and_live_in_its_state_dir(
    tmp_path: Path,
) -> None:
    cfg = agent_config.load(
        overrides={
            "node_name": "node-s",
            "state_dir": str(tmp_path),
            "default_backend": "sim",
            "sim": {"devices": 2, "capacity": "10GiB"},
            "backend_settings": {"sim": {"latency_s": 0.0}},
        }
    )
    built = await app.build_backends(cfg, hub=channel.ChannelHub())
    backend = built["sim"]
    assert isinstance(backend, sim.SimBackend)
    assert (backend.node.node, backend.node.devices) == ("node-s", 2)
    assert (backend.node.capacity_bytes, backend.speed.latency_s) == (10 * GiB, 0.0)
    await backend.activate(ctx())
    assert [e.node for e in device.read_journal(tmp_path / device.JOURNAL_FILE)] == ["node-s"] * 2
