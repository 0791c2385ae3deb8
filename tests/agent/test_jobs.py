"""The pure per-job state machine (tslice.agent.jobs.rules), driven directly."""

from __future__ import annotations

import dataclasses

import pytest

from tslice.agent.backends import base
from tslice.agent.jobs import model, routing, rules
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.rpc import refusals

S = model.State
NODE = "node-a"
DEFAULT = model.Route(backend="sim", config=None)


def job(state: S, **kw: object) -> model.Job:
    fields: dict[str, object] = {"job_id": "j1", "group": "g", "state": state, "backend": "sim"}
    fields.update(kw)
    return model.Job(**fields)  # type: ignore[arg-type]


def request(op_id: str, kw: dict[str, object]) -> model.Request:
    """The request the rules get; ``kw`` may override its fields (``route_`` = ``route``)."""
    return model.Request(
        job_id=str(kw.pop("job_id", "j1")),
        group=str(kw.pop("group", "g")),
        route=kw.pop("route_", DEFAULT),  # type: ignore[arg-type]
        node=NODE,
        op_id=op_id,
        now=100.0,
    )


def snapshot(current: model.Job | None, **kw: object) -> model.Start:
    return rules.plan_snapshot(current, request("op-1", kw), **kw)  # type: ignore[arg-type]


def restore(current: model.Job | None, **kw: object) -> model.Start | model.Done:
    args: dict[str, object] = {"others": []}
    args.update(kw)
    return rules.plan_restore(current, request("op-2", args), **args)  # type: ignore[arg-type]


def grant(current: model.Job | None, **kw: object) -> model.Start | model.Unchanged:
    args: dict[str, object] = {"epoch": 1, "last": None, "footprint_bytes": 0, "others": []}
    args.update(kw)
    return rules.plan_grant(current, request("op-3", args), **args)  # type: ignore[arg-type]


def refused(fn: object, *args: object, **kw: object) -> refusals.Refused:
    with pytest.raises(refusals.Refused) as info:
        fn(*args, **kw)  # type: ignore[operator]
    return info.value


# ---- snapshot ----------------------------------------------------------------------------


def test_snapshot_of_running_job_starts_a_transition() -> None:
    plan = snapshot(job(S.RUNNING))
    assert plan.job.state is S.TRANSITIONING
    assert plan.job.previous_state is S.RUNNING
    assert plan.job.operation_id == "op-1"
    assert plan.operation.status is model.OpStatus.PENDING
    assert plan.operation.kind is model.Kind.SNAPSHOT


@pytest.mark.parametrize(
    ("state", "code", "words"),
    [
        (S.TRANSITIONING, refusals.Code.ABORTED, "already running for job j1"),
        (S.IDLE, refusals.Code.FAILED_PRECONDITION, "IDLE"),
        (S.SAVED, refusals.Code.FAILED_PRECONDITION, "restore it"),
        (S.FAULTED, refusals.Code.FAILED_PRECONDITION, "ResetJob"),
    ],
)
def test_snapshot_refusals_name_the_state_and_the_fix(
    state: S, code: refusals.Code, words: str
) -> None:
    err = refused(snapshot, job(state, operation_id="op-0"))
    assert err.code is code
    assert words in err.message


def test_snapshot_of_unknown_job_is_not_found_and_says_how_jobs_become_known() -> None:
    err = refused(snapshot, None)
    assert err.code is refusals.Code.NOT_FOUND
    assert "job j1 (group g) is not known on node node-a; check the job id" in err.message
    assert "granted" in err.message
    # Naming a backend is not enough: a sim or noop config points at nothing.
    config = pb.BackendConfig(sim=pb.SimBackendConfig(footprint_bytes=123))
    route = model.Route(backend="sim", config=config, explicit=True, record=True)
    assert refused(snapshot, None, route_=route).code is refusals.Code.NOT_FOUND


def test_unknown_job_is_adopted_when_its_backend_holds_it_or_the_request_names_it() -> None:
    plan = snapshot(None, recovered=S.RUNNING)
    assert (plan.job.previous_state, plan.job.group) == (S.RUNNING, "g")
    pids = pb.BackendConfig(cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=[7])))
    route = model.Route(backend="cuda", config=pids, explicit=True, record=True)
    plan = snapshot(None, route_=route)
    assert plan.job.choice == "cuda"
    assert plan.job.backend_config() == pids
    assert refused(snapshot, None, recovered=S.IDLE).code is refusals.Code.NOT_FOUND


def test_faulted_job_is_retried_only_when_the_backend_reports_it_running() -> None:
    faulted = job(S.FAULTED, error="boom")
    assert refused(snapshot, faulted, recovered=S.SAVED).code is refusals.Code.FAILED_PRECONDITION
    plan = snapshot(faulted, recovered=S.RUNNING)
    assert plan.job.state is S.TRANSITIONING
    assert plan.job.error == ""


# ---- restore -------------------------------------------------------------------------------


def test_restore_of_saved_job_starts_a_transition() -> None:
    plan = restore(job(S.SAVED))
    assert isinstance(plan, model.Start)
    assert plan.job.state is S.TRANSITIONING
    assert plan.job.previous_state is S.SAVED
    assert plan.operation.kind is model.Kind.RESTORE


def test_restore_of_running_job_is_a_real_complete_operation() -> None:
    plan = restore(job(S.RUNNING))
    assert isinstance(plan, model.Done)
    assert plan.operation.status is model.OpStatus.COMPLETE
    assert (plan.operation.storage_bytes, plan.operation.device_bytes) == (0, 0)
    assert plan.job.state is S.RUNNING
    assert plan.job.operation_id == plan.operation.op_id == "op-2"


def test_restore_of_running_job_with_missing_tags_goes_to_the_backend() -> None:
    plan = restore(job(S.RUNNING), partial=True)
    assert isinstance(plan, model.Start)
    assert plan.job.previous_state is S.RUNNING


@pytest.mark.parametrize(
    ("current", "code"),
    [
        (None, refusals.Code.NOT_FOUND),
        (job(S.IDLE), refusals.Code.FAILED_PRECONDITION),
        (job(S.TRANSITIONING), refusals.Code.ABORTED),
        (job(S.FAULTED), refusals.Code.FAILED_PRECONDITION),
    ],
)
def test_restore_refusals(current: model.Job | None, code: refusals.Code) -> None:
    assert refused(restore, current).code is code


def test_restore_must_use_the_backend_that_saved_the_job() -> None:
    noop = model.Route(
        backend="noop", config=pb.BackendConfig(noop=pb.NoopBackendConfig()), explicit=True
    )
    err = refused(restore, job(S.SAVED), route_=noop)
    assert err.code is refusals.Code.FAILED_PRECONDITION
    assert "held by backend sim" in err.message


def test_restore_refused_while_another_job_of_the_group_is_resident() -> None:
    other = job(S.RUNNING, job_id="j2")
    err = refused(restore, job(S.SAVED), others=[other])
    assert err.code is refusals.Code.FAILED_PRECONDITION
    assert "j2" in err.message
    # Another group does not matter.
    assert isinstance(
        restore(job(S.SAVED), others=[job(S.RUNNING, job_id="j2", group="h")]), model.Start
    )


# ---- grant ---------------------------------------------------------------------------------------


def test_grant_of_unknown_job_activates_it() -> None:
    plan = grant(None, footprint_bytes=77)
    assert isinstance(plan, model.Start)
    assert plan.operation.kind is model.Kind.ACTIVATE
    assert plan.job.previous_state is S.IDLE
    assert plan.job.footprint_bytes == 77
    assert plan.job.group == "g"


def test_grant_of_running_job_changes_nothing() -> None:
    plan = grant(job(S.RUNNING))
    assert isinstance(plan, model.Unchanged)
    assert plan.job.state is S.RUNNING


@pytest.mark.parametrize(
    ("state", "code", "words"),
    [
        (S.SAVED, refusals.Code.FAILED_PRECONDITION, "restore it first"),
        (S.TRANSITIONING, refusals.Code.ABORTED, "already running"),
        (S.FAULTED, refusals.Code.FAILED_PRECONDITION, "ResetJob"),
    ],
)
def test_grant_refusals(state: S, code: refusals.Code, words: str) -> None:
    err = refused(grant, job(state))
    assert err.code is code
    assert words in err.message


def test_grant_with_an_older_epoch_is_stale() -> None:
    last = model.GrantMark(group="g", epoch=5, job_id="j0")
    err = refused(grant, None, epoch=4, last=last)
    assert err.code is refusals.Code.FAILED_PRECONDITION
    assert "stale" in err.message
    assert "epoch 5" in err.message
    # One epoch names one job; the same grant repeated is fine.
    assert refused(grant, None, epoch=5, last=last).code is refusals.Code.FAILED_PRECONDITION
    assert isinstance(
        grant(None, epoch=5, last=dataclasses.replace(last, job_id="j1")), model.Start
    )
    # Epoch 0 is unfenced (clients that send none).
    assert isinstance(grant(None, epoch=0, last=last), model.Start)


def test_grant_refused_while_another_job_of_the_group_is_resident() -> None:
    for state in (S.RUNNING, S.TRANSITIONING):
        err = refused(grant, None, others=[job(state, job_id="j2")])
        assert "j2" in err.message
    assert isinstance(grant(None, others=[job(S.SAVED, job_id="j2")]), model.Start)


# ---- outcomes ----------------------------------------------------------------------------------


def test_finish_success_moves_to_the_target_state_with_measured_bytes() -> None:
    plan = snapshot(job(S.RUNNING, backend_state={"a": 1}))
    result = base.OpResult(device_bytes=10, host_bytes=8, state={"b": 2})
    done_job, done_op = rules.finish(
        plan.job, plan.operation, outcome=model.Outcome(result=result), now=101.5
    )
    assert done_job.state is S.SAVED
    assert (done_job.device_bytes, done_job.host_bytes) == (0, 8)
    assert done_job.backend_state == {"a": 1, "b": 2}
    assert done_op.status is model.OpStatus.COMPLETE
    assert (done_op.storage_bytes, done_op.device_bytes) == (8, 10)
    assert done_op.finished_at == 101.5

    back = restore(done_job)
    assert isinstance(back, model.Start)
    running, _ = rules.finish(
        back.job,
        back.operation,
        outcome=model.Outcome(result=base.OpResult(device_bytes=10)),
        now=102,
    )
    assert running.state is S.RUNNING
    assert running.device_bytes == 10


def test_transient_failure_returns_to_the_previous_state() -> None:
    plan = restore(job(S.SAVED))
    assert isinstance(plan, model.Start)
    after, op = rules.finish(
        plan.job,
        plan.operation,
        outcome=model.Outcome(error="busy", state_changed=False),
        now=101,
    )
    assert after.state is S.SAVED
    assert op.status is model.OpStatus.FAILED
    assert op.error == "busy"
    assert op.storage_bytes is None


def test_fatal_failure_faults_the_job_and_keeps_the_error() -> None:
    plan = snapshot(job(S.RUNNING))
    after, op = rules.finish(
        plan.job, plan.operation, outcome=model.Outcome(error="driver died"), now=101
    )
    assert after.state is S.FAULTED
    assert after.error == "driver died"
    assert op.error == "driver died"


def test_reset_takes_the_backend_state_else_idle() -> None:
    faulted = job(S.FAULTED, error="x", host_bytes=5, device_bytes=7)
    assert rules.after_reset(faulted, recovered=None).state is S.IDLE
    saved = rules.after_reset(faulted, recovered=S.SAVED)
    assert (saved.state, saved.host_bytes, saved.device_bytes, saved.error) == (S.SAVED, 5, 0, "")
    assert rules.after_reset(faulted, recovered=S.RUNNING).state is S.RUNNING
    assert rules.after_reset(faulted, recovered=S.TRANSITIONING).state is S.IDLE
    with pytest.raises(refusals.Refused) as info:
        rules.check_reset(job(S.RUNNING), job_id="j1", node=NODE)
    assert info.value.code is refusals.Code.FAILED_PRECONDITION
    with pytest.raises(refusals.Refused) as info:
        rules.check_reset(None, job_id="j1", node=NODE)
    assert info.value.code is refusals.Code.NOT_FOUND


def test_after_restart_faults_unless_the_backend_knows() -> None:
    plan = snapshot(job(S.RUNNING))
    faulted, op = rules.after_restart(plan.job, plan.operation, recovered=None, now=200)
    assert faulted.state is S.FAULTED
    assert "agent restarted during operation op-1; reset it" in faulted.error
    assert op is not None
    assert op.status is model.OpStatus.FAILED
    running, op = rules.after_restart(plan.job, plan.operation, recovered=S.RUNNING, now=200)
    assert running.state is S.RUNNING
    assert op is not None
    assert "reports job j1 RUNNING" in (op.error or "")


# ---- routing -----------------------------------------------------------------------------------


def test_route_precedence() -> None:
    channel_cfg = pb.BackendConfig(app_channel=pb.AppChannelConfig())
    request = routing.route(
        request_config=channel_cfg,
        job=job(S.RUNNING),
        channel_registered=False,
        default_backend="sim",
    )
    assert (request.backend, request.explicit) == ("app-channel", True)
    held = routing.route(
        request_config=None,
        job=job(S.SAVED, backend="cuda", choice="app-channel"),
        channel_registered=True,
        default_backend="sim",
    )
    assert held.backend == "cuda"
    chosen = routing.route(
        request_config=None,
        job=job(S.RUNNING, backend="sim", choice="noop"),
        channel_registered=True,
        default_backend="sim",
    )
    assert chosen.backend == "noop"
    via_channel = routing.route(
        request_config=None,
        job=job(S.RUNNING, backend="noop"),
        channel_registered=True,
        default_backend="sim",
    )
    assert (via_channel.backend, via_channel.record) == ("app-channel", True)
    last = routing.route(
        request_config=None,
        job=job(S.RUNNING, backend="noop"),
        channel_registered=False,
        default_backend="sim",
    )
    assert last.backend == "noop"
    default = routing.route(
        request_config=None, job=None, channel_registered=False, default_backend="sim"
    )
    assert (default.backend, default.explicit) == ("sim", False)


def test_route_maps_every_arm_and_the_deprecated_enum() -> None:
    arms = {
        "cuda": pb.BackendConfig(cuda=pb.CudaBackendConfig()),
        "app-endpoint": pb.BackendConfig(app_endpoint=pb.AppEndpointConfig()),
        "app-channel": pb.BackendConfig(app_channel=pb.AppChannelConfig()),
        "sim": pb.BackendConfig(sim=pb.SimBackendConfig()),
        "noop": pb.BackendConfig(noop=pb.NoopBackendConfig()),
    }
    for name, config in arms.items():
        assert routing.requested_backend(config) == name
    assert routing.requested_backend(None, deprecated_backend=pb.BACKEND_CUDA) == "cuda"
    assert routing.requested_backend(pb.BackendConfig()) is None
    for unsupported in (
        pb.BackendConfig(direct_memory=pb.DirectMemoryBackendConfig()),
        pb.BackendConfig(memory_regions=pb.MemoryRegionsBackendConfig()),
    ):
        err = refused(routing.requested_backend, unsupported)
        assert err.code is refusals.Code.FAILED_PRECONDITION
        assert "not supported by this agent" in err.message


def test_a_backend_not_enabled_is_refused_naming_the_flag() -> None:
    err = routing.not_enabled("cuda", enabled=["sim"], node=NODE)
    assert err.code is refusals.Code.FAILED_PRECONDITION
    assert "--backend cuda" in err.message


def test_channel_registration_is_resident_and_records_app_channel_unless_chosen() -> None:
    new = rules.after_channel_registration(None, job_id="w", group="g")
    assert (new.state, new.choice, new.backend, new.key) == (
        S.RUNNING,
        "app-channel",
        "app-channel",
        ("w", "g"),
    )
    granted = job(S.RUNNING, backend="sim")
    assert rules.after_channel_registration(granted, job_id="j1", group="g").choice == "app-channel"
    chosen = job(S.RUNNING, choice="cuda")
    assert rules.after_channel_registration(chosen, job_id="j1", group="g") is chosen
    # A known IDLE record becomes resident; a SAVED one stays SAVED unless the workload
    # reports its state (llm-d's do not: only the commands sent changed it).
    idle = job(S.IDLE, backend="")
    assert rules.after_channel_registration(idle, job_id="j1", group="g").state is S.RUNNING
    saved = job(S.SAVED, backend="app-channel")
    assert rules.after_channel_registration(saved, job_id="j1", group="g").state is S.SAVED
    woke = rules.after_channel_registration(saved, job_id="j1", group="g", suspended=False)
    assert woke.state is S.RUNNING
    back = rules.after_channel_registration(None, job_id="w", group="g", suspended=True)
    assert back.state is S.SAVED
    busy = job(S.TRANSITIONING, backend="app-channel")
    assert rules.after_channel_registration(busy, job_id="j1", group="g").state is S.TRANSITIONING
