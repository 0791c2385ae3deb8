"""The replay's makespan bound and what is measured from windows, on cases worked by hand."""

from __future__ import annotations

import pytest

from tslice.phases import measure, replay, rljob, trace


def phase(pools: tuple[str, ...], seconds: float) -> trace.Phase:
    return trace.Phase("+".join(pools) or "cpu", pools, seconds)


def test_bound_is_the_busiest_pool_plus_its_unavoidable_fill() -> None:
    # Each job: x for 10 s, 5 s on the CPU, y for 20 s (one step).
    step = [phase(("x",), 10), phase((), 5), phase(("y",), 20)]
    plans = {"A": [[step]], "B": [[step]]}
    # y: 2 x 20 s of work, after a lead-in of 15 s nobody can skip (nothing after it).
    # x: 2 x 10 s + no lead-in + a 25 s tail = 45 s. A job alone: 35 s.
    got = replay.bound(plans, shared=("x", "y"), contention=1.0, switch_s={})
    assert got.makespan_s == pytest.approx(55.0) and got.limit == "y"
    assert got.work_s == {"x": pytest.approx(20), "y": pytest.approx(40)}
    assert got.fill_s == {"x": pytest.approx(25), "y": pytest.approx(15)}
    # Sharing stretches every phase; one hand-over per job after the first.
    got = replay.bound(plans, shared=("x", "y"), contention=2.0, switch_s={"y": 3.0})
    assert got.makespan_s == pytest.approx(2 * 55 + 3)
    # A lone job is bounded by its own chain of phases (here its y lead-in + y, too).
    alone = replay.bound({"A": [[step]]}, shared=("x", "y"), contention=1.0, switch_s={})
    assert alone.makespan_s == pytest.approx(35.0)


def test_bound_of_parallel_lanes_is_the_longest_lane() -> None:
    lanes = [[[phase((), 30), phase(("x",), 10)]], [[phase(("y",), 25), phase((), 20)]]]
    # Pools: x 30 + 10, y 25 + 20; the lanes run at once, so the job takes 45 s, not 85.
    got = replay.bound({"A": lanes}, shared=("x", "y"), contention=1.0, switch_s={})
    assert got.makespan_s == pytest.approx(45.0)


def window(job: str, pool: str, requested: float, acquired: float, yielded: float) -> rljob.Window:
    return rljob.Window(
        run="r",
        job=job,
        pool=pool,
        group="" if pool == "own" else pool,
        step=0,
        phase=pool,
        requested=requested,
        acquired=acquired,
        yielded=yielded,
    )


def test_handovers_count_only_a_waiting_job_taking_over() -> None:
    windows = [
        window("A", "x", 0, 0, 4),
        window("B", "x", 1, 5, 8),  # B waited since 1: hand-over 4 -> 5
        window("A", "x", 9, 9, 10),  # A asked after B let go: not a hand-over
        window("A", "x", 10, 10, 11),  # same job again: not a hand-over
    ]
    assert measure.handovers_s(windows, "x") == [pytest.approx(1.0)]


def test_a_private_pool_duty_is_the_mean_of_each_jobs_own() -> None:
    results = [
        rljob.JobResult(run="r", job=job, started=0, finished=10, steps_done=1, windows=tuple(ws))
        for job, ws in (
            ("A", [window("A", "own", 0, 0, 10), window("A", "x", 0, 0, 5)]),
            ("B", [window("B", "own", 0, 0, 5), window("B", "x", 5, 5, 10)]),
        )
    ]
    run = measure.summarise("r", 0, 10, results, [], pools=("x", "own"), private=("own",))
    # x is shared: held all 10 s by someone; own: A held its 100 %, B its 50 %.
    assert run.duty == {"x": pytest.approx(1.0), "own": pytest.approx(0.75)}
