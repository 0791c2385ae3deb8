"""Prefetch from the orchestrator's side (issue 9 §2): whom to bring in (pure), and that
only an agent that declares the feature ever gets the directive."""

from __future__ import annotations

import dataclasses

from tests.orchestrator.llmd_agent import LlmdAgent
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator import agents, prefetching


@dataclasses.dataclass
class Lock:
    holder: str | None = "a"
    waiting_jobs: list[str] = dataclasses.field(default_factory=lambda: ["b", "c"])
    grant_epoch: int = 7
    footprints: dict[str, int] = dataclasses.field(default_factory=lambda: {"b": 5, "c": 9})

    def footprint(self, job: str) -> int:
        return self.footprints.get(job, 0)


def test_the_first_waiter_is_prefetched_while_someone_holds_and_no_switch_runs() -> None:
    assert prefetching.next_to_prefetch(Lock(), switching=False) == prefetching.Candidate(
        job="b", footprint_bytes=5, epoch=7
    )
    assert prefetching.next_to_prefetch(Lock(), switching=True) is None
    assert prefetching.next_to_prefetch(Lock(holder=None), switching=False) is None
    assert prefetching.next_to_prefetch(Lock(waiting_jobs=[]), switching=False) is None
    # Without a footprint nobody can tell whether it fits beside the holder.
    assert prefetching.next_to_prefetch(Lock(footprints={}), switching=False) is None


async def test_an_llmd_agent_never_gets_the_directive() -> None:
    llmd = LlmdAgent({"a": pb.JOB_STATE_RUNNING, "b": pb.JOB_STATE_SAVED})
    address = await llmd.start()
    client = agents.AgentClient(address)
    try:
        done = await client.prefetch(job_id="b", group="", footprint_bytes=1)
    finally:
        await client.close()
        await llmd.stop()
    assert done == "the agent declares no prefetch"
    # It read the declaration and sent nothing else: an llm-d agent would take a
    # Restore with an unknown field for a real restore.
    assert llmd.calls["Status"] == 1 and llmd.calls["Restore"] == 0
