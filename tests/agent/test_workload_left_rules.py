"""The agent's rules for a job whose workload left (tslice.agent.jobs.rules), driven directly."""

from __future__ import annotations

import pytest

from tslice.agent.backends import base
from tslice.agent.jobs import model, rules
from tslice.rpc import refusals

S = model.State
NODE = "node-a"
CHANNEL = model.Route(backend="app-channel", config=None)
WHY = "the workload closed the channel"


def record(state: S, **kw: object) -> model.Job:
    fields: dict[str, object] = {
        "job_id": "j1",
        "group": "g",
        "state": state,
        "backend": "app-channel",
        "choice": "app-channel",
        "device_bytes": 100,
        "host_bytes": 50,
        "backend_state": {"residency": "full"},
    }
    fields.update(kw)
    return model.Job(**fields)  # type: ignore[arg-type]


def request(op_id: str = "op-1") -> model.Request:
    return model.Request(job_id="j1", group="g", route=CHANNEL, node=NODE, op_id=op_id, now=100.0)


def left() -> model.Job:
    return rules.after_workload_left(record(S.RUNNING), reason=WHY)


@pytest.mark.parametrize("state", [S.IDLE, S.RUNNING, S.SAVED, S.FAULTED])
def test_a_settled_record_of_the_channel_becomes_idle_with_why(state: S) -> None:
    gone = rules.after_workload_left(record(state, error="boom"), reason=WHY)
    assert gone.state is S.IDLE
    assert (gone.device_bytes, gone.host_bytes, gone.error) == (0, 0, "")
    assert gone.backend_state == {model.WORKLOAD_LEFT: WHY}


def test_a_transitioning_record_waits_for_its_operation() -> None:
    moving = record(S.TRANSITIONING, previous_state=S.RUNNING)
    assert rules.after_workload_left(moving, reason=WHY) == moving


@pytest.mark.parametrize(
    "fields", [{"backend": "sim", "choice": ""}, {"backend": "", "choice": "sim"}]
)
def test_a_record_of_another_backend_is_not_the_workloads(fields: dict[str, str]) -> None:
    other = record(S.RUNNING, **fields)
    assert rules.after_workload_left(other, reason=WHY) == other


def test_a_snapshot_of_a_job_whose_workload_left_is_complete_with_nothing_moved() -> None:
    plan = rules.plan_snapshot(left(), request())
    assert isinstance(plan, model.Done)
    assert plan.operation.status is model.OpStatus.COMPLETE
    assert (plan.operation.storage_bytes, plan.operation.device_bytes) == (0, 0)
    assert plan.job.state is S.IDLE and plan.job.operation_id == "op-1"


def test_a_snapshot_of_an_idle_job_that_never_left_is_still_refused() -> None:
    with pytest.raises(refusals.Refused) as info:
        rules.plan_snapshot(record(S.IDLE, backend_state={}), request())
    assert "nothing is resident to snapshot" in str(info.value)


def test_a_restore_of_a_job_whose_workload_left_says_it_must_register_again() -> None:
    # Even with another job resident in the group: the first thing to fix is named.
    other = record(S.RUNNING, job_id="j2")
    with pytest.raises(refusals.Refused) as info:
        rules.plan_restore(left(), request(), others=[other])
    assert info.value.code is refusals.Code.FAILED_PRECONDITION
    message = str(info.value)
    assert f"left node {NODE} ({WHY})" in message and "must register again" in message


def test_a_snapshot_that_finds_the_workload_gone_leaves_the_job_idle() -> None:
    moving = record(S.TRANSITIONING, previous_state=S.RUNNING, operation_id="op-1")
    op = model.Operation(
        op_id="op-1",
        job_id="j1",
        group="g",
        kind=model.Kind.SNAPSHOT,
        backend="app-channel",
        status=model.OpStatus.PENDING,
        started_at=1.0,
    )
    result = base.OpResult(state={"residency": "none", model.WORKLOAD_LEFT: WHY})
    job, done = rules.finish(moving, op, outcome=model.Outcome(result=result), now=2.0)
    assert job.state is S.IDLE and job.backend_state == {model.WORKLOAD_LEFT: WHY}
    assert (job.device_bytes, job.host_bytes) == (0, 0)
    assert done.status is model.OpStatus.COMPLETE and done.finished_at == 2.0
    assert (done.storage_bytes, done.device_bytes) == (0, 0)


@pytest.mark.parametrize(
    ("suspended", "state"), [(None, S.RUNNING), (False, S.RUNNING), (True, S.SAVED)]
)
def test_a_new_registration_forgets_that_the_workload_left(
    suspended: bool | None, state: S
) -> None:
    back = rules.after_channel_registration(left(), job_id="j1", group="g", suspended=suspended)
    assert back.state is state and model.WORKLOAD_LEFT not in back.backend_state


def test_a_grant_after_the_workload_left_forgets_it() -> None:
    plan = rules.plan_grant(left(), request(), epoch=2, last=None, footprint_bytes=0, others=[])
    assert isinstance(plan, model.Start) and plan.operation.kind is model.Kind.ACTIVATE
    assert model.WORKLOAD_LEFT not in plan.job.backend_state


def test_a_grant_does_not_touch_an_unrelated_state() -> None:
    # An IDLE job that never left is granted as before.
    plan = rules.plan_grant(
        record(S.IDLE, backend_state={}),
        request(),
        epoch=1,
        last=None,
        footprint_bytes=0,
        others=[],
    )
    assert isinstance(plan, model.Start)
    assert plan.job.state is S.TRANSITIONING and plan.job.previous_state is S.IDLE
