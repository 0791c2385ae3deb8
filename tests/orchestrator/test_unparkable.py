"""A switch whose snapshot a node cannot park is not started (issue 20 §2, the
orchestrator's side): the holder keeps running, the waiter keeps its place and hears why,
and the group tries again later. The plan's check and the pure lock's rule here; the
agent's own refusal (nothing frozen) is tests/agent/test_host_budget.py's."""

from __future__ import annotations

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.switch import plan

GiB = 2**30


def _view(budget: int, parked: int, holder_bytes: int) -> plan.NodeView:
    view = plan.NodeView(
        {
            "a": plan.JobView(pb.JOB_STATE_RUNNING, "g", device_bytes=holder_bytes, backend="cuda"),
            "b": plan.JobView(pb.JOB_STATE_SAVED, "g", backend="cuda"),
        }
    )
    view.host_budget_bytes, view.host_parked_bytes = budget, parked
    return view


def _switch() -> plan.SwitchPlan:
    return plan.SwitchPlan(group="g", from_job="a", to_job="b", epoch=2, footprint_bytes=0)


def test_a_node_whose_budget_is_held_by_parked_states_cannot_park_the_holder() -> None:
    # The budget holds two parked states of 2 GiB; both are parked: the third cannot be.
    why = _switch().unparkable("node-a", _view(4 * GiB, 4 * GiB, 2 * GiB))
    assert "node node-a cannot park" in why and "a 2147483648 bytes" in why
    assert "0 are available" in why and "the holder keeps running" in why
    # Room for it, or a node that reports no budget: the switch goes ahead.
    assert _switch().unparkable("node-a", _view(6 * GiB, 4 * GiB, 2 * GiB)) == ""
    assert _switch().unparkable("node-a", _view(0, 0, 2 * GiB)) == ""


def test_an_unparkable_switch_keeps_the_holder_and_the_waiters_place_until_a_retry() -> None:
    g = lk.GroupLock()
    g.on_acquire("a", now=0)
    g.on_switch_done(epoch=g.grant_epoch, restored=False, now=0)
    g.on_acquire("b", now=1)
    started = [d for d in g.on_yield("a", now=2).actions if isinstance(d, decisions.StartSwitch)]
    assert [(s.from_job, s.to_job) for s in started] == [("a", "b")]
    decided = g.on_switch_unparkable(epoch=started[0].epoch, detail="node-a full", now=3)
    assert not any(isinstance(d, (decisions.StartSwitch, decisions.Granted)) for d in decided)
    assert g.holder is None and g.resident == "a"  # a's state stays where it runs
    assert g.waiting_jobs == ["b"] and g.unparkable == "node-a full"
    # The group tries again (a yield, a read of the node, or the backoff's retry).
    again = [d for d in g.on_parking_retry(now=4) if isinstance(d, decisions.StartSwitch)]
    assert [(s.from_job, s.to_job) for s in again] == [("a", "b")]
    assert g.unparkable == ""
