"""Switches that hide their cost in the sim backend (issue 9 §2): overlapping, chunked
moves within the device's capacity, prefetch into free memory only, discarded state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.agent.sim_backends import ctx, fast
from tslice.agent.backends import base, sim
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

GiB = 1024**3
OFFLOAD = pb.SUSPEND_MODE_OFFLOAD


def node_of(tmp_path: Path, **kw: object) -> sim.SimBackend:
    """80 units of memory, 60-unit states, copies slow enough to interleave, 6 chunks."""
    settings: dict[str, object] = {
        "capacity_bytes": 80 * GiB,
        "bandwidth_bytes_per_s": 60 * GiB * 20,  # 50 ms per 60 GiB copy
        "chunks": 6,
    }
    settings.update(kw)
    return fast(tmp_path, **settings)


def watch_usage(backend: sim.SimBackend) -> list[int]:
    """Every device usage after a piece lands (the peak must stay within capacity)."""
    seen: list[int] = []
    land = backend.node.land

    def landing(**kw: object) -> None:
        land(**kw)  # type: ignore[arg-type]
        seen.append(backend.node.used_bytes())

    backend.node.land = landing  # type: ignore[method-assign]
    return seen


async def a_resident_b_saved(backend: sim.SimBackend) -> None:
    await backend.activate(ctx("b", footprint=60 * GiB))
    await backend.snapshot(ctx("b"), OFFLOAD)
    await backend.activate(ctx("a", footprint=60 * GiB))


async def test_overlapped_restore_lands_only_in_freed_memory(tmp_path: Path) -> None:
    backend = node_of(tmp_path, overlap=True)
    assert backend.overlaps_moves and not backend.prefetches
    await a_resident_b_saved(backend)
    usage = watch_usage(backend)
    parked: list[int] = []
    park = backend.node.park

    def parking(**kw: object) -> None:
        parked.append(len(usage))
        park(**kw)  # type: ignore[arg-type]

    backend.node.park = parking  # type: ignore[method-assign]
    out, back = await asyncio.gather(backend.snapshot(ctx("a"), OFFLOAD), backend.restore(ctx("b")))
    assert (out.host_bytes, back.device_bytes) == (60 * GiB, 60 * GiB)
    # The restore landed pieces while the snapshot still ran (overlap), never beyond capacity.
    assert parked[0] >= 2 and max(usage) <= 80 * GiB
    assert backend.node.resident_bytes(job="b", group="g") == 60 * GiB
    assert backend.node.resident_bytes(job="a", group="g") is None
    # The journal shows one usable state at a time: a leaves before b is complete.
    events = [(e.job, e.event) for e in device.read_journal(tmp_path / device.JOURNAL_FILE)]
    assert events[-2:] == [("a", "free"), ("b", "alloc")]


async def test_without_overlap_a_restore_beside_a_resident_fails_loudly(tmp_path: Path) -> None:
    backend = node_of(tmp_path)
    await a_resident_b_saved(backend)
    with pytest.raises(base.RefusedBackendError, match="in use by job a"):
        await backend.restore(ctx("b"))
    # With overlap too, when nothing is leaving: nothing landed, b stays saved.
    backend.overlaps_moves = True
    with pytest.raises(base.RefusedBackendError):
        await backend.restore(ctx("b"))
    assert backend.node.used_bytes() == 60 * GiB
    assert await backend.recover(ctx("b")) == pb.JOB_STATE_SAVED


async def test_prefetch_uses_free_memory_only_and_gives_it_up(tmp_path: Path) -> None:
    backend = node_of(tmp_path, capacity_bytes=130 * GiB, prefetch=True)
    await a_resident_b_saved(backend)
    assert await backend.prefetch(ctx("b")) == 60 * GiB
    assert backend.node.used_bytes() == 120 * GiB
    assert await backend.recover(ctx("b")) == pb.JOB_STATE_SAVED  # still saved: a cache
    # Another state needing the memory drops the prefetched copy, not the holder's.
    await backend.activate(ctx("c", group="h", footprint=50 * GiB))
    assert backend.node.landed_bytes(job="b", group="g") == 0
    assert backend.node.used_bytes() == 110 * GiB
    # Only what is free is used: 20 GiB free now, so only whole pieces that fit land.
    assert 0 < await backend.prefetch(ctx("b")) <= 20 * GiB
    assert backend.node.used_bytes() <= 130 * GiB


async def test_a_restore_after_a_prefetch_finds_the_bytes_there(tmp_path: Path) -> None:
    backend = node_of(tmp_path, capacity_bytes=130 * GiB, prefetch=True)
    await a_resident_b_saved(backend)
    await backend.prefetch(ctx("b"))
    moved: list[int] = []
    move = backend._move

    async def counting(what: device.Direction, piece: int, due: float) -> float:
        moved.append(piece)
        return await move(what, piece, due)

    backend._move = counting  # type: ignore[method-assign]
    await backend.snapshot(ctx("a"), OFFLOAD)
    snapshot_pieces = len(moved)
    await backend.restore(ctx("b"))
    assert len(moved) == snapshot_pieces  # nothing left to copy in
    events = [(e.job, e.event) for e in device.read_journal(tmp_path / device.JOURNAL_FILE)]
    assert events[-2:] == [("a", "free"), ("b", "alloc")]


async def test_discarded_state_moves_nothing_and_restores_by_allocating(tmp_path: Path) -> None:
    backend = node_of(tmp_path, suspend_mode="discard", bandwidth_bytes_per_s=1)
    await backend.activate(ctx("a", footprint=60 * GiB))
    # At 1 byte/s a copy of 60 GiB would never end: nothing is copied either way.
    out = await asyncio.wait_for(backend.snapshot(ctx("a"), pb.SUSPEND_MODE_UNSPECIFIED), 5)
    assert out.host_bytes == 0
    back = await asyncio.wait_for(backend.restore(ctx("a")), 5)
    assert back.device_bytes == 60 * GiB


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="chunks"):
        fast(chunks=0)
    with pytest.raises(ValueError, match="suspend_mode"):
        fast(suspend_mode="drop")
