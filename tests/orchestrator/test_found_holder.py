"""A group whose record was lost (HA: its ConfigMap deleted or unreadable) finds its holder
on the agents: the job resident on every node holds, unless it yielded, was evicted or
asked again while the agents were read; its Hold stream is accepted under the grant
epoch its client got from the lost record. The real-process form: tests/kube/
test_ha_lost_state.py."""

from __future__ import annotations

import pytest

from tests.orchestrator.recovery_views import F, R, S, decide, view
from tslice.orchestrator import metrics
from tslice.orchestrator.group import effects as act
from tslice.orchestrator.group import leases
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import records
from tslice.rpc import refusals


def _lost() -> lk.GroupLock:
    return lk.GroupLock.from_record(records.LockRecord.lost(), now=0)


def test_the_job_resident_on_every_node_holds_and_waiters_queue_behind_it() -> None:
    g = _lost()
    assert g.finding_holder and g.record().holder_from_agents
    assert g.on_acquire("b", now=1) == [act.Emit(act.EventKind.QUEUED, "b")]
    actions = g.on_recovered(resident="a", verified=True, rollback=False, now=2)
    assert actions == [act.NeedClaim("a", ())]
    assert (g.holder, g.finding_holder) == ("a", False)
    assert "tslice yield <group> a" in g.detail
    assert g.holder_epoch_unknown and g.record().holder_from_agents
    # Found again after a restart of the leader (its record kept).
    again = lk.GroupLock.from_record(g.record(), now=3)
    again.on_recovered(resident="a", verified=True, rollback=False, now=3)
    assert again.holder == "a" and again.holder_epoch_unknown
    # Its yield lets the waiter in; the next grant's epoch is known.
    (yielded, start) = g.on_yield("a", now=4).actions
    assert yielded == act.Emit(act.EventKind.YIELDED, "a")
    assert isinstance(start, act.StartSwitch) and (start.from_job, start.to_job) == ("a", "b")
    assert not g.holder_epoch_unknown and not g.record().holder_from_agents


@pytest.mark.parametrize("meanwhile", ["yield", "evict", "acquire"])
def test_a_job_that_yielded_was_evicted_or_asked_again_meanwhile_does_not_hold(
    meanwhile: str,
) -> None:
    g = _lost()
    if meanwhile == "yield":
        assert g.on_yield("a", now=1).ok  # nobody known to hold: an idempotent yield
    elif meanwhile == "evict":
        assert g.on_evict("a", why="every pod of job a is gone", now=1).role is None
    else:
        g.on_acquire("a", now=1)
    g.on_acquire("b", now=1)
    g.on_recovered(resident="a", verified=True, rollback=False, now=2)
    # Its turn is the queue's: first in line, "a" asking again is granted (resident: at no
    # cost, under a new epoch); else "b" is, with a switch that moves "a" out.
    assert g.holder == ("a" if meanwhile == "acquire" else "b")
    assert (g.switching is None) == (meanwhile == "acquire")
    assert not g.holder_epoch_unknown


def test_nobody_resident_nobody_holds() -> None:
    g = _lost()
    g.on_recovered(resident=None, verified=True, rollback=False, now=1)
    assert g.holder is None and not g.record().holder_from_agents


def test_the_one_job_on_every_node_is_named_even_when_the_agents_disagree() -> None:
    # A stale FAULTED record elsewhere must not hide the job that may hold.
    found = decide(None, [view(a=R, c=F), view(a=R)])
    assert (found.resident, found.verified) == ("a", False)
    assert decide(None, [view(a=R, c=R), view(a=R, c=S)]).resident == "a"
    assert decide(None, [view(a=R), view(c=R)]).resident is None


async def test_its_hold_stream_is_accepted_under_the_lost_grant_epoch() -> None:
    g = _lost()
    holds = leases.Leases("g", metrics.OrchestratorMetrics(), expired=lambda *_: None)
    with pytest.raises(refusals.Refused) as early:
        holds.open(g, "a", 7)
    assert early.value.code is refusals.Code.UNAVAILABLE  # retried, not "lost"
    g.on_recovered(resident="a", verified=True, rollback=False, now=1)
    assert holds.open(g, "a", 7).job == "a"
    g.on_yield("a", now=2)
    g.on_acquire("a", now=3)  # zero-cost: resident, nobody waits; a known epoch now
    assert not g.holder_epoch_unknown
    with pytest.raises(refusals.Refused) as stale:
        holds.open(g, "a", 7)
    assert stale.value.code is refusals.Code.FAILED_PRECONDITION
