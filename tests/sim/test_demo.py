"""The demo's copy speeds: each pool's node snapshots and restores as the trace recorded."""

from __future__ import annotations

import pytest

from tslice.agent.backends import simdevice as device
from tslice.common import errors
from tslice.demo import runner
from tslice.phases import derive, trace

GB = 10**9


@pytest.fixture(scope="module")
def model() -> trace.PhaseModel:
    return derive.load()


def test_derived_speeds_reproduce_the_recorded_medians_per_direction(
    model: trace.PhaseModel,
) -> None:
    config = runner.DemoConfig()
    speeds = runner.derived_speeds(config, model)
    for pool, footprint in config.footprints(model).items():
        recorded = model.switch[pool]
        stats: list[tuple[device.Direction, trace.Stat]] = [
            ("snapshot", recorded.snapshot),
            ("restore", recorded.restore),
        ]
        for direction, stat in stats:
            demo_s = speeds[pool].seconds(bytes_per_device=footprint, direction=direction)
            assert demo_s * config.time_scale == pytest.approx(stat.median, rel=1e-3)
        # The recorded run restored faster than it snapshotted; the sim must too.
        assert speeds[pool].rate("restore") > 2 * speeds[pool].rate("snapshot")
        assert speeds[pool].latency_s == config.sim_latency_s


def test_sim_bandwidth_overrides_both_directions_and_restore_bandwidth_restores(
    model: trace.PhaseModel,
) -> None:
    both = runner.derived_speeds(runner.DemoConfig(sim_bandwidth_bytes_per_s=500 * GB), model)
    for speed in both.values():
        assert speed.rate("snapshot") == speed.rate("restore") == 500 * GB
    split = runner.derived_speeds(
        runner.DemoConfig(
            sim_bandwidth_bytes_per_s=500 * GB, sim_restore_bandwidth_bytes_per_s=1500 * GB
        ),
        model,
    )
    for speed in split.values():
        assert (speed.rate("snapshot"), speed.rate("restore")) == (500 * GB, 1500 * GB)
    derived = runner.derived_speeds(runner.DemoConfig(), model)
    only_restore = runner.derived_speeds(
        runner.DemoConfig(sim_restore_bandwidth_bytes_per_s=1500 * GB), model
    )
    for pool, speed in only_restore.items():
        assert speed.rate("snapshot") == derived[pool].rate("snapshot")
        assert speed.rate("restore") == 1500 * GB


def test_restore_bandwidth_must_be_positive() -> None:
    with pytest.raises(errors.ConfigError, match="--sim-restore-bandwidth must be positive"):
        runner.DemoConfig(sim_restore_bandwidth_bytes_per_s=0).check()
