"""Prefetch from the orchestrator's side (issue 9 §2): whom to bring in (pure), and that
only an agent that declares the feature ever gets the directive."""

from __future__ import annotations

import dataclasses

from tests.orchestrator.llmd_agent import LlmdAgent
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator import policy
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.policy import prefetch as prefetching
from tslice.orchestrator.switch import pool, step


@dataclasses.dataclass
class Lock:
    holder: str | None = "a"
    waiting_jobs: list[str] = dataclasses.field(default_factory=lambda: ["b", "c"])
    grant_epoch: int = 7
    footprints: dict[str, int] = dataclasses.field(default_factory=lambda: {"b": 5, "c": 9})

    def footprint(self, job: str) -> int:
        return self.footprints.get(job, 0)

    def next_waiter(self, *, now: float) -> str | None:
        return self.waiting_jobs[0] if self.waiting_jobs else None


def test_the_next_waiter_is_prefetched_while_someone_holds_and_no_switch_runs() -> None:
    def pick(lock: Lock, *, switching: bool = False) -> prefetching.Candidate | None:
        return prefetching.next_to_prefetch(lock, switching=switching, now=0.0)

    assert pick(Lock()) == prefetching.Candidate(job="b", footprint_bytes=5, epoch=7)
    assert pick(Lock(), switching=True) is None
    assert pick(Lock(holder=None)) is None
    assert pick(Lock(waiting_jobs=[])) is None
    # Without a footprint nobody can tell whether it fits beside the holder.
    assert pick(Lock(footprints={})) is None


def test_the_waiter_prefetched_is_the_policys_next_not_the_first_in_the_queue() -> None:
    g = lk.GroupLock(policy=policy.build(policy.PrioritySpec(priorities={"hi": 5})))
    g.on_acquire("a", now=0)
    sw = g.switching
    assert sw is not None
    g.on_switch_done(epoch=sw.epoch, restored=False, now=0)
    g.on_acquire("lo", footprint_bytes=3, now=1)
    g.on_acquire("hi", footprint_bytes=4, now=2)
    assert g.waiting_jobs[0] == "lo"
    chosen = prefetching.next_to_prefetch(g, switching=False, now=3)
    assert chosen is not None and chosen.job == "hi" and chosen.footprint_bytes == 4


async def test_an_llmd_agent_never_gets_the_directive() -> None:
    llmd = LlmdAgent({"a": pb.JOB_STATE_RUNNING, "b": pb.JOB_STATE_SAVED})
    address = await llmd.start()
    client = pool.AgentClient(address)
    try:
        link = step.chosen(client, await client.status())
        done = await link.prefetch(job_id="b", group="", footprint_bytes=1)
    finally:
        await client.close()
        await llmd.stop()
    assert done == "the agent's protocol has no prefetch"
    # It read the declaration and sent nothing else: an llm-d agent would take a
    # Restore with an unknown field for a real restore.
    assert llmd.calls["Status"] == 1 and llmd.calls["Restore"] == 0
