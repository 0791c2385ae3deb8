"""The manager's side of Kubernetes mode, in process: groups added, restarted on new nodes
(what they share devices with worked out again) and removed, their state kept on disk."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest

from tslice.orchestrator import config, metrics
from tslice.orchestrator.events import bus as events
from tslice.orchestrator.group import driver as group
from tslice.orchestrator.group import manager
from tslice.orchestrator.persistence import records, store
from tslice.orchestrator.switch import pool as agents

N1 = config.NodeRef("gpu-1", "127.0.0.1:1")
N2 = config.NodeRef("gpu-2", "127.0.0.1:2")
N3 = config.NodeRef("gpu-3", "127.0.0.1:3")


@pytest.fixture
async def groups(
    tmp_path: pathlib.Path,
) -> AsyncIterator[tuple[manager.GroupManager, group.Services]]:
    cfg = config.build(overrides={"kubernetes": True, "state_dir": tmp_path, "shutdown_grace_s": 0})
    db = await store.Store.open(tmp_path)
    pool = agents.AgentPool(rpc_timeout_s=1, operation_timeout_s=1, wait_chunk_s=1)
    services = group.Services(
        cfg=cfg, db=db, pool=pool, bus=events.EventBus(), metrics=metrics.OrchestratorMetrics()
    )
    groups = manager.GroupManager(services)
    await groups.start()
    try:
        yield groups, services
    finally:
        await groups.stop(grace_s=0)
        await pool.close()
        await db.close()


async def test_groups_come_change_and_go(
    groups: tuple[manager.GroupManager, group.Services],
) -> None:
    manager_, services = groups
    await manager_.add_group("trainer", (N1, N2))
    await manager_.add_group("sampler", (N2,))
    assert services.arbiter.conflicts("sampler") == {"trainer"}
    await manager_.replace_nodes("trainer", (N1,))
    trainer = manager_.get("trainer")
    assert trainer is not None and trainer.nodes == (N1,)
    # They share no node any more: neither waits for the other's devices.
    assert services.arbiter.conflicts("sampler") == frozenset()
    assert services.arbiter.conflicts("trainer") == frozenset()
    await manager_.remove_group("sampler", "its node was unlabelled")
    assert manager_.ids() == ["trainer"]
    assert "group.timeslice.io/sampler=true" in manager_.not_found_message("sampler")


async def test_a_group_restarting_on_new_nodes_keeps_its_holders_claim(
    groups: tuple[manager.GroupManager, group.Services], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by reading: the group let go of the device claim as it stopped and took it
    # again for its holder once back, so a waiter of a group sharing its devices could
    # be granted in between: two jobs on the shared devices.
    manager_, services = groups
    held = records.LockRecord(
        holder="job-a", resident="job-a", grant_epoch=1, switch_count=1, next_seq=2,
        queue=(), intent=None, footprints=(),
    )  # fmt: skip
    loaded = {"trainer": ([(N1.name, N1.address), (N2.name, N2.address)], held)}

    async def load() -> dict[str, tuple[list[tuple[str, str]], records.LockRecord]]:
        return loaded

    monkeypatch.setattr(services.db, "load", load)
    await manager_.add_group("trainer", (N1, N2))
    await manager_.add_group("sampler", (N2,))
    arbiter = services.arbiter
    assert arbiter.request("sampler", "job-b") is None  # job-a holds the shared devices
    await manager_.replace_nodes("trainer", (N1, N2, N3))
    trainer = manager_.get("trainer")
    assert trainer is not None and trainer.lock.holder == "job-a"
    # Through the restart, the claim stayed with trainer's holder: sampler still waits.
    assert "sampler" in arbiter.released("trainer")
    assert "trainer" not in arbiter.released("sampler")
