"""One leader per term, whatever an operator does to the Lease (issue 22 §1).

A sitting leader whose Lease renewals hang (the emulator stalls its Lease requests: an
API server slow for that replica alone) leads on until its renew deadline. Meanwhile an
operator deletes the Lease, or replaces it by hand with a fresh one: the follower takes
it at once. The new leader's term must be above every term taken before (the old
leader's included), so that its claim of the state ConfigMaps and its first reads of the
agents fence the old leader out: the old leader's next state write or directive deposes
it, and nothing it does moves device state any more. The device journals are checked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

pytest.importorskip("lightkube")

from tests.kube.emulator import ApiServerEmulator
from tests.kube.ha_stack import LEASE, NAMESPACE, HaStack
from tests.kube.stack import WAIT_S, events_of, next_event
from tslice.client import AsyncClient, EventKind
from tslice.sim import checker


def _delete(api: ApiServerEmulator) -> None:
    api.store.delete("leases", NAMESPACE, LEASE)


def _replace_by_hand(api: ApiServerEmulator) -> None:
    """``kubectl replace --force`` of a Lease manifest kept in git: no holder, no count."""
    api.store.delete("leases", NAMESPACE, LEASE)
    fresh = {"kind": "Lease", "metadata": {"name": LEASE, "namespace": NAMESPACE}, "spec": {}}
    api.store.create("leases", NAMESPACE, fresh)


async def _old_leader_acts_after_a_new_one_took_over(
    api: ApiServerEmulator, stack: HaStack, take_away: Callable[[ApiServerEmulator], None]
) -> list[checker.Violation]:
    # A Lease of 30 s: the old leader's renew deadline (20 s) outlasts the test's steps.
    old, new = stack.start_trainers(["job-a", "job-b"], ["gpu-a"], lease_duration_s=30)
    stack.replicas[new].wait_for(rf"leader election: {old} leads \(term 1\)")
    both = [stack.addresses[old], stack.addresses[new]]
    windows = [checker.Window(job=j, group="trainer", requested=0.0) for j in ("job-a", "job-b")]
    first_a, win_b = windows
    async with (
        AsyncClient(both, job_id="job-a", lease_s=None) as a,
        AsyncClient(both, job_id="job-b", lease_s=None) as b,
    ):
        async with events_of(b, "trainer") as events:
            first_a.requested = time.time()
            await a.acquire("trainer", timeout=WAIT_S)
            first_a.acquired = win_b.requested = time.time()
            waiting_b = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
            await next_event(events, EventKind.QUEUED, "job-b")
        # The old leader's renewals hang; the operator takes the Lease away; the follower
        # takes the Lease and leads.
        api.stall(old, "leases")
        take_away(api)
        await asyncio.to_thread(stack.holder, other_than=old)
        # Above every term taken before, though the Lease's own count started again.
        await asyncio.to_thread(stack.leads, new, 2)
        # job-a yields at the old leader, which still believes it leads.
        first_a.yielded = time.time()
        await a.yield_("trainer")
        assert (await asyncio.wait_for(waiting_b, WAIT_S)).success
        win_b.acquired = time.time()
        # job-a comes back, at the new leader.
        again = checker.Window(job="job-a", group="trainer", requested=time.time())
        windows.append(again)
        async with (
            AsyncClient(stack.addresses[new], job_id="job-a", lease_s=None) as a2,
            events_of(a2, "trainer") as events,
        ):
            acquiring = asyncio.create_task(a2.acquire("trainer", timeout=WAIT_S))
            acquiring.add_done_callback(lambda _: setattr(again, "acquired", time.time()))
            queued = asyncio.create_task(next_event(events, EventKind.QUEUED, "job-a"))
            await asyncio.wait({acquiring, queued}, return_when=asyncio.FIRST_COMPLETED)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            win_b.yielded = time.time()
            await b.yield_("trainer")
            assert (await asyncio.wait_for(acquiring, WAIT_S)).success
            again.yielded = time.time()
            await a2.yield_("trainer")
    # The old leader stepped down on the new term's writes, without acting again.
    await asyncio.to_thread(stack.replicas[old].wait_for, r"stepping down as leader \(term 1\)")
    api.unstall()
    return checker.check(
        journal=stack.journal(), windows=windows, group_nodes={"trainer": ["gpu-a"]}
    )


async def test_a_lease_deleted_while_a_leader_leads_starts_a_new_term(
    api: ApiServerEmulator, stack: HaStack
) -> None:
    violations = await _old_leader_acts_after_a_new_one_took_over(api, stack, _delete)
    assert violations == []


async def test_a_lease_replaced_by_hand_starts_a_new_term(
    api: ApiServerEmulator, stack: HaStack
) -> None:
    violations = await _old_leader_acts_after_a_new_one_took_over(api, stack, _replace_by_hand)
    assert violations == []
