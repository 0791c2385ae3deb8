"""How a Grant brings a job in on this node, decided one move at a time (pure, no I/O).

A Grant is one node step of a switch. Its rules, in order:

1. **evict**: the jobs of the group it names in ``evict`` whose state is resident here
   are snapshotted (an operation already running on one is waited for); where the
   backend overlaps moves (``Backend.overlaps_moves``) and the granted job is SAVED
   with ``restore`` set, its restore starts together with them (:attr:`Evict.bring_in`:
   the restore lands only in memory the snapshots have freed, so the switch costs
   about the longer copy, not both);
2. **make room**: while the granted job would not fit on the devices, the residents it
   lists in ``give_way`` (other groups' deferred residents) are snapshotted, first
   listed first; the backend is asked whether the job fits only then;
3. **bring in**: the job is restored (SAVED and ``restore`` set) or activated (nothing
   resident), and the grant mark is recorded with that move;
4. **done** once the job is resident and the grant recorded.

The runner (``tslice.agent.moves.runner.AgentCore.grant``) loops: :func:`next_move` says
what to do from the records as they stand (a :data:`Move`, as data), the runner starts
it and waits for its operations (at most the Grant's ``wait_ms``), and
:func:`after_round` says whether the Grant is done, comes back unfinished, or goes on
(a :class:`Verdict`). Each move is an ordinary, pollable operation, so a Grant re-issued
after a timeout continues from where the node stands. On the hand-over path this module
comes between the gRPC face (``tslice.agent.server``) and the runner.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence

from tslice.agent.jobs import model
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.rpc import refusals

#: Moves one Grant may make (evict, bring in) before it reports that states keep changing;
#: each listed ``give_way`` resident adds one.
MAX_STEPS = 8

#: States in which a record holds the job's state on the devices (or may: FAULTED).
_HOLDING = (model.State.RUNNING, model.State.TRANSITIONING, model.State.FAULTED)


@dataclasses.dataclass(frozen=True)
class Order:
    """One Grant as this node received it, its ids checked and its records resolved."""

    job_id: str
    group: str
    epoch: int
    footprint_bytes: int
    config: pb.BackendConfig | None
    #: Records of the group's other jobs to snapshot first (duplicates and the job removed).
    evict: tuple[model.Key, ...] = ()
    #: Other groups' residents that give way while the job would not fit, in order.
    give_way: tuple[model.Key, ...] = ()
    restore: bool = False

    @property
    def max_steps(self) -> int:
        return MAX_STEPS + len(self.give_way)

    def concerns(self, op: model.Operation) -> bool:
        """Whether ``op`` moves the granted job's state for the group."""
        return op.job_id == self.job_id and op.group == self.group


def order(
    *,
    job_id: str,
    group: str,
    epoch: int,
    footprint_bytes: int,
    config: pb.BackendConfig | None,
    evict: Iterable[model.Key] = (),
    give_way: Iterable[model.Key] = (),
    restore: bool = False,
) -> Order:
    """The :class:`Order` of a Grant; ``evict`` are the records of the named jobs (the
    job's own and duplicates dropped), ``give_way`` other groups' residents."""
    evictees = []
    for key in dict.fromkeys(evict):
        if key[0] != job_id:
            evictees.append(key)
    residents = []
    for key in dict.fromkeys(give_way):
        if key[1] != group:
            residents.append(key)
    return Order(
        job_id=job_id,
        group=group,
        epoch=epoch,
        footprint_bytes=footprint_bytes,
        config=config,
        evict=tuple(evictees),
        give_way=tuple(residents),
        restore=restore,
    )


@dataclasses.dataclass(frozen=True)
class Evict:
    """Snapshot these records' states (or wait for the operation running on one)."""

    keys: tuple[model.Key, ...]
    #: They are other groups' residents making room, not the group's evictees.
    giving_way: bool = False
    #: Bring the granted job in at the same time (overlapping moves).
    bring_in: bool = False


@dataclasses.dataclass(frozen=True)
class AskFit:
    """Ask the backend whether the job fits beside what is resident, then plan again."""


@dataclasses.dataclass(frozen=True)
class BringIn:
    """Record the grant and restore or activate the job (nothing to move if it is resident)."""


Move = Evict | AskFit | BringIn


class Verdict(enum.Enum):
    """What a round of moves, once waited for, means for the Grant."""

    #: An operation FAILED: the Grant reports it.
    FAILED = "failed"
    #: The wait ran out: the Grant reports its operations as they stand.
    UNFINISHED = "unfinished"
    #: The job is resident and the grant recorded.
    GRANTED = "granted"
    #: Plan the next move.
    GO_ON = "go on"


@dataclasses.dataclass(frozen=True)
class GrantOutcome:
    """What one Grant did on this node."""

    #: State of the granted job at the reply.
    state: model.State
    #: The grant is recorded and the job is resident.
    granted: bool
    #: Operations the Grant started or found running, as of the reply, in order.
    operations: tuple[model.Operation, ...] = ()
    #: A restore of the granted job finished during this Grant.
    restored: bool = False


def as_asked(grant: Order, job: model.Job | None) -> model.Job:
    """The granted job's record as the backend is asked about it (validate, fits): with
    the footprint the Grant declares, if it declares one."""
    probe = job if job is not None else model.Job(job_id=grant.job_id, group=grant.group)
    if not grant.footprint_bytes or grant.footprint_bytes == probe.footprint_bytes:
        return probe
    return dataclasses.replace(probe, footprint_bytes=grant.footprint_bytes)


def _holds_state(job: model.Job | None) -> bool:
    return job is not None and job.state in _HOLDING


def next_move(
    grant: Order,
    records: Mapping[model.Key, model.Job],
    *,
    target: model.Key,
    fits: bool | None = None,
    overlap: bool = False,
) -> Move:
    """The next move of ``grant`` given the node's ``records``; ``target`` is the job's.

    ``fits`` is the backend's answer to :class:`AskFit` (``None``: not asked yet);
    ``overlap``: the backend that holds the job's state overlaps moves.
    """
    job = records.get(target)
    evictees = []
    for key in grant.evict:
        if _holds_state(records.get(key)):
            evictees.append(key)
    if evictees:
        bring_in = overlap and _overlappable(grant, records, job, evictees)
        return Evict(tuple(evictees), bring_in=bring_in)
    if job is None or job.state is not model.State.RUNNING:
        residents = []
        for key in grant.give_way:
            if _holds_state(records.get(key)):
                residents.append(key)
        if residents and fits is None:
            return AskFit()
        if residents and not fits:
            return Evict((residents[0],), giving_way=True)
    return BringIn()


def _overlappable(
    grant: Order,
    records: Mapping[model.Key, model.Job],
    job: model.Job | None,
    evictees: Sequence[model.Key],
) -> bool:
    """The granted job's restore may run beside the evictions: it is SAVED (or its
    restore already runs) and no other group's resident has to give way first."""
    if job is None or not grant.restore:
        return False
    if any(records[k].state is model.State.FAULTED for k in evictees):
        return False
    if any(_holds_state(records.get(k)) for k in grant.give_way):
        return False
    return job.state in (model.State.SAVED, model.State.TRANSITIONING)


def granted_here(grant: Order, job: model.Job | None, mark: model.GrantMark | None) -> bool:
    """The job is resident and this node has recorded the grant (or it is unfenced)."""
    if job is None or job.state is not model.State.RUNNING:
        return False
    unfenced = not grant.group or grant.epoch <= 0
    return unfenced or (mark is not None and mark.epoch >= grant.epoch)


def after_round(
    grant: Order,
    settled: Sequence[model.Operation],
    *,
    job: model.Job | None,
    mark: model.GrantMark | None,
) -> Verdict:
    """What the round's ``settled`` operations mean; ``job`` is the granted job's record."""
    unfinished = brought_in = False
    for op in settled:
        if op.status is model.OpStatus.FAILED:
            return Verdict.FAILED
        if op.status is model.OpStatus.PENDING:
            unfinished = True
        elif op.kind is not model.Kind.SNAPSHOT and grant.concerns(op):
            brought_in = True  # its grant mark was stored when it started
    if unfinished:
        return Verdict.UNFINISHED
    if brought_in and granted_here(grant, job, mark):
        return Verdict.GRANTED
    return Verdict.GO_ON


def outcome(
    grant: Order,
    seen: Iterable[model.Operation],
    *,
    job: model.Job | None,
    granted: bool,
) -> GrantOutcome:
    """The Grant's reply: the job's state and every operation it started or waited on."""
    operations = tuple(seen)
    restored = False
    for op in operations:
        if op.kind is model.Kind.RESTORE and op.status is model.OpStatus.COMPLETE:
            restored = restored or grant.concerns(op)
    return GrantOutcome(
        state=job.state if job is not None else model.State.IDLE,
        granted=granted,
        operations=operations,
        restored=restored,
    )


def kept_changing(grant: Order, *, node: str) -> refusals.Refused:
    return refusals.Refused(
        refusals.Code.ABORTED,
        f"job states on node {node} kept changing during the grant of job {grant.job_id}; "
        "read Status and retry",
    )
