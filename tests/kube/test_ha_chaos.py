"""Issue 22's acceptance, short form: HA mode's chaos run (tests/kube/ha_chaos.py: leaders
and followers SIGKILLed and SIGSTOPped, the Lease and state ConfigMaps deleted by hand,
holders killed, at random moments) shows no violation in the device journals and loses
no queued job. ``bench/soak_kubernetes.py`` runs the long form.

The seed is printed (and in the assertion message): ``python bench/soak_kubernetes.py
--seed SEED`` draws the same disruptions again."""

from __future__ import annotations

import os
import pathlib

import pytest

pytest.importorskip("lightkube")

from tests.kube import ha_chaos
from tests.kube.emulator import ApiServerEmulator
from tslice.chaos import runner

SEED = int(os.environ.get("TSLICE_CHAOS_SEED", "1"))

# Some 25 s of disruptions over a cluster of processes (about 60 s with its start, the
# jobs' drain and the checks).
pytestmark = pytest.mark.slow


async def test_a_short_ha_chaos_run_has_no_violation_and_loses_no_job(
    api: ApiServerEmulator, tmp_path: pathlib.Path
) -> None:
    config = runner.ChaosConfig(
        seed=SEED,
        duration_s=25.0,
        slots=3,
        steps=6,
        kill_gap_s=(1.0, 2.5),
        fail_probability=0.0,
        hang_probability=0.0,
    )
    result = await ha_chaos.run(config, api, tmp_path / "run")
    print(result.summary())

    assert result.ok, result.summary()
    assert result.violations == () and result.jobs_lost == ()
    # Not vacuous: every kind of disruption happened, groups changed hands.
    assert all(result.kills[kind] >= 1 for kind in ha_chaos.KINDS), result.summary()
    assert result.jobs_completed >= 3 and result.switches >= 5, result.summary()
