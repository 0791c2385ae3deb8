"""The moves of a Grant (tslice.agent.moves.grant_plan), planned from records, without I/O."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from tests.agent.grant_records import TARGET, K, S, order, rec, records
from tslice.agent.jobs import model
from tslice.agent.moves import grant_plan


def op(job_id: str, kind: K, status: model.OpStatus, group: str = "g") -> model.Operation:
    return model.Operation(
        op_id=f"{job_id}-{kind.value}",
        job_id=job_id,
        group=group,
        kind=kind,
        backend="sim",
        status=status,
        started_at=1.0,
    )


def done(job_id: str, kind: K, group: str = "g") -> model.Operation:
    return op(job_id, kind, model.OpStatus.COMPLETE, group)


def mark(epoch: int) -> model.GrantMark:
    return model.GrantMark(group="g", epoch=epoch, job_id="j1")


def plan(
    grant: grant_plan.Order, found: Iterable[model.Job], fits: bool | None = None
) -> grant_plan.Move:
    return grant_plan.next_move(grant, records(*found), target=TARGET, fits=fits)


# ---- the order ---------------------------------------------------------------------------


def test_an_order_evicts_each_other_job_once_and_gives_way_only_across_groups() -> None:
    grant = order(
        evict=[("j2", "g"), ("j1", "g"), ("j2", "g"), ("j3", "g")],
        give_way=[("j4", "h"), ("j5", "g"), ("j4", "h")],
    )
    assert grant.evict == (("j2", "g"), ("j3", "g"))
    assert grant.give_way == (("j4", "h"),)
    assert grant.max_steps == grant_plan.MAX_STEPS + 1


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
    assert move == grant_plan.Evict((("j2", "g"), ("j4", "g"), ("j5", "g")))


def test_with_nothing_to_evict_the_job_is_brought_in() -> None:
    grant = order(evict=[("j2", "g"), ("j3", "g")])
    assert plan(grant, [rec("j2", S.SAVED), rec("j1", S.SAVED)]) == grant_plan.BringIn()


def test_other_groups_residents_give_way_only_if_the_job_does_not_fit() -> None:
    grant = order(give_way=[("j2", "h"), ("j3", "h"), ("j4", "k")])
    found = [
        rec("j2", S.SAVED, group="h"),
        rec("j3", S.RUNNING, group="h"),
        rec("j4", S.RUNNING, group="k"),
    ]
    # The backend is asked only when someone could give way...
    assert plan(grant, found) == grant_plan.AskFit()
    assert plan(grant, []) == grant_plan.BringIn()
    # ...and its answer decides: the first resident listed makes room, one at a time.
    assert plan(grant, found, fits=False) == grant_plan.Evict((("j3", "h"),), giving_way=True)
    assert plan(grant, found, fits=True) == grant_plan.BringIn()


def test_a_resident_job_needs_no_room_and_the_group_is_evicted_before_room_is_made() -> None:
    grant = order(evict=[("j2", "g")], give_way=[("j3", "h")])
    other = rec("j3", S.RUNNING, group="h")
    assert plan(grant, [rec("j1", S.RUNNING), other]) == grant_plan.BringIn()
    move = plan(grant, [rec("j2", S.RUNNING), other], fits=False)
    assert move == grant_plan.Evict((("j2", "g"),))


def test_the_record_asked_about_carries_the_grants_footprint() -> None:
    assert grant_plan.as_asked(order(footprint_bytes=7), None).footprint_bytes == 7
    known = rec("j1", S.IDLE, footprint_bytes=5)
    assert grant_plan.as_asked(order(), known) == known
    assert grant_plan.as_asked(order(footprint_bytes=9), known).footprint_bytes == 9


# ---- after a round -----------------------------------------------------------------------


def test_a_round_with_a_failure_or_an_unfinished_move_ends_the_grant() -> None:
    failed = op("j2", K.SNAPSHOT, model.OpStatus.FAILED)
    pending = op("j1", K.RESTORE, model.OpStatus.PENDING)
    running = rec("j1", S.RUNNING)
    verdict = grant_plan.after_round(order(), [pending, failed], job=running, mark=mark(3))
    assert verdict is grant_plan.Verdict.FAILED
    verdict = grant_plan.after_round(order(), [pending], job=running, mark=mark(3))
    assert verdict is grant_plan.Verdict.UNFINISHED


@pytest.mark.parametrize("kind", [K.RESTORE, K.ACTIVATE])
def test_the_grant_is_done_once_the_job_came_in_and_the_mark_is_recorded(kind: K) -> None:
    running = rec("j1", S.RUNNING)
    brought = [done("j1", kind)]
    assert (
        grant_plan.after_round(order(), brought, job=running, mark=mark(3))
        is grant_plan.Verdict.GRANTED
    )
    # An older mark (another grant since), or no job resident: not yet.
    assert (
        grant_plan.after_round(order(), brought, job=running, mark=mark(2))
        is grant_plan.Verdict.GO_ON
    )
    idle = rec("j1", S.IDLE)
    assert (
        grant_plan.after_round(order(), brought, job=idle, mark=mark(3)) is grant_plan.Verdict.GO_ON
    )
    # Unfenced grants (epoch 0) need no mark.
    unfenced = order(epoch=0)
    assert (
        grant_plan.after_round(unfenced, brought, job=running, mark=None)
        is grant_plan.Verdict.GRANTED
    )


def test_evictions_and_moves_of_other_groups_do_not_finish_the_grant() -> None:
    running = rec("j1", S.RUNNING)
    for moves in ([done("j2", K.SNAPSHOT)], [done("j1", K.SNAPSHOT)], [done("j1", K.RESTORE, "h")]):
        verdict = grant_plan.after_round(order(), moves, job=running, mark=mark(3))
        assert verdict is grant_plan.Verdict.GO_ON, moves
    assert (
        grant_plan.after_round(order(), [], job=running, mark=mark(3)) is grant_plan.Verdict.GO_ON
    )


def test_the_outcome_says_restored_only_for_a_finished_restore_of_the_job() -> None:
    seen = [done("j2", K.SNAPSHOT), done("j1", K.RESTORE)]
    outcome = grant_plan.outcome(order(), seen, job=rec("j1", S.RUNNING), granted=True)
    assert outcome == grant_plan.GrantOutcome(
        state=S.RUNNING, granted=True, operations=tuple(seen), restored=True
    )
    pending = [op("j1", K.RESTORE, model.OpStatus.PENDING)]
    outcome = grant_plan.outcome(order(), pending, job=None, granted=False)
    assert (outcome.state, outcome.restored) == (S.IDLE, False)
    activated = grant_plan.outcome(order(), [done("j1", K.ACTIVATE)], job=None, granted=True)
    assert not activated.restored
