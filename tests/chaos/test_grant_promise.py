"""Issue 21 §1, short form: a success answer is taken back only by the job's own yield or
an eviction (leaseless jobs), under single Acquires and AcquireSets from several processes
of each job, deadlines, cancels, evictions, drains and orchestrator SIGKILLs; the device
journals and the jobs' own records show no violation (``python bench/soak.py --promises``
runs the long form). The seed is in the assertion message:
``python bench/soak.py --promises --seed SEED`` draws the same run again.

The checks themselves are shown to find what they look for, on made-up records.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from tslice.chaos import promises
from tslice.common import errors

SEED = int(os.environ.get("TSLICE_CHAOS_SEED", "1"))


@pytest.mark.slow
async def test_a_short_run_takes_back_no_answered_grant() -> None:
    result = await promises.run_promises(promises.PromiseConfig(seed=SEED, duration_s=15.0))
    print(result.summary())
    assert result.ok, result.summary()
    # Not vacuous: sets and single groups were granted, some sets failed, a kill hit,
    # evictions ended grants, calls were cancelled.
    counts = result.counts
    assert counts.get("acquire granted", 0) >= 10 and counts.get("acquire_set granted", 0) >= 5
    assert result.kills >= 1 and result.ended_by.get("eviction", 0) >= 1, result.summary()
    failed_sets = sum(
        n for k, n in counts.items() if k.startswith("acquire_set ") and "granted" not in k
    )
    assert failed_sets >= 1, result.summary()


def _refused(message: str) -> errors.RPCError:
    return errors.NotHolder(grpc.StatusCode.PERMISSION_DENIED, message)


def test_a_yield_refused_while_nothing_ended_the_grant_is_a_violation() -> None:
    book = promises.Book()
    t = time.time()
    book.told("j", {"g": 4}, asked=t - 2)
    book.yield_refused("j", "g", time.time(), _refused("group 'g' is held by job 'l', not 'j'"))
    assert len(book.problems) == 1 and "neither its own yield nor an eviction" in book.problems[0]


def test_a_yield_refused_after_the_job_s_own_yield_or_a_named_eviction_is_fine() -> None:
    book = promises.Book()
    t = time.time()
    book.told("j", {"g": 4}, asked=t - 2)
    book.did("yield", "j", "g", sent=t - 1)  # another process of j let go
    book.yield_refused("j", "g", time.time(), _refused("group 'g' is held by 'l', not 'j'"))
    assert book.problems == []
    book.told("k", {"g": 5}, asked=t - 2)
    book.did("eviction", "k", "", sent=t - 1)  # from every group
    book.yield_refused("k", "g", time.time(), _refused("held by 'l' (job 'k' was evicted)"))
    assert book.problems == []
    book.yield_refused("k", "g", time.time(), _refused("held by 'l', not 'k'"))
    assert len(book.problems) == 1 and "without naming it" in book.problems[0]


def test_a_yield_refused_while_another_process_s_yield_is_in_flight_is_fine() -> None:
    # Two processes of j yield the grant they both hold: the first lets go, the second is
    # refused (another job holds it by then), maybe before the first one's answer is back
    # (seen in a run: counted only once answered, it was taken for a violation).
    book = promises.Book()
    book.told("j", {"g": 4}, asked=time.time() - 2)
    first = book.sending("yield", "j", "g")
    second = book.sending("yield", "j", "g")
    book.yield_refused("j", "g", second.sent, _refused("held by 'l', not 'j'"), own=second)
    assert book.problems == []
    # Its own yield alone excuses nothing.
    book.acts.remove(first)
    book.yield_refused("j", "g", second.sent, _refused("held by 'l', not 'j'"), own=second)
    assert len(book.problems) == 1


def test_windows_end_at_what_may_have_reached_the_grant_and_no_earlier() -> None:
    book = promises.Book()
    t = time.time()
    book.did("yield", "j", "g", sent=t - 10)  # long before: ends nothing later
    book.told("j", {"g": 4}, asked=t - 5)
    book.told("j", {"g": 4}, asked=t - 6)  # a second process, answered the same grant
    book.did("eviction", "j", "h", sent=t - 3)  # another group
    book.did("yield", "j", "g", sent=t - 2)
    (window,) = book.close_windows()
    assert window.requested == pytest.approx(t - 6) and window.yielded == pytest.approx(t - 2)
    assert window.ended_by == "yield"
