"""A real local cluster (orchestrator + two sim agents as processes) shared by a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tslice.sim import cluster

GiB = 1024**3


@pytest.fixture(scope="module")
def two_pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.LocalCluster]:
    """node-a carries group sampler, node-b group trainer; copies take ~1 ms."""
    base: Path = tmp_path_factory.mktemp("cluster")
    agents = [
        cluster.SimAgent(name=name, bandwidth_bytes_per_s=100 * 10**12, latency_s=0.001)
        for name in ("node-a", "node-b")
    ]
    with cluster.LocalCluster(
        agents=agents, groups={"sampler": ["node-a"], "trainer": ["node-b"]}, base_dir=base
    ) as local:
        yield local
