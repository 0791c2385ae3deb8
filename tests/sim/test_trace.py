"""Phase model derived from the recorded trace (and from a synthetic one with known numbers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tslice.common import errors
from tslice.sim import trace

PACKAGED = Path(trace.__file__).parent / "traces" / trace.TRACE_NAME
SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces" / trace.TRACE_NAME


def synthetic(
    *,
    sync: float,
    sample: float,
    reward: float,
    train: float,
    wait: float,
    steps: int = 6,
    period: float = 300.0,
) -> dict[str, Any]:
    """One job with exactly known phases; the other pool is always free."""
    windows: dict[str, list[dict[str, Any]]] = {"sampler": [], "trainer": []}
    events: list[dict[str, Any]] = []

    def acquired(t: float, pool: str, wait_s: float) -> None:
        events.append(
            {
                "t": t,
                "kind": "acquired",
                "job": "A",
                "pool": pool,
                "wait_ms": wait_s * 1000,
                "restore_ms": 0,
                "step": 0,
            }
        )

    t = 0.0
    tr0 = 0.0
    acquired(tr0, "trainer", 0)
    for _ in range(steps):
        a = tr0 + train + wait  # sampler granted after `wait` seconds of waiting
        acquired(a, "sampler", wait)
        windows["trainer"].append({"t0": tr0, "t1": a + sync, "job": "A"})
        s_end = a + sync + sample
        windows["sampler"].append({"t0": a, "t1": s_end, "job": "A"})
        tr0 = s_end + reward
        acquired(tr0, "trainer", 0)
        t = tr0
    windows["trainer"].append({"t0": tr0, "t1": tr0 + train, "job": "A"})
    for pool, ckpt, rest in (("sampler", 20.0, 6.0), ("trainer", 5.0, 2.0)):
        for i in range(3):
            for kind, ms in (("ckpt_done", ckpt + i), ("restore_done", rest + i)):
                events.append({"t": t, "kind": kind, "job": "A", "pool": pool, "ms": ms * 1000})
    duty = [[i * 60.0, 50.0 if (i * 60.0) % period < period / 2 else 0.0] for i in range(60)]
    return {
        "timeslice": {"windows": windows, "events": events},
        "baseline": {"duration_s": 3600, "duty_gpus": {"0": duty, "1": duty}},
        "summary": {
            "speedup": 1.5,
            "duty_base": 50,
            "duty_ts": 90,
            "base_min": 60,
            "ts_min": 80,
            "swaps": 3,
        },
    }


def test_synthetic_trace_gives_back_its_phases() -> None:
    m = trace.derive_model(synthetic(sync=10, sample=100, reward=5, train=200, wait=15))
    assert m.sync.median == pytest.approx(10)
    assert m.sample.median == pytest.approx(100)
    assert m.reward.median == pytest.approx(5)
    # train = from the trainer grant to the sampler *request* (the wait is not work).
    assert m.train.median == pytest.approx(200)
    assert m.baseline_step_s == pytest.approx(300)
    assert m.contention == pytest.approx((10 + 100 + 5 + 200) / 300)
    assert m.switch["sampler"].snapshot.median == pytest.approx(21)
    assert m.switch["trainer"].restore.median == pytest.approx(3)
    assert m.switch["sampler"].switch_s == pytest.approx(21 + 7)
    assert m.recorded.speedup == 1.5


def test_contention_never_below_one() -> None:
    m = trace.derive_model(synthetic(sync=5, sample=50, reward=5, train=50, wait=0))
    assert m.contention == 1.0


def test_recorded_trace_model_is_sensible() -> None:
    m = trace.load_model(PACKAGED)
    # Steady-state phases of the veRL run: ~7 min sampling, ~7 min training,
    # ~12 s weight hand-over holding both pools, ~7 s of CPU-only reward scoring.
    assert 380 < m.sample.median < 480
    assert 400 < m.train.median < 480
    assert 5 < m.reward.median < 10
    assert 8 < m.sync.median < 16
    assert m.sample.count >= 15 and m.train.count >= 15
    # Switch costs per pool from ckpt_done / restore_done.
    assert 20 < m.switch["sampler"].snapshot.median < 24
    assert 6 < m.switch["sampler"].restore.median < 8
    assert 5 < m.switch["trainer"].snapshot.median < 8
    assert 2 < m.switch["trainer"].restore.median < 3
    # The job alone needs ~13.3 min a step; sharing slowed the steps down by 5-25 %.
    assert 760 < m.baseline_step_s < 840
    assert 1.05 < m.contention < 1.25
    # Uncontended step work matches the baseline step it was calibrated on.
    plan = m.job_steps(steps=2, seed=0, jitter=False)
    assert sum(p.duration_s for p in plan[1]) == pytest.approx(m.baseline_step_s, rel=1e-6)


def test_job_steps_shape_and_seed() -> None:
    m = trace.load_model(PACKAGED)
    plan = m.job_steps(steps=3, seed=7)
    assert [p.name for p in plan[0]] == ["sample", "reward", "train"]
    assert [p.name for p in plan[1]] == ["sync", "sample", "reward", "train"]
    assert plan[1][0].pools == (trace.SAMPLER, trace.TRAINER)
    assert plan[1][2].pools == ()
    assert plan == m.job_steps(steps=3, seed=7)
    assert plan != m.job_steps(steps=3, seed=8)
    for step in plan:
        for phase in step:
            stat = getattr(m, phase.name)
            low = stat.median * 0.5 / m.contention
            high = stat.median * 1.5 / m.contention
            assert low <= phase.duration_s <= high
    with pytest.raises(ValueError, match="at least 1"):
        m.job_steps(steps=0, seed=0)


def test_packaged_copy_matches_shared_trace() -> None:
    if not SHARED.is_file():
        pytest.skip("no shared/ next to the repository")
    assert json.loads(PACKAGED.read_text()) == json.loads(SHARED.read_text())
    assert trace.default_trace_path().is_file()


def test_unusable_traces_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="does not exist"):
        trace.load_model(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(errors.ConfigError, match="not readable JSON"):
        trace.load_model(bad)
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"timeslice": {"windows": {}, "events": []}}))
    with pytest.raises(errors.ConfigError, match="expected shape"):
        trace.load_model(shape)
