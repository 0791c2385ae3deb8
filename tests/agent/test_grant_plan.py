"""The moves of a Grant (tslice.agent.grants), planned from records, without I/O."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from tslice.agent import grants, job_model

S = job_model.State
K = job_model.Kind
TARGET: job_model.Key = ("j1", "g")


def rec(job_id: str, state: S, group: str = "g", **kw: object) -> job_model.Job:
    return job_model.Job(job_id=job_id, group=group, state=state, **kw)  # type: ignore[arg-type]


def records(*found: job_model.Job) -> dict[job_model.Key, job_model.Job]:
    return {j.key: j for j in found}


def order(**kw: object) -> grants.Order:
    args: dict[str, object] = {
        "job_id": "j1",
        "group": "g",
        "epoch": 3,
        "footprint_bytes": 0,
        "config": None,
    }
    args.update(kw)
    return grants.order(**args)  # type: ignore[arg-type]


def op(job_id: str, kind: K, status: job_model.OpStatus, group: str = "g") -> job_model.Operation:
    return job_model.Operation(
        op_id=f"{job_id}-{kind.value}",
        job_id=job_id,
        group=group,
        kind=kind,
        backend="sim",
        status=status,
        started_at=1.0,
    )


def done(job_id: str, kind: K, group: str = "g") -> job_model.Operation:
    return op(job_id, kind, job_model.OpStatus.COMPLETE, group)


def mark(epoch: int) -> job_model.GrantMark:
    return job_model.GrantMark(group="g", epoch=epoch, job_id="j1")


def plan(
    grant: grants.Order, found: Iterable[job_model.Job], fits: bool | None = None
) -> grants.Move:
    return grants.next_move(grant, records(*found), target=TARGET, fits=fits)


# ---- the order ---------------------------------------------------------------------------


def test_an_order_evicts_each_other_job_once_and_gives_way_only_across_groups() -> None:
    grant = order(
        evict=[("j2", "g"), ("j1", "g"), ("j2", "g"), ("j3", "g")],
        give_way=[("j4", "h"), ("j5", "g"), ("j4", "h")],
    )
    assert grant.evict == (("j2", "g"), ("j3", "g"))
    assert grant.give_way == (("j4", "h"),)
    assert grant.max_steps == grants.MAX_STEPS + 1


# ---- next move ---------------------------------------------------------------------------


def test_residents_of_the_group_are_evicted_first_all_at_once() -> None:
    grant = order(evict=[("j2", "g"), ("j3", "g"), ("j4", "g"), ("j5", "g")])
    found = [
        rec("j2", S.RUNNING),
        rec("j3", S.SAVED),
        rec("j4", S.FAULTED),  # may still hold its state: the snapshot rule decides
        rec("j5", S.TRANSITIONING),  # waited for
        rec("j6", S.RUNNING, group="h"),
    ]
    move = plan(grant, found)
    assert move == grants.Evict((("j2", "g"), ("j4", "g"), ("j5", "g")))


def test_with_nothing_to_evict_the_job_is_brought_in() -> None:
    grant = order(evict=[("j2", "g"), ("j3", "g")])
    assert plan(grant, [rec("j2", S.SAVED), rec("j1", S.SAVED)]) == grants.BringIn()


def test_other_groups_residents_give_way_only_if_the_job_does_not_fit() -> None:
    grant = order(give_way=[("j2", "h"), ("j3", "h"), ("j4", "k")])
    found = [
        rec("j2", S.SAVED, group="h"),
        rec("j3", S.RUNNING, group="h"),
        rec("j4", S.RUNNING, group="k"),
    ]
    # The backend is asked only when someone could give way...
    assert plan(grant, found) == grants.AskFit()
    assert plan(grant, []) == grants.BringIn()
    # ...and its answer decides: the first resident listed makes room, one at a time.
    assert plan(grant, found, fits=False) == grants.Evict((("j3", "h"),), giving_way=True)
    assert plan(grant, found, fits=True) == grants.BringIn()


def test_a_resident_job_needs_no_room_and_the_group_is_evicted_before_room_is_made() -> None:
    grant = order(evict=[("j2", "g")], give_way=[("j3", "h")])
    other = rec("j3", S.RUNNING, group="h")
    assert plan(grant, [rec("j1", S.RUNNING), other]) == grants.BringIn()
    move = plan(grant, [rec("j2", S.RUNNING), other], fits=False)
    assert move == grants.Evict((("j2", "g"),))


def test_the_record_asked_about_carries_the_grants_footprint() -> None:
    assert grants.as_asked(order(footprint_bytes=7), None).footprint_bytes == 7
    known = rec("j1", S.IDLE, footprint_bytes=5)
    assert grants.as_asked(order(), known) == known
    assert grants.as_asked(order(footprint_bytes=9), known).footprint_bytes == 9


# ---- after a round -----------------------------------------------------------------------


def test_a_round_with_a_failure_or_an_unfinished_move_ends_the_grant() -> None:
    failed = op("j2", K.SNAPSHOT, job_model.OpStatus.FAILED)
    pending = op("j1", K.RESTORE, job_model.OpStatus.PENDING)
    running = rec("j1", S.RUNNING)
    verdict = grants.after_round(order(), [pending, failed], job=running, mark=mark(3))
    assert verdict is grants.Verdict.FAILED
    verdict = grants.after_round(order(), [pending], job=running, mark=mark(3))
    assert verdict is grants.Verdict.UNFINISHED


@pytest.mark.parametrize("kind", [K.RESTORE, K.ACTIVATE])
def test_the_grant_is_done_once_the_job_came_in_and_the_mark_is_recorded(kind: K) -> None:
    running = rec("j1", S.RUNNING)
    brought = [done("j1", kind)]
    assert grants.after_round(order(), brought, job=running, mark=mark(3)) is grants.Verdict.GRANTED
    # An older mark (another grant since), or no job resident: not yet.
    assert grants.after_round(order(), brought, job=running, mark=mark(2)) is grants.Verdict.GO_ON
    idle = rec("j1", S.IDLE)
    assert grants.after_round(order(), brought, job=idle, mark=mark(3)) is grants.Verdict.GO_ON
    # Unfenced grants (epoch 0) need no mark.
    unfenced = order(epoch=0)
    assert grants.after_round(unfenced, brought, job=running, mark=None) is grants.Verdict.GRANTED


def test_evictions_and_moves_of_other_groups_do_not_finish_the_grant() -> None:
    running = rec("j1", S.RUNNING)
    for moves in ([done("j2", K.SNAPSHOT)], [done("j1", K.SNAPSHOT)], [done("j1", K.RESTORE, "h")]):
        verdict = grants.after_round(order(), moves, job=running, mark=mark(3))
        assert verdict is grants.Verdict.GO_ON, moves
    assert grants.after_round(order(), [], job=running, mark=mark(3)) is grants.Verdict.GO_ON


def test_the_outcome_says_restored_only_for_a_finished_restore_of_the_job() -> None:
    seen = [done("j2", K.SNAPSHOT), done("j1", K.RESTORE)]
    outcome = grants.outcome(order(), seen, job=rec("j1", S.RUNNING), granted=True)
    assert outcome == grants.GrantOutcome(
        state=S.RUNNING, granted=True, operations=tuple(seen), restored=True
    )
    pending = [op("j1", K.RESTORE, job_model.OpStatus.PENDING)]
    outcome = grants.outcome(order(), pending, job=None, granted=False)
    assert (outcome.state, outcome.restored) == (S.IDLE, False)
    activated = grants.outcome(order(), [done("j1", K.ACTIVATE)], job=None, granted=True)
    assert not activated.restored
