"""The all-or-nothing check of the AcquireSet tests (acquire_set_stack), on made-up events:
it must flag a set granted one group at a time, or it proves nothing."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from tests.faults.stack import K
from tests.integration.acquire_set_stack import Taken, all_or_nothing_violations, kept_free
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb


def _event(t: float, kind: int, group: str, job: str, epoch: int = 0) -> opb.OrchestratorEvent:
    at = timestamp_pb2.Timestamp(seconds=int(t), nanos=int((t % 1) * 1e9))
    return opb.OrchestratorEvent(time=at, kind=kind, group_id=group, job_id=job, grant_epoch=epoch)


def _history(j_starts_g1_at: float) -> list[opb.OrchestratorEvent]:
    """k holds g1 until 1 and g2 until 5; j's set {g1, g2} switches g2 in at 6."""
    return [
        _event(0, K.KIND_GRANTED, "g1", "k", 1),
        _event(0, K.KIND_GRANTED, "g2", "k", 1),
        _event(1, K.KIND_YIELDED, "g1", "k"),
        _event(5, K.KIND_YIELDED, "g2", "k"),
        _event(j_starts_g1_at, K.KIND_SWITCH_STARTED, "g1", "j", 2),
        _event(6, K.KIND_SWITCH_STARTED, "g2", "j", 2),
        _event(7, K.KIND_GRANTED, "g1", "j", 2),
        _event(7, K.KIND_GRANTED, "g2", "j", 2),
    ]


def test_a_set_granted_once_all_its_groups_were_free_passes() -> None:
    taken = [Taken("k", {"g1": 1}), Taken("k", {"g2": 1}), Taken("j", {"g1": 2, "g2": 2})]
    events = _history(j_starts_g1_at=6)
    assert all_or_nothing_violations(events, taken) == []
    assert kept_free(events, taken) == 1  # g1 was free from 1, kept until 6


def test_a_set_granted_one_group_at_a_time_is_flagged() -> None:
    taken = [Taken("j", {"g1": 2, "g2": 2})]
    found = all_or_nothing_violations(_history(j_starts_g1_at=2), taken)
    assert len(found) == 1 and "while job k held g2" in found[0], found
    missing = all_or_nothing_violations(_history(6), [Taken("j", {"g1": 3, "g2": 2})])
    assert missing and "no event of its grant" in missing[0], missing
