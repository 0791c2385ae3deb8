"""What every group of one orchestrator shares (its configuration, store, agents, bus...)."""

from __future__ import annotations

import dataclasses

from tslice.orchestrator import config, metrics
from tslice.orchestrator.events import bus
from tslice.orchestrator.group import lock, overlap
from tslice.orchestrator.persistence import health, store
from tslice.orchestrator.sets import coordinator
from tslice.orchestrator.switch import pool


@dataclasses.dataclass(frozen=True)
class Services:
    """What every group of one orchestrator shares."""

    cfg: config.OrchestratorConfig
    db: store.LockStore
    pool: pool.AgentPool
    bus: bus.EventBus
    metrics: metrics.OrchestratorMetrics
    #: Groups that share devices take turns through it (see overlap).
    arbiter: overlap.DeviceArbiter = dataclasses.field(default_factory=overlap.DeviceArbiter)
    #: Sets of groups acquired all-or-nothing are granted through it (see sets).
    sets: coordinator.SetCoordinator = dataclasses.field(default_factory=coordinator.SetCoordinator)
    #: Each group's lock, by id: a group kept for a set reads who holds the others.
    locks: dict[str, lock.GroupLock] = dataclasses.field(default_factory=dict)
    #: Whether the state can be written, and why not (see persistence.health).
    store_health: health.StoreHealth = dataclasses.field(default_factory=health.StoreHealth)
