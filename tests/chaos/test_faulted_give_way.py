"""Found by the chaos suite (local mode): a deferred resident whose give-way snapshot
failed stays FAULTED on the devices, and no switch of an overlapping group ever reset
it or listed it to give way again; the next job that needed its room waited for ever
(its group SWITCHING, retrying a refused activation), and with it every group that
shares the devices.

Real processes: one sim agent whose fault dice (seed 32, 50 % failures) fail the first
copy and none of the next five, and an orchestrator in local mode (every group on
the node's devices; a state takes 30 GiB of 80, so two fit and a third needs room).
"""

from __future__ import annotations

from tests.chaos.nodes import two_states_fit
from tslice.agent.backends import simdevice as device
from tslice.client import AgentJobState, AsyncClient
from tslice.sim.cluster import LocalCluster


async def test_a_faulted_deferred_resident_is_reset_and_gives_way() -> None:
    async with LocalCluster(
        agents=[two_states_fit(fail_probability=0.5, extra_args=("--sim-seed", "32"))]
    ) as cluster:
        address = cluster.orchestrator_address
        async with (
            AsyncClient(address, job_id="x", lease_s=None) as x,
            AsyncClient(address, job_id="y", lease_s=None) as y,
            AsyncClient(address, job_id="z", lease_s=None) as z,
        ):
            # Two deferred residents on the node: x's g2 state and y's g3 state.
            await x.acquire("g2", timeout=20)
            await x.yield_("g2")
            await y.acquire("g3", timeout=20)
            await y.yield_("g3")
            # z's g1 needs room: x's g2 state gives way first, and that snapshot fails
            # (x's g2 record is FAULTED, its bytes still on the device). The switch
            # retries; before the fix, y's g3 state gave way instead and x's stayed.
            await z.acquire("g1", timeout=20)
            faults = device.read_faults(cluster.state_dir("node-1") / device.FAULTS_FILE)
            assert [(f.kind, f.job, f.group) for f in faults] == [("fail", "x", "g2")]

            # z, holding g1, takes g3 too: x's g2 state must make room (reset, then
            # snapshotted); before the fix nothing did and the acquire never returned.
            granted = await z.acquire("g3", timeout=10)
            assert granted.success
            status = await z.status("g2")

        states = {s.job_id: s.job_state for s in status.agent_job_states}
        assert states["x"] is AgentJobState.SAVED
