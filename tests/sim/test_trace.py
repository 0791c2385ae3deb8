"""Phase models derived from the recorded trace and from constructed traces of other shapes
(known phases: one job with waits; three pools, one private; fully asynchronous)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.sim.traces import Lane, constructed, three_pools_one_private
from tslice.common import errors
from tslice.phases import derive, trace

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

    def acquired(t: float, pool: str, wait_s: float, step: int) -> None:
        events.append(
            {
                "t": t,
                "kind": "acquired",
                "job": "A",
                "pool": pool,
                "wait_ms": wait_s * 1000,
                "restore_ms": 0,
                "step": step,
            }
        )

    t = 0.0
    tr0 = 0.0
    acquired(tr0, "trainer", 0, 0)
    for step in range(steps):
        a = tr0 + train + wait  # sampler granted after `wait` seconds of waiting
        acquired(a, "sampler", wait, step)
        windows["trainer"].append({"t0": tr0, "t1": a + sync, "job": "A"})
        s_end = a + sync + sample
        windows["sampler"].append({"t0": a, "t1": s_end, "job": "A"})
        tr0 = s_end + reward
        acquired(tr0, "trainer", 0, step + 1)
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
    m = derive.model(synthetic(sync=10, sample=100, reward=5, train=200, wait=15))
    assert m.mode == trace.SYNC and m.pools == ("sampler", "trainer") and m.private == ()
    (shape,) = m.jobs
    # One lane; its step starts at the trainer grant (the step of the acquire events).
    (lane,) = shape.lanes
    assert [(p.name, p.pools) for p in lane] == [
        ("trainer", ("trainer",)),
        ("sampler+trainer", ("sampler", "trainer")),
        ("sampler", ("sampler",)),
        ("cpu", ()),
    ]
    # train = from the trainer grant to the sampler *request* (the wait is not work).
    medians = [p.stat.median for p in lane]
    assert medians == pytest.approx([200, 10, 100, 5])
    assert shape.recorded_steps == 6
    assert m.baseline_step_s == pytest.approx(300)
    assert m.contention == pytest.approx((10 + 100 + 5 + 200) / 300)
    assert m.switch["sampler"].snapshot.median == pytest.approx(21)
    assert m.switch["trainer"].restore.median == pytest.approx(3)
    assert m.switch["sampler"].switch_s == pytest.approx(21 + 7)
    assert m.recorded.speedup == 1.5


def test_contention_never_below_one() -> None:
    m = derive.model(synthetic(sync=5, sample=50, reward=5, train=50, wait=0))
    assert m.contention == 1.0


def test_recorded_trace_model_is_sensible() -> None:
    m = derive.load(PACKAGED)
    assert m.mode == trace.SYNC
    assert m.pools == ("sampler", "trainer") and m.private == ()
    assert [s.job for s in m.jobs] == ["A", "B"]
    for shape in m.jobs:
        assert shape.recorded_steps == 10
        # Steady-state phases of the veRL run: ~7 min training, ~12 s weight hand-over
        # holding both pools, ~7 min sampling, ~7 s of CPU-only reward scoring.
        assert [p.name for p in shape.lanes[0]] == ["trainer", "sampler+trainer", "sampler", "cpu"]
        assert 400 < shape.phase("trainer").stat.median < 480
        assert 8 < shape.phase("sampler+trainer").stat.median < 16
        assert 380 < shape.phase("sampler").stat.median < 480
        assert 5 < shape.phase("cpu").stat.median < 10
        assert all(p.stat.count == 9 for p in shape.lanes[0])
    # Switch costs per pool from ckpt_done / restore_done.
    assert 20 < m.switch["sampler"].snapshot.median < 24
    assert 6 < m.switch["sampler"].restore.median < 8
    assert 5 < m.switch["trainer"].snapshot.median < 8
    assert 2 < m.switch["trainer"].restore.median < 3
    # The job alone needs ~13.3 min a step; sharing slowed the steps down by 5-25 %.
    assert m.baseline_step_s is not None and 760 < m.baseline_step_s < 840
    assert 1.05 < m.contention < 1.25
    # Uncontended step work matches the baseline step it was calibrated on.
    plan = m.job_steps(steps=2, seed=0, jitter=False)
    assert sum(p.duration_s for p in plan[1]) * m.contention == pytest.approx(m.jobs[0].cycle_s)
    assert m.recorded.speedup == 1.45
    assert (m.recorded.gpus_baseline, m.recorded.gpus_time_sliced) == (2, 2)


def test_job_steps_shape_and_seed() -> None:
    m = derive.load(PACKAGED)
    plan = m.job_steps(steps=3, seed=7)
    assert [p.name for p in plan[0]] == ["trainer", "sampler+trainer", "sampler", "cpu"]
    assert plan[0][1].pools == (trace.SAMPLER, trace.TRAINER)
    assert plan[0][3].pools == ()
    assert plan == m.job_steps(steps=3, seed=7)
    assert plan != m.job_steps(steps=3, seed=8)
    # Simulated job 1 replays trace job B, job 2 job A again.
    assert m.shape(1).job == "B" and m.shape(2).job == "A"
    for step in plan:
        for phase in step:
            stat = m.jobs[0].phase(phase.name).stat
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


# ---- constructed traces of other shapes --------------------------------------------------


def test_three_pools_one_private() -> None:
    """gen and learn are shared, judge is each job's own (their windows there overlap);
    no baseline: contention 1."""
    raw = three_pools_one_private()
    m = derive.model(raw)
    assert m.mode == trace.SYNC
    assert m.pools == ("gen", "learn", "judge")
    assert m.shared == ("gen", "learn") and m.private == ("judge",)
    assert set(m.switch) == {"gen", "learn"}
    assert m.switch["gen"].switch_s == pytest.approx(5.5)
    assert m.contention == 1.0 and m.baseline_step_s is None
    for shape in m.jobs:
        (lane,) = shape.lanes
        assert [(p.name, p.pools) for p in lane] == [
            ("learn", ("learn",)),
            ("gen+learn", ("gen", "learn")),
            ("gen", ("gen",)),
            ("judge", ("judge",)),
        ]
        assert [p.stat.median for p in lane] == pytest.approx([60, 10, 60, 210])
        assert shape.recorded_steps == 5 and shape.cycle_s == pytest.approx(340)
    assert m.recorded.speedup == 0.0  # no summary: nothing recorded to compare with


def test_fully_asynchronous_jobs_get_one_lane_per_pool() -> None:
    """Generation (rollout) and training (update) overlap inside each job."""
    rollout: Lane = [(("rollout",), 50), ((), 70)]
    update: Lane = [((), 20), (("update",), 40), ((), 60)]
    jobs = {"A": (0.0, [rollout, update]), "B": (60.0, [rollout, update])}
    for mode in ("fully async", None):  # declared, or inferred from the overlap
        m = derive.model(constructed(jobs, steps=6, mode=mode, shared=("rollout", "update")))
        assert m.mode == trace.ASYNC
        assert m.pools == ("rollout", "update") and m.private == ()
        for shape in m.jobs:
            assert [[(p.name, p.pools, p.stat.median) for p in lane] for lane in shape.lanes] == [
                [("rollout", ("rollout",), 50), ("rollout idle", (), 70)],
                [("update", ("update",), 40), ("update idle", (), 80)],
            ]
            assert shape.cycle_s == pytest.approx(120)
        lanes = m.job_lanes(steps=2, seed=0, jitter=False)
        assert [[p.name for p in lane[0]] for lane in lanes] == [
            ["rollout", "rollout idle"],
            ["update", "update idle"],
        ]


def test_jobs_holding_and_waiting_in_opposite_orders_are_refused() -> None:
    """A holds x while asking for y, B holds y while asking for x: a replay could deadlock."""
    a: Lane = [(("x",), 40), (("x", "y"), 10), ((), 70)]
    b: Lane = [(("y",), 40), (("x", "y"), 10), ((), 70)]
    raw = constructed({"A": (0.0, [a]), "B": (60.0, [b])}, steps=4, mode=None, shared=("x", "y"))
    with pytest.raises(trace.TraceError, match="can deadlock") as caught:
        derive.model(raw)
    message = str(caught.value)
    assert "job A holds x while asking for y" in message
    assert "job B holds y while asking for x" in message
    # The same jobs in one lock order are fine.
    raw = constructed({"A": (0.0, [a]), "B": (60.0, [a])}, steps=4, mode=None, shared=("x", "y"))
    assert derive.model(raw).shared == ("x", "y")


def test_unusable_traces_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="does not exist"):
        derive.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(errors.ConfigError, match="not readable JSON"):
        derive.load(bad)
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"timeslice": {"windows": {}, "events": []}}))
    with pytest.raises(trace.TraceError, match=r"timeslice\.windows has no pool"):
        derive.load(shape)


def rename_pool(raw: dict[str, Any], old: str, new: str) -> None:
    windows = raw["timeslice"]["windows"]
    windows[new] = windows.pop(old)
    for event in raw["timeslice"]["events"]:
        if event.get("pool") == old:
            event["pool"] = new


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda t: t.pop("timeslice"), r"timeslice is missing \(needed for the time-sliced"),
        (
            lambda t: [e.pop("wait_ms") for e in t["timeslice"]["events"] if "wait_ms" in e],
            r"timeslice\.events\[0\]\.wait_ms is missing \(needed for telling waiting from work",
        ),
        (
            lambda t: t["timeslice"].__setitem__(
                "events", [e for e in t["timeslice"]["events"] if e["kind"] != "restore_done"]
            ),
            r"no 'restore_done' event of pool 'sampler', which jobs share",
        ),
        (
            lambda t: t["timeslice"]["windows"]["trainer"][3].pop("t1"),
            r"timeslice\.windows\.trainer\[3\]\.t1 is missing",
        ),
        (lambda t: rename_pool(t, "trainer", "the trainer"), r"pool 'the trainer' of .*malformed"),
    ],
)
def test_a_trace_missing_a_needed_field_says_which(damage: Any, named: str) -> None:
    raw = json.loads(PACKAGED.read_text())
    damage(raw)
    with pytest.raises(trace.TraceError, match=named):
        derive.model(raw, source="damaged.json")
