"""Every scheduling policy's starvation bound, proved on randomized runs of the pure lock.

A discrete-event simulation drives a group's lock as jobs would: each job asks for
the group, holds it for a while, yields, pauses, asks again; waiters sometimes give
up; switches take a time that depends on the job; the orchestrator sometimes
restarts (the lock is rebuilt from its record and every waiter re-attaches). After
every decision: one holder at most, grants only to live waiters, and when a waiter
is picked, the number of grants that went to other jobs while it waited stays within
the bound its policy's docstring states. At the end arrivals stop and every waiter
must be granted (nobody is left behind on a group that could grant).
"""

from __future__ import annotations

import random

import pytest

from tests.orchestrator.policy_sim import (
    CASES,
    Sim,
    cost_bound,
)
from tslice.orchestrator import policy


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("kind", list(CASES))
def test_random_runs_keep_one_holder_and_the_starvation_bound(kind: str, seed: int) -> None:
    rng = random.Random(f"{kind}-{seed}")
    jobs = rng.randint(3, 12)
    make, bound = CASES[kind]
    spec = make(rng, jobs)
    sim = Sim(rng, lambda: policy.build(spec), jobs)
    sim.run(bound, horizon=rng.uniform(40, 120))


def test_cost_aware_runs_do_wait_for_bursty_residents() -> None:
    """The bound above is not met by never holding: the cost-aware group does hold."""
    held = 0
    for seed in range(12):
        rng = random.Random(f"hold-{seed}")
        sim = Sim(rng, lambda: policy.build(policy.CostAwareSpec(max_defer_s=5)), 2 + seed % 3)
        for job in sim.jobs.values():
            job.bursty = True  # few jobs with short gaps: the resident is often waited for
        sim.run(cost_bound, horizon=60)
        held += sim.holds_off
    assert held > 0
