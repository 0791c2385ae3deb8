"""``examples/verl_timeslice.py --dry-run``: the one config key and the settings it hands verl
(no verl needed; the mode itself is tested against verl in ``test_verl.py``)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "verl_timeslice.py"


def _dry_run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dry-run", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


def test_the_launcher_selects_the_mode_and_passes_the_settings_through_ray() -> None:
    out = _dry_run("--job-id", "job-a", "--orchestrator", "orch.svc:50051", "--", "data.x=1")
    assert "trainer.v1.trainer_mode=timeslice" in out
    for setting in (
        "TIMESLICE_JOB_ID=job-a",
        "TIMESLICE_ORCH_ADDR=orch.svc:50051",
        "TIMESLICE_GROUP=gpus",  # hybrid engine: one group
        "VERL_USE_EXTERNAL_MODULES=tslice.rl.verl",
    ):
        assert setting in out.splitlines()[0]  # the launching shell's environment
        assert f"+ray_kwargs.ray_init.runtime_env.env_vars.{setting}" in out  # and Ray's
    assert out.rstrip().endswith("data.x=1")


def test_separate_pools_name_both_groups_and_no_single_group() -> None:
    out = _dry_run("--job-id", "job-b", "--trainer-group", "train", "--sampler-group", "roll")
    assert "TIMESLICE_TRAINER_GROUP=train" in out and "TIMESLICE_SAMPLER_GROUP=roll" in out
    assert "TIMESLICE_GROUP=" not in out
