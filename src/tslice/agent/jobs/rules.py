"""The per-job state machine of the node agent, as pure functions over frozen records.

Nothing here awaits, touches a backend, a socket or a file: each ``plan_*`` function
takes the current record and a :class:`Request` (the backend that serves it, a new
operation id, the time) plus what the backend reported, and either raises
:class:`refusals.Refused` with the status code and an actionable message, or returns
the records to store. The async runner (``tslice.agent.moves.runner``) applies them, so
every rule can be tested directly. Its siblings are pure too: ``tslice.agent.jobs.routing``
picks the backend of a request, ``tslice.agent.moves.grant_plan`` the moves of a Grant.

The records and plans themselves are :mod:`tslice.agent.jobs.model`. They are kept
per (job, group): a job that uses a sampler pool and a trainer pool has one piece of
device state per group, even on a node both groups span, and a move on one group
never touches the other's (``model.Key``).

States: IDLE (known, nothing resident) -> RUNNING (resident) -> TRANSITIONING (one
operation in flight) -> SAVED (state off the devices) or back; FAULTED when an
operation may have left the state inconsistent, until ResetJob or a retry the
backend confirms is safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from tslice.agent.jobs.model import (
    WORKLOAD_LEFT,
    Done,
    GrantMark,
    Job,
    Key,
    Kind,
    Operation,
    OpStatus,
    Outcome,
    Request,
    Route,
    Start,
    State,
    Unchanged,
)
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.rpc import refusals
from tslice.server import grant_marks


def _done(job: Job, request: Request, *, kind: Kind) -> Done:
    """An operation with nothing to move: COMPLETE at once, 0 bytes, the record unchanged."""
    operation = Operation(
        op_id=request.op_id,
        job_id=job.job_id,
        group=job.group,
        kind=kind,
        backend=job.backend or request.route.backend,
        status=OpStatus.COMPLETE,
        started_at=request.now,
        finished_at=request.now,
        storage_bytes=0,
        device_bytes=0,
    )
    return Done(job=dataclasses.replace(job, operation_id=request.op_id), operation=operation)


def _arrived(job: Job) -> Job:
    """A record about to be resident again forgets that its workload had left."""
    if WORKLOAD_LEFT not in job.backend_state:
        return job
    kept = {k: v for k, v in job.backend_state.items() if k != WORKLOAD_LEFT}
    return dataclasses.replace(job, backend_state=kept)


def _start(job: Job, request: Request, *, kind: Kind, resume_state: State) -> Start:
    backend = request.route.backend
    operation = Operation(
        op_id=request.op_id,
        job_id=job.job_id,
        group=job.group,
        kind=kind,
        backend=backend,
        status=OpStatus.PENDING,
        started_at=request.now,
    )
    job = dataclasses.replace(
        job,
        state=State.TRANSITIONING,
        backend=backend,
        operation_id=request.op_id,
        previous_state=resume_state,
        error="",
    )
    return Start(job=job, operation=operation)


def _aborted(job: Job) -> refusals.Refused:
    return refusals.Refused(
        refusals.Code.ABORTED,
        f"operation {job.operation_id} already running for job {job.job_id}; wait for it "
        "(WaitOperation) and retry",
    )


def _faulted(job: Job, *, node: str) -> refusals.Refused:
    return refusals.Refused(
        refusals.Code.FAILED_PRECONDITION,
        f"job {job.job_id} is FAULTED on node {node} ({job.error or 'no error recorded'}); "
        "clear it with ResetJob",
    )


def _precondition(message: str) -> refusals.Refused:
    return refusals.Refused(refusals.Code.FAILED_PRECONDITION, message)


def _check_resident_neighbours(
    job_id: str,
    group: str,
    *,
    others: Iterable[Job],
    node: str,
    leaving: Collection[Key] = (),
) -> None:
    """Safety net: never two jobs of one group resident on this node (a record in
    ``leaving``, whose snapshot runs, is on its way out: an overlapping restore).
    ``others``: the node's records, or only the group's (the others are not looked at)."""
    if not group:
        return
    resident = (State.RUNNING, State.TRANSITIONING)
    for other in others:
        if other.state is State.TRANSITIONING and other.key in leaving:
            continue
        if other.job_id != job_id and other.group == group and other.state in resident:
            raise _precondition(
                f"job {other.job_id} of group {group} is {other.state.value} on node {node}; "
                f"snapshot it before job {job_id} can be resident (two jobs of a group are "
                "never resident together)"
            )


def _with_choice(job: Job, route_: Route) -> Job:
    """Record an explicit (or workload-channel) choice: the job's backend from now on."""
    if not route_.record:
        return job
    config = route_.config.SerializeToString() if route_.config is not None else b""
    return dataclasses.replace(job, choice=route_.backend, config=config)


def _sim_footprint(config: pb.BackendConfig | None) -> int:
    if config is not None and config.WhichOneof("backend") == "sim":
        return int(config.sim.footprint_bytes)
    return 0


def names_target(config: pb.BackendConfig | None) -> bool:
    """The config points at the job's state itself (processes, engine endpoints)."""
    if config is None:
        return False
    arm = config.WhichOneof("backend")
    if arm == "cuda":
        return bool(config.cuda.explicit_target.pids)
    if arm == "app_endpoint":
        return bool(config.app_endpoint.endpoints)
    return False


def unknown_job(job_id: str, group: str, *, node: str) -> refusals.Refused:
    of_group = f" (group {group})" if group else ""
    return refusals.Refused(
        refusals.Code.NOT_FOUND,
        f"job {job_id}{of_group} is not known on node {node}; check the job id (and group). "
        "A job becomes known when it is granted, when its workload registers, or when a "
        "request names its processes or endpoints",
    )


def plan_snapshot(
    job: Job | None, request: Request, *, recovered: State | None = None
) -> Start | Done:
    """RUNNING -> TRANSITIONING (-> SAVED when the backend finishes).

    An unknown job is adopted as RUNNING only when its backend reports it RUNNING
    (``recovered``) or the request names its target (processes, endpoints: an llm-d
    style client asserting that the job runs there); anything else is a typo and
    creates nothing. A FAULTED job is retried when the backend reports it RUNNING.
    A job whose workload left (:func:`after_workload_left`) has nothing resident: the
    snapshot is an operation already COMPLETE, 0 bytes, and the record stays IDLE.
    """
    job_id, node, route_ = request.job_id, request.node, request.route
    footprint = _sim_footprint(route_.config) if route_.explicit else 0
    if job is None:
        if not (recovered is State.RUNNING or (route_.explicit and names_target(route_.config))):
            raise unknown_job(job_id, request.group, node=node)
        job = Job(job_id=job_id, group=request.group, state=State.RUNNING)
    if job.state is State.TRANSITIONING:
        raise _aborted(job)
    if job.state is State.FAULTED and recovered is not State.RUNNING:
        raise _faulted(job, node=node)
    if job.state is State.IDLE and job.backend_state.get(WORKLOAD_LEFT):
        return _done(job, request, kind=Kind.SNAPSHOT)
    if job.state is State.IDLE:
        raise _precondition(
            f"job {job_id} is IDLE on node {node}: nothing is resident to snapshot; it becomes "
            "RUNNING when granted"
        )
    if job.state is State.SAVED:
        raise _precondition(
            f"job {job_id} is already SAVED on node {node} (operation {job.operation_id}); "
            "restore it before snapshotting again"
        )
    job = _with_choice(job, route_)
    if request.group and not job.group:  # a record made without a group takes the group
        job = dataclasses.replace(job, group=request.group)
    if footprint:
        job = dataclasses.replace(job, footprint_bytes=footprint)
    return _start(job, request, kind=Kind.SNAPSHOT, resume_state=State.RUNNING)


def plan_restore(
    job: Job | None,
    request: Request,
    *,
    others: Iterable[Job],
    recovered: State | None = None,
    partial: bool = False,
    leaving: Collection[Key] = (),
) -> Start | Done:
    """SAVED -> TRANSITIONING (-> RUNNING when the backend finishes).

    ``leaving``: neighbours of the group whose snapshot runs beside this restore
    (overlapping moves, ``tslice.agent.moves.grant_plan``); any other resident neighbour refuses it.

    A RUNNING job yields an operation that is already COMPLETE (pollable, 0 bytes)
    unless ``partial``: the backend reported that requested tags are not resident
    (staged wake), in which case the restore is sent to the backend.
    """
    job_id, node, route_ = request.job_id, request.node, request.route
    if job is None:
        raise unknown_job(job_id, request.group, node=node)
    if job.state is State.TRANSITIONING:
        raise _aborted(job)
    if route_.explicit and job.backend and route_.backend != job.backend:
        raise _precondition(
            f"job {job_id} is held by backend {job.backend} on node {node}; restore it with "
            f"that backend (or send no backend_config), not {route_.backend}"
        )
    left = job.backend_state.get(WORKLOAD_LEFT) if job.state is State.IDLE else None
    if left:
        of_group = f" (group {job.group})" if job.group else ""
        raise _precondition(
            f"the workload of job {job_id}{of_group} left node {node} ({left}), taking its "
            "device state with it: nothing is saved to restore. The workload must register "
            "again (tslice.workload.register_workload) before the job can be resident here"
        )
    _check_resident_neighbours(
        job_id, request.group or job.group, others=others, node=node, leaving=leaving
    )
    if request.group and not job.group:  # a record made without a group takes the group
        job = dataclasses.replace(job, group=request.group)
    if job.state is State.RUNNING and not partial:
        return _done(job, request, kind=Kind.RESTORE)
    if job.state is State.FAULTED and recovered is not State.SAVED:
        raise _faulted(job, node=node)
    if job.state is State.IDLE:
        raise _precondition(
            f"job {job_id} is IDLE on node {node}: nothing was saved to restore; grant it instead"
        )
    resume = State.RUNNING if job.state is State.RUNNING else State.SAVED
    return _start(job, request, kind=Kind.RESTORE, resume_state=resume)


def check_prefetch(job: Job, *, backend: str, declared: bool, node: str) -> None:
    """A prefetch needs a SAVED job whose backend brings states in ahead of a grant."""
    if not declared:
        raise _precondition(
            f"backend {backend} on node {node} does not prefetch (it declares no prefetch); "
            f"job {job.job_id} is restored when it is granted"
        )
    if job.state is not State.SAVED:
        raise _precondition(
            f"job {job.job_id} is {job.state.value} on node {node}: only a SAVED job's state "
            "is prefetched; nothing was started"
        )


def check_epoch(*, job_id: str, group: str, epoch: int, last: GrantMark | None, node: str) -> None:
    """Fencing: refuse a grant older than the last one seen for the group on this node.

    ``epoch`` 0 means "unfenced" (clients that send none); one epoch names one job.
    """
    if not group or epoch <= 0 or last is None:
        return
    # The mark ends the message (grant_marks): an orchestrator that lost its state
    # numbers its next grant past it.
    if epoch < last.epoch:
        raise _precondition(
            grant_marks.tagged(
                f"stale grant: epoch {epoch} of group {group} is older than epoch "
                f"{last.epoch} (job {last.job_id}) already seen on node {node}",
                last.epoch,
            )
        )
    if epoch == last.epoch and last.job_id != job_id:
        raise _precondition(
            grant_marks.tagged(
                f"stale grant: epoch {epoch} of group {group} was already used for job "
                f"{last.job_id} on node {node}",
                last.epoch,
            )
        )


def new_mark(*, job_id: str, group: str, epoch: int, last: GrantMark | None) -> GrantMark | None:
    """The mark a grant records, or ``None`` when it is unfenced or already recorded."""
    if group and epoch > 0 and (last is None or epoch > last.epoch):
        return GrantMark(group=group, epoch=epoch, job_id=job_id)
    return None


def plan_grant(
    job: Job | None,
    request: Request,
    *,
    epoch: int,
    last: GrantMark | None,
    footprint_bytes: int,
    others: Iterable[Job],
) -> Start | Unchanged:
    """The orchestrator granted the job the group: IDLE/unknown -> activate -> RUNNING.

    ``epoch`` 0 means "unfenced" (clients that send none); otherwise it must not be
    older than the last grant seen for the group, and one epoch names one job.
    """
    job_id, group, node = request.job_id, request.group, request.node
    check_epoch(job_id=job_id, group=group, epoch=epoch, last=last, node=node)
    if job is not None:
        if job.state is State.TRANSITIONING:
            raise _aborted(job)
        if job.state is State.SAVED:
            raise _precondition(
                f"job {job_id} is SAVED on node {node}; restore it first (Restore), then grant"
            )
        if job.state is State.FAULTED:
            raise _faulted(job, node=node)
    _check_resident_neighbours(
        job_id, group or (job.group if job else ""), others=others, node=node
    )
    if job is not None and job.state is State.RUNNING:
        return Unchanged(job=dataclasses.replace(job, group=group or job.group))
    if job is None:
        job = Job(job_id=job_id, group=group)
    footprint = footprint_bytes or _sim_footprint(request.route.config) or job.footprint_bytes
    job = dataclasses.replace(
        _with_choice(_arrived(job), request.route),
        group=group or job.group,
        footprint_bytes=footprint,
    )
    return _start(job, request, kind=Kind.ACTIVATE, resume_state=State.IDLE)


def after_channel_registration(
    job: Job | None, *, job_id: str, group: str, suspended: bool | None = None
) -> Job:
    """A workload registered over the channel with its model on the device.

    It is resident (RUNNING) from registration until it is told to offload. A workload
    that reports what it holds (``suspended`` not ``None``: a reconnect after a
    snapshot) is taken at its word; one that does not (llm-d's) keeps the state a
    known record has, since only the commands sent to it changed that. The channel is
    the job's backend for the group unless one was chosen explicitly. A record that is
    TRANSITIONING or FAULTED keeps its state: the running operation, or ResetJob,
    settles it. A record whose workload had left forgets it.
    """
    if job is not None and job.state is not State.TRANSITIONING:
        job = _arrived(job)
    if job is None:
        state = State.SAVED if suspended else State.RUNNING
        return Job(
            job_id=job_id, group=group, state=state, backend="app-channel", choice="app-channel"
        )
    settled = job.state in (State.IDLE, State.RUNNING, State.SAVED)
    if settled and job.backend in ("", "app-channel"):
        if suspended is not None:
            job = dataclasses.replace(
                job, state=State.SAVED if suspended else State.RUNNING, backend="app-channel"
            )
        elif job.state is State.IDLE:
            job = dataclasses.replace(job, state=State.RUNNING, backend="app-channel")
    if job.choice:
        return job
    return dataclasses.replace(job, choice="app-channel", config=b"", group=job.group or group)


def after_workload_left(job: Job, *, reason: str) -> Job:
    """The job's workload left the node (its channel ended cleanly, or was lost and not
    registered again in time): its device state went with it (a process's device memory
    is freed when it exits; what it offloaded lived in its own host memory).

    A record of the workload channel (backend ``app-channel``, or none yet) that is
    IDLE, RUNNING, SAVED or FAULTED becomes IDLE, nothing resident or saved, with
    :data:`WORKLOAD_LEFT` saying why. A TRANSITIONING one is unchanged (its operation
    settles first); a record of another backend is not the workload's.
    """
    channel = ("", "app-channel")
    if job.state is State.TRANSITIONING or job.backend not in channel or job.choice not in channel:
        return job
    return _gone(job, reason=reason)


def _gone(job: Job, *, reason: str) -> Job:
    """IDLE, nothing resident or saved, and why (:data:`WORKLOAD_LEFT`)."""
    return dataclasses.replace(
        job,
        state=State.IDLE,
        device_bytes=0,
        host_bytes=0,
        backend_state={WORKLOAD_LEFT: reason},
        error="",
        previous_state=None,
    )


def check_reset(job: Job | None, *, job_id: str, node: str, group: str = "") -> Job:
    if job is None:
        raise unknown_job(job_id, group, node=node)
    if job.state is not State.FAULTED:
        raise refusals.Refused(
            refusals.Code.FAILED_PRECONDITION,
            f"job {job_id} is {job.state.value} on node {node}, not FAULTED; nothing to reset",
        )
    return job


def after_reset(job: Job, *, recovered: State | None) -> Job:
    """A FAULTED job takes the state its backend reports, else IDLE."""
    state = recovered if recovered in (State.IDLE, State.RUNNING, State.SAVED) else State.IDLE
    assert state is not None
    device_bytes = job.device_bytes if state is State.RUNNING else 0
    host_bytes = job.host_bytes if state is State.SAVED else 0
    return dataclasses.replace(
        job,
        state=state,
        error="",
        previous_state=None,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
    )


def finish(
    job: Job, operation: Operation, *, outcome: Outcome, now: float
) -> tuple[Job, Operation]:
    """Apply a backend outcome to a TRANSITIONING job and its PENDING operation."""
    if outcome.result is not None:
        result = outcome.result
        left = result.state.get(WORKLOAD_LEFT) if operation.kind is Kind.SNAPSHOT else None
        if left:
            # The workload left with its state: nothing resident, nothing saved.
            job = _gone(job, reason=str(left))
            done = dataclasses.replace(
                operation, status=OpStatus.COMPLETE, finished_at=now, storage_bytes=0
            )
            return job, dataclasses.replace(done, device_bytes=0)
        if operation.kind is Kind.SNAPSHOT and result.still_resident:
            # Selected tags left (e.g. only the KV cache); the rest still occupies the device.
            state, device_bytes = State.RUNNING, job.device_bytes
        elif operation.kind is Kind.SNAPSHOT:
            state, device_bytes = State.SAVED, 0
        else:
            state, device_bytes = State.RUNNING, result.device_bytes
        job = dataclasses.replace(
            job,
            state=state,
            device_bytes=device_bytes,
            host_bytes=result.host_bytes,
            backend_state={**job.backend_state, **result.state},
            error="",
            previous_state=None,
        )
        operation = dataclasses.replace(
            operation,
            status=OpStatus.COMPLETE,
            finished_at=now,
            storage_bytes=result.host_bytes,
            device_bytes=result.device_bytes,
        )
        return job, operation
    error = outcome.error or "operation failed"
    if outcome.state_changed or job.previous_state is None:
        job = dataclasses.replace(job, state=State.FAULTED, error=error, previous_state=None)
    else:
        job = dataclasses.replace(job, state=job.previous_state, previous_state=None)
    operation = dataclasses.replace(operation, status=OpStatus.FAILED, finished_at=now, error=error)
    return job, operation


def after_restart(
    job: Job,
    operation: Operation | None,
    *,
    recovered: State | None,
    now: float,
    backend_enabled: bool = True,
) -> tuple[Job, Operation | None]:
    """A job left TRANSITIONING by a dead agent takes the state its backend reports.

    If the backend cannot tell (or is not enabled any more), the job is FAULTED; its
    in-flight operation FAILS either way.
    """
    message = f"agent restarted during operation {job.operation_id or '(none)'}"
    if recovered in (State.IDLE, State.RUNNING, State.SAVED):
        assert recovered is not None
        job = after_reset(job, recovered=recovered)
        message += f"; the backend reports job {job.job_id} {recovered.value}"
    else:
        error = f"{message}; reset it"
        if not backend_enabled:
            error += f" (backend {job.backend} is not enabled on this node)"
        job = dataclasses.replace(job, state=State.FAULTED, error=error, previous_state=None)
    if operation is not None and not operation.finished:
        operation = interrupted(operation, now=now, error=message)
    return job, operation


def interrupted(operation: Operation, *, now: float, error: str = "") -> Operation:
    """An operation a dead agent left PENDING has FAILED."""
    return dataclasses.replace(
        operation,
        status=OpStatus.FAILED,
        finished_at=now,
        error=error or f"agent restarted during operation {operation.op_id}",
    )
