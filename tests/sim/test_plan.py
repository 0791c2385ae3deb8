"""The placement planner on recordings with a known best answer, and on bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.sim.plan_runs import SHAPES, STEPS, event, four_jobs, two_jobs_log
from tests.sim.traces import constructed
from tslice.phases import derive, trace
from tslice.planner import plan, predict, recording, search


def test_complementary_jobs_are_paired_and_colliding_ones_kept_apart(tmp_path: Path) -> None:
    result = plan.make_plan(plan.PlanConfig(source=four_jobs(tmp_path), steps=STEPS))
    assert result.method == search.EXHAUSTIVE
    assert result.considered == 15  # Bell(4): every grouping of four jobs
    assert result.recommended.grouping == (("A", "B"), ("C", "D"))
    gains = {c.grouping: c.gain for c in (result.recommended, *result.alternatives)}
    # The mirror images nearly double the work per GPU; mixing the pairs does worse,
    # and the trainer-heavy jobs together do worst of the pairings.
    assert result.recommended.gain > 1.8
    assert all(
        g < result.recommended.gain for k, g in gains.items() if k != (("A", "B"), ("C", "D"))
    )
    collide = plan._forecast(
        result.model, {j: result.plans[j] for j in ("A", "C")}, result.recording.unit_s
    )
    paired = plan._forecast(
        result.model, {j: result.plans[j] for j in ("A", "B")}, result.recording.unit_s
    )
    assert collide.makespan_s > 1.3 * paired.makespan_s
    assert gains[(("A",), ("B",), ("C",), ("D",))] == pytest.approx(1.0)


def test_max_sets_and_max_share_bound_the_blocks(tmp_path: Path) -> None:
    source = four_jobs(tmp_path)
    result = plan.make_plan(plan.PlanConfig(source=source, max_sets=1))
    assert result.recommended.grouping == (("A", "B", "C", "D"),)
    assert result.alternatives == ()
    pairs = plan.make_plan(plan.PlanConfig(source=source, max_share=2))
    assert pairs.recommended.grouping == (("A", "B"), ("C", "D"))
    assert pairs.considered == 10  # Bell(4) less the 4 + 1 with a block of 3 or 4
    assert all(len(b) <= 2 for c in pairs.alternatives for b in c.grouping)
    with pytest.raises(recording.PlanInputError, match="raise --max-sets or --max-share"):
        plan.make_plan(plan.PlanConfig(source=source, max_sets=1, max_share=2))


def test_the_heuristic_finds_the_pairs_beyond_exhaustive_search() -> None:
    # Ten jobs: five of each mirror shape. The cost is the predicted GPU-seconds.
    model = derive.model(
        constructed(
            {j: (i * 1000.0, [SHAPES[j]]) for i, j in enumerate("AB")},
            steps=3,
            mode="sync",
            shared=("sampler", "trainer"),
        )
    )
    jobs = [f"{'AB'[i % 2]}{i}" for i in range(10)]
    lanes = {j: model.job_lanes(steps=3, seed=0, index=i % 2) for i, j in enumerate(jobs)}

    def cost(block: search.Block) -> float:
        if len(block) == 1:
            return predict.solo_s(lanes[block[0]]) * 2
        return (
            2
            * predict.together(
                {j: lanes[j] for j in block},
                switch=model.switch,
                shared=model.shared,
                slowdown=1.0,
            ).makespan_s
        )

    found = search.search(jobs, cost)
    assert found.method == search.HEURISTIC
    best = found.scored[0][0]
    assert all(sorted(j[0] for j in block) == ["A", "B"] for block in best), best


def _events(tmp_path: Path, lines: list[dict[str, Any]]) -> Path:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "does not exist"),
        ("", "is empty: record an event log"),
        ("not json at all\n", "line 1 is not JSON"),
        ('{"hello": 1}', "neither a trace nor an event log"),
        ('{"kind": "GRANTED"}\n{"x": 1}\n', "line 1 is not an orchestrator event"),
    ],
)
def test_bad_input_names_what_is_wrong(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "input.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(recording.PlanInputError, match=expected):
        plan.make_plan(plan.PlanConfig(source=path))


def test_an_event_log_of_one_job_is_refused_with_the_fix(tmp_path: Path) -> None:
    lines = []
    for step in range(3):
        t = step * 3.0
        lines += [
            event(t, "GRANTED", "trainer", "A"),
            event(t + 1, "YIELDED", "trainer", "A"),
            event(t + 1, "GRANTED", "sampler", "A"),
            event(t + 2, "YIELDED", "sampler", "A"),
        ]
    with pytest.raises(recording.PlanInputError, match=r"has one job \(A\).*--jobs N"):
        plan.make_plan(plan.PlanConfig(source=_events(tmp_path, lines)))


def test_an_event_log_without_grants_or_switch_costs_says_so(tmp_path: Path) -> None:
    queued = [event(0, "QUEUED", "trainer", "A")]
    with pytest.raises(recording.PlanInputError, match="no GRANTED one"):
        recording.load(_events(tmp_path, queued))
    shared = [
        event(0, "GRANTED", "trainer", "A"),
        event(1, "YIELDED", "trainer", "A"),
        event(1.5, "GRANTED", "trainer", "B"),
        event(2, "YIELDED", "trainer", "B"),
    ]
    with pytest.raises(recording.PlanInputError, match="no SNAPSHOT_DONE event of it"):
        recording.load(_events(tmp_path, shared))


def _lane(*phases: tuple[tuple[str, ...], float], steps: int = 1) -> predict.Lanes:
    return [[[trace.Phase("+".join(p) or "cpu", p, s) for p, s in phases] for _ in range(steps)]]


def test_the_model_hands_over_as_the_orchestrator_does() -> None:
    """FIFO; a hand-over snapshots the resident job and restores the incoming one if it
    was loaded before; a pool yielded while nobody waits stays with its job for free."""
    switch = {"trainer": trace.SwitchCost(trace.Stat(4.0, 0, 1), trace.Stat(1.5, 0, 1))}

    def run(**plans: predict.Lanes) -> predict.Outcome:
        return predict.together(plans, switch=switch, shared=["trainer"], slowdown=1.0)

    # B waits for A, then costs A's snapshot (B was never loaded: nothing to restore).
    first = run(A=_lane((("trainer",), 10)), B=_lane((("trainer",), 10)))
    assert (first.makespan_s, first.switches["trainer"], first.switching_s["trainer"]) == (
        24.0,
        1,
        4.0,
    )
    # A gets the trainer back at no cost while nobody else asked for it.
    again = run(
        A=_lane((("trainer",), 10), ((), 5), steps=2), B=_lane(((), 100), (("trainer",), 10))
    )
    assert again.makespan_s == 114.0 and again.switches["trainer"] == 1
    # A comes back after B: B's snapshot and A's restore.
    back = run(
        A=_lane((("trainer",), 10), ((), 20), steps=2), B=_lane(((), 12), (("trainer",), 10))
    )
    assert back.makespan_s == 65.5 and back.switches["trainer"] == 2
    assert back.switching_s["trainer"] == 9.5 and back.held_s["trainer"] == 30.0
    # What a whole switch took beyond its copies (SWITCH_DONE) is added to each hand-over.
    slower = predict.together(
        {"A": _lane((("trainer",), 10)), "B": _lane((("trainer",), 10))},
        switch=switch,
        shared=["trainer"],
        slowdown=1.0,
        overhead_s={"trainer": 2.0},
    )
    assert slower.makespan_s == 26.0


def test_a_valid_event_log_is_planned(tmp_path: Path) -> None:
    result = plan.make_plan(plan.PlanConfig(source=_events(tmp_path, two_jobs_log())))
    assert set(result.jobs) == {"A", "B"}


def _spoilt(field: str, value: Any, at: int = 0) -> list[dict[str, Any]]:
    lines = two_jobs_log()
    lines[at][field] = value
    return lines


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (_spoilt("duration_ms", "5"), r"line 1: duration_ms must be a number \(got str '5'\)"),
        (_spoilt("duration_ms", -1.0), r"line 1: duration_ms must be a finite number >= 0"),
        (_spoilt("time", float("nan"), at=3), r"line 4 holds nan, not a finite number"),
        (_spoilt("duration_ms", float("inf")), r"line 1 holds inf, not a finite number"),
        (_spoilt("time", True), r"line 1: time must be a number \(got bool"),
        # A newline in an id would start a line of its own in the topology's comments.
        (
            _spoilt("job_id", "B\nmode: local\ngroups: {}", at=4),
            r"line 5: job_id 'B\\nmode: local\\ngroups: {}' is malformed",
        ),
        (_spoilt("group_id", "trainer pool"), r"line 1: group_id 'trainer pool' is malformed"),
        (_spoilt("job_id", 7), r"line 1: job_id must be a string \(got int\)"),
    ],
)
def test_malformed_events_are_refused_naming_the_line(
    tmp_path: Path, lines: list[dict[str, Any]], expected: str
) -> None:
    """They were taken (a string duration, an infinite time) and planned to garbage with rc
    0, or an id carried YAML into the topology file's comments."""
    with pytest.raises(recording.PlanInputError, match=expected):
        plan.make_plan(plan.PlanConfig(source=_events(tmp_path, lines)))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("[" * 40 + "]" * 40, "nested more than 32 levels deep"),
        (
            '{"timeslice": {"windows": {"trainer": [{"t0": 1e999}]}}}',
            "holds inf, not a finite number",
        ),
        ('{"timeslice": {"windows": {"a\\nb": []}}}', r"pool 'a\\nb' is malformed"),
        (
            '{"timeslice": {"windows": {"trainer": [{"job": "A\\n# x", "t0": 0, "t1": 1}]}}}',
            r"windows of trainer\): job 'A\\n# x' is malformed",
        ),
    ],
)
def test_malformed_json_gets_a_clear_error(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "input.json"
    path.write_text(content)
    with pytest.raises(recording.PlanInputError, match=expected):
        plan.make_plan(plan.PlanConfig(source=path))


def test_steps_are_bounded(tmp_path: Path) -> None:
    """--steps 10000000 never finished."""
    source = _events(tmp_path, two_jobs_log())
    for steps in (0, plan.MAX_STEPS + 1, 10**7):
        with pytest.raises(recording.PlanInputError, match=r"--steps must be between 1 and 100"):
            plan.make_plan(plan.PlanConfig(source=source, steps=steps))
    assert plan.make_plan(plan.PlanConfig(source=source, steps=plan.MAX_STEPS)).jobs


@pytest.mark.timeout(30)
def test_twenty_thousand_windows_open_at_once_are_read_in_linear_time(tmp_path: Path) -> None:
    """Each yield scanned every open window, and the derivation compared every window with
    every job: 20,000 windows open at once took 34 s to read and as long again to derive
    (0.9 s and 2 s now). Not a benchmark: the bound is 10x what it takes here, far below
    what quadratic work takes."""
    count = 20_000
    lines = [event(i * 0.001, "GRANTED", "g", f"j{i}", duration_ms=0) for i in range(count)]
    # Yielded in the opposite order: the last window opened is closed first.
    lines += [event(30 + k * 0.001, "YIELDED", "g", f"j{count - 1 - k}") for k in range(count)]
    lines += [event(59, "SNAPSHOT_DONE", "g", "j1", duration_ms=5)]
    lines += [event(59, "RESTORE_DONE", "g", "j1", duration_ms=5)]
    rec = recording.load(_events(tmp_path, lines))
    assert sum(len(w) for w in rec.raw["timeslice"]["windows"].values()) == count
    # Every job had one turn: the derivation reads them all, then says what is missing.
    with pytest.raises(recording.PlanInputError, match="fewer than two RL steps"):
        plan.load_model(rec)
