"""Simulated RL jobs against a real local cluster: windows recorded, exclusion proven."""

from __future__ import annotations

import asyncio

from tslice.phases import rljob, trace
from tslice.sim import checker, cluster

GiB = 1024**3


def tiny_plan(steps: int) -> list[list[trace.Phase]]:
    """Phases of a few tens of ms (durations in trace seconds, time scale 1000)."""
    plan = []
    for step in range(steps):
        phases = []
        if step:
            phases.append(trace.Phase("sync", (trace.SAMPLER, trace.TRAINER), 5.0))
        phases += [
            trace.Phase("sample", (trace.SAMPLER,), 40.0),
            trace.Phase("reward", (), 5.0),
            trace.Phase("train", (trace.TRAINER,), 40.0),
        ]
        plan.append(phases)
    return plan


def violations(local: cluster.LocalCluster, windows: list[rljob.Window]) -> list[checker.Violation]:
    return checker.check(
        journal=local.read_journals(),
        windows=windows,
        group_nodes={"sampler": ["node-a"], "trainer": ["node-b"]},
    )


def sim_job(job_id: str, steps: int) -> rljob.SimJob:
    return rljob.SimJob(
        job_id=job_id,
        lanes=[tiny_plan(steps)],
        groups={trace.SAMPLER: "sampler", trace.TRAINER: "trainer"},
        footprints={trace.SAMPLER: 60 * GiB, trace.TRAINER: 70 * GiB},
        time_scale=1000.0,
    )


async def test_two_jobs_share_both_pools(two_pools: cluster.LocalCluster) -> None:
    updates: list[rljob.JobUpdate] = []
    results = await asyncio.gather(
        *(
            rljob.run_job(
                sim_job(job, steps=3),
                address=two_pools.orchestrator_address,
                run="test",
                on_update=updates.append,
            )
            for job in ("rl-a", "rl-b")
        )
    )
    for result in results:
        assert result.error == ""
        assert result.steps_done == 3
        # Per step: sampler + trainer, except that step 0 takes the sampler once.
        assert [w.pool for w in result.windows] == ["sampler", "trainer"] * 3
        assert all(w.acquired is not None and w.yielded is not None for w in result.windows)
        assert all(w.requested <= w.acquired <= w.yielded for w in result.windows)  # type: ignore[operator]
        # The sync phase: the sampler of step k is taken while the trainer is still held.
        for k in (1, 2):
            trainer_before = result.windows[2 * k - 1]
            sampler = result.windows[2 * k]
            assert sampler.phase == "sync"
            assert sampler.acquired <= trainer_before.yielded  # type: ignore[operator]
    windows = [w for r in results for w in r.windows]
    # Two jobs alternate on each pool: some grants had to restore saved state.
    assert any(w.context_restored for w in windows)
    assert max(w.grant_epoch for w in windows) >= 6
    assert violations(two_pools, windows) == []
    done = [u for u in updates if u.activity == "done"]
    assert sorted(u.job for u in done) == ["rl-a", "rl-b"]
    assert any(u.activity == "wait sampler" for u in updates)


async def test_failed_acquire_ends_the_job_with_an_open_window(
    two_pools: cluster.LocalCluster,
) -> None:
    job = rljob.SimJob(
        job_id="rl-bad",
        lanes=[tiny_plan(1)],
        groups={trace.SAMPLER: "sampler", trace.TRAINER: "no such group!"},
        footprints={},
        time_scale=1000.0,
    )
    result = await rljob.run_job(job, address=two_pools.orchestrator_address, run="test")
    assert result.error
    assert result.steps_done == 0
    assert result.windows[-1].acquired is None and result.windows[-1].error
    found = checker.check(journal=[], windows=result.windows[-1:])
    assert [v.kind for v in found] == [checker.ACQUIRE_NOT_RETURNED]


async def test_lanes_run_at_once_and_private_pools_ask_nobody(
    two_pools: cluster.LocalCluster,
) -> None:
    """An asynchronous job: generation on the sampler and training on the trainer at the
    same time, each lane also using a pool of the job's own (judge: no group)."""

    def lane(pool: str) -> list[list[trace.Phase]]:
        step = [trace.Phase(pool, (pool,), 40.0), trace.Phase("judge", ("judge",), 10.0)]
        return [step, step]

    updates: list[rljob.JobUpdate] = []
    job = rljob.SimJob(
        job_id="rl-async",
        lanes=[lane(trace.SAMPLER), lane(trace.TRAINER)],
        groups={trace.SAMPLER: "sampler", trace.TRAINER: "trainer"},
        footprints={},
        time_scale=1000.0,
    )
    result = await rljob.run_job(
        job, address=two_pools.orchestrator_address, run="lanes", on_update=updates.append
    )
    assert result.error == "" and result.steps_done == 2
    by_pool = {p: [w for w in result.windows if w.pool == p] for p in ("sampler", "trainer")}
    assert [len(ws) for ws in by_pool.values()] == [2, 2]
    # The lanes overlapped: the job held both pools at once without a sync phase.
    first_s, first_t = by_pool["sampler"][0], by_pool["trainer"][0]
    assert first_s.acquired < first_t.yielded and first_t.acquired < first_s.yielded  # type: ignore[operator]
    assert any(set(u.holding) >= {"sampler", "trainer"} for u in updates)
    # The job's own pool: windows without a group, granted when asked, never waited on.
    judge = [w for w in result.windows if w.pool == "judge"]
    assert len(judge) == 4 and all(w.group == "" and w.acquired == w.requested for w in judge)
    assert violations(two_pools, [w for w in result.windows if w.group]) == []
