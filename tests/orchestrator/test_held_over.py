"""What comes for a stopped group is kept per group, in order, and an eviction is dropped
once its job is live again (its pods back). The real-process form: tests/kube/
test_stopped_group.py."""

from __future__ import annotations

from tslice.orchestrator.group import held_over
from tslice.orchestrator.persistence import records


def test_kept_in_order_per_group_and_a_job_back_is_not_evicted() -> None:
    kept = held_over.HeldOver()
    kept.keep("trainer", held_over.Yield("job-a"))
    kept.keep("trainer", held_over.Eviction("job-b", "pods gone", "Kubernetes mode"))
    kept.keep("sampler", held_over.Eviction("job-b", "pods gone", "Kubernetes mode"))
    kept.revoke(frozenset({"job-b"}))  # a pod of job-b is live again
    assert kept.take("trainer") == [held_over.Yield("job-a")]
    assert kept.take("trainer") == [] and kept.take("sampler") == []


def test_a_record_names_its_holder_switch_target_and_waiters() -> None:
    record = records.LockRecord(
        None,
        "job-a",
        2,
        1,
        5,
        (records.QueueRecord("job-c", 4, 0),),
        records.IntentRecord("job-a", "job-b", 2, 3),
        (),
    )
    assert held_over.holds(record, "job-b") and not held_over.holds(record, "job-a")
    assert held_over.names(record, "job-c") and not held_over.holds(record, "job-c")
