"""Small pure pieces: recovery decisions, backoff."""

from __future__ import annotations

from tests.orchestrator.recovery_views import F, R, S, T, decide, view
from tslice.orchestrator.group import recovery
from tslice.orchestrator.switch import plan as steps
from tslice.orchestrator.switch import step as switch


def test_intent_rolled_back_only_when_nothing_moved() -> None:
    d = decide("a", [view(a=R), view(a=R, b=S)], ("a", "b"))
    assert (d.rollback, d.resident, d.verified) == (True, "a", True)
    assert not decide("a", [view(a=S), view(a=R)], ("a", "b")).rollback  # node 0 moved
    assert not decide("a", [view(a=T), view(a=R)], ("a", "b")).rollback  # op in flight
    assert not decide("a", [view(a=R), view(b=R)], ("a", "b")).rollback
    assert decide(None, [view(), view(b=S)], (None, "b")).rollback  # from an idle group
    assert not decide(None, [view(b=R), view()], (None, "b")).rollback


def test_resident_verified_adopted_or_left_unverified() -> None:
    assert decide("a", [view(a=R), view(a=R)]) == recovery.RecoveryDecision(
        "a", True, False, "resident verified"
    )
    adopted = decide(None, [view(c=R, a=S), view(c=R)])
    assert (adopted.resident, adopted.verified) == ("c", True)
    nothing = decide("a", [view(a=S), view(a=S)])
    assert (nothing.resident, nothing.verified) == (None, True)
    disagree = decide("a", [view(a=R), view(c=R)])
    assert (disagree.resident, disagree.verified) == ("a", False)
    faulted = decide("a", [view(a=R), view(a=F)])
    assert not faulted.verified


def test_jobs_of_other_groups_are_ignored() -> None:
    other = {"z": steps.JobView(R, "other-group")}
    assert decide("a", [{**view(a=R), **other}]).verified


def test_backoff_grows_and_is_capped() -> None:
    b = switch.Backoff(0.05, 1.0)
    assert 0.025 <= b.delay(0) <= 0.05
    assert 0.2 <= b.delay(3) <= 0.4
    assert 0.5 <= b.delay(20) <= 1.0
