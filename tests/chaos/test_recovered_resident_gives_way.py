"""Found by the chaos suite (local mode): after an orchestrator restart a group's
yielded resident was taken as verified although the group did not hold the device
claim, so nothing marked it stale when an overlapping group's switch made it give way;
its next Acquire was granted as a zero-cost re-acquire while its state was SAVED (the
checker: ``not_resident``, a job holding a group whose state was not on the devices).

Real processes: one sim agent and an orchestrator in local mode (every group on the
node's devices; a state takes 30 GiB of 80, so a third state needs room).
"""

from __future__ import annotations

from tests.chaos.nodes import two_states_fit
from tslice.client import AgentJobState, AsyncClient
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster


async def test_a_recovered_resident_that_gave_way_is_restored_on_its_next_acquire() -> None:
    async with LocalCluster(agents=[two_states_fit()]) as cluster:
        address = cluster.orchestrator_address
        async with AsyncClient(address, job_id="a", lease_s=None) as a:
            await a.acquire("g2", timeout=20)
            await a.yield_("g2")  # a's g2 state stays resident (deferred)
        cluster.kill(ORCHESTRATOR)
        cluster.restart(ORCHESTRATOR)  # g2 comes back: a resident, no device claim held
        async with (
            AsyncClient(address, job_id="a", lease_s=None) as a,
            AsyncClient(address, job_id="b", lease_s=None) as b,
        ):
            await b.acquire("g1", timeout=20)
            await b.yield_("g1")
            # a takes g3: a third state needs room, and a's own g2 state gives way
            # (snapshotted; listed first). g2 holds no device claim since the restart.
            await a.acquire("g3", timeout=20)
            # a, holding g3, takes g2 too: nobody else holds a claim, so g2 grants at once.
            again = await a.acquire("g2", timeout=20)
            status = await a.status("g2")

        # a holds g2 again: its state must have been restored onto the devices.
        assert again.context_restored
        states = {s.job_id: s.job_state for s in status.agent_job_states}
        assert states["a"] is AgentJobState.RUNNING
