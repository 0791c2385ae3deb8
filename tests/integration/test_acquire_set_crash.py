"""AcquireSet across an orchestrator SIGKILL: restart on the same port and state directory.

Nothing about sets is persisted, only each group's queue: the client re-issues its
AcquireSet, which re-attaches to the entries it had and keeps their places. Killed
while a set waits (one group kept for it) and while the set's switches are in flight
(both agents frozen from before the switches start until the orchestrator is dead, so
neither switch can end first however slow the machine is).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.faults.processes import GroupNodes, Stack
from tests.faults.stack import WAIT_S, K, job_states, running
from tests.integration.acquire_set_stack import (
    Recorder,
    Windows,
    connected,
    cut_by_the_kill,
    frozen,
    held_by,
    journal_violations,
    kept_for_a_set,
    no_violations,
    queued,
    queued_set,
    running_stack,
)
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

pytestmark = pytest.mark.slow

WAITING = ("waiting-a", "waiting-b")
SWITCHING = ("switching-a", "switching-b")
GROUPS: dict[str, GroupNodes] = {
    WAITING[0]: {"node-a": [0]},
    WAITING[1]: {"node-b": [0]},
    SWITCHING[0]: {"node-a": [1]},
    SWITCHING[1]: {"node-b": [1]},
}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(GROUPS) as running_:
        yield running_


async def test_a_set_waiting_at_the_kill_is_re_issued_and_keeps_its_place_in_each_queue(
    stack: Stack,
) -> None:
    first, second = WAITING
    windows = Windows()
    async with held_by(stack, {first: "a", second: "b"}, windows=windows) as (o, events):
        w, x = await kept_for_a_set(
            o, events, "w", (first, second), kept=first, holder="a", late="x", windows=windows
        )
        y = await queued(o, events, "y", second)
        stack.orchestrator.kill()
        for call in (w, x, y):
            await cut_by_the_kill(call)
    stack.orchestrator.restart()

    async with connected(stack) as o, Recorder(o.stub) as events:
        # The jobs come back in another order than they queued (y before w on `second`);
        # w comes back before x, whose group is free (a first comer there is granted).
        asked_at = time.time()
        y = await queued(o, events, "y", second)
        asked = o.acquiring_set("w", first, second)
        for group in (first, second):
            back = await events.wait_for(K.KIND_QUEUED, group, "w")
            assert back.detail == "re-attached after restart", back
        x = await queued(o, events, "x", first)
        assert (await o.waiting(first)) == ("", ["w", "x"])  # kept for w again
        assert (await o.waiting(second)) == ("b", ["w", "y"])
        await windows.give(o, "b", second)
        reply = await asked
        windows.granted("w", {g.group_id: g.grant_epoch for g in reply.grants}, asked_at)
        assert [(g.group_id, g.grant_epoch) for g in reply.grants] == [(first, 2), (second, 2)]
        assert not x.done() and not y.done()
        await windows.give(o, "w", first)
        assert (await x).grant_epoch == 3
        windows.granted("x", {first: 3}, asked_at)
        await windows.give(o, "w", second)
        assert (await y).grant_epoch == 3
        windows.granted("y", {second: 3}, asked_at)
        await windows.give(o, "x", first)
        await windows.give(o, "y", second)
        await events.until(2, K.KIND_YIELDED, (first, second), "w")
        await events.wait_for(K.KIND_GRANTED, first, "x")
        await events.wait_for(K.KIND_GRANTED, second, "y")
        order = {
            group: [
                e.job_id for e in events.seen if e.kind == K.KIND_GRANTED and e.group_id == group
            ]
            for group in (first, second)
        }
        assert order == {first: ["w", "x"], second: ["w", "y"]}, order

    violations = journal_violations(stack, windows.seen, {g: GROUPS[g] for g in WAITING})
    assert violations == [], no_violations(violations)


async def test_a_set_whose_switches_are_in_flight_at_the_kill_is_finished_and_granted(
    stack: Stack,
) -> None:
    first, second = SWITCHING
    windows = Windows()
    async with held_by(stack, {first: "a", second: "b"}, windows=windows) as (o, events):
        cut = await queued_set(o, events, "w", first, second)
        with frozen(stack.agents["node-a"], stack.agents["node-b"]):
            await windows.give(o, "a", first)
            await windows.give(o, "b", second)
            await events.wait_for(K.KIND_SWITCH_STARTED, first, "w")
            await events.wait_for(K.KIND_SWITCH_STARTED, second, "w")
            assert events.count(K.KIND_SWITCH_DONE, (first, second)) == 0
            stack.orchestrator.kill()
        await cut_by_the_kill(cut)
    stack.orchestrator.restart()

    async with connected(stack) as o:
        # The re-issued call gets the grants of the switches the new orchestrator finished.
        epochs = await windows.take(o, "w", first, second)
        assert epochs == {first: 2, second: 2}
        for group, agent in ((first, "node-a"), (second, "node-b")):
            states = await job_states(stack.agents[agent].address, group)
            assert running(states) == {"w"}, states
            before = "a" if group == first else "b"
            assert states[before].state == pb.JOB_STATE_SAVED, states
        await windows.give(o, "w", first)
        await windows.give(o, "w", second)

    violations = journal_violations(stack, windows.seen, {g: GROUPS[g] for g in SWITCHING})
    assert violations == [], no_violations(violations)


#: A short re-attach grace, for a job that never comes back.
GONE = ("gone-a", "gone-b")


@pytest.fixture(scope="module")
def short_grace_stack() -> Iterator[Stack]:
    groups: dict[str, GroupNodes] = {GONE[0]: {"node-a": [0]}, GONE[1]: {"node-b": [0]}}
    with running_stack(groups, {"reattach_grace_s": 2.0}) as running_:
        yield running_


async def test_a_leaseless_set_s_part_granted_before_the_kill_is_released_if_its_job_never_returns(
    short_grace_stack: Stack,
) -> None:
    """w's set is granted `resident` at once (w's state is still there) while `switching`
    waits for its switch (node-b frozen); the orchestrator dies and w never returns. w
    was never told it holds anything: after the re-attach grace both groups are free.
    (Before: `switching` was released, `resident` stayed w's for ever, no lease to end it.)"""
    stack = short_grace_stack
    resident, switching = GONE
    async with connected(stack) as o:
        await o.acquire("w", resident)
        await o.yield_("w", resident)  # w stays resident there: its next grant is at once
        await o.acquire("b", switching)
        await o.yield_("b", switching)
        async with Recorder(o.stub) as events:
            with frozen(stack.agents["node-b"]):
                cut = o.acquiring_set("w", resident, switching)
                granted = await events.wait_for(K.KIND_GRANTED, resident, "w")
                assert granted.detail == "zero-cost", granted
                await events.wait_for(K.KIND_SWITCH_STARTED, switching, "w")
                stack.orchestrator.kill()
            await cut_by_the_kill(cut)
    stack.orchestrator.restart()

    async with connected(stack) as o:
        # (Read, not watched: the release may come before a watch could be opened.)
        deadline = time.monotonic() + WAIT_S
        while [await o.waiting(g) for g in GONE] != [("", [])] * 2:
            assert time.monotonic() < deadline, [await o.waiting(g) for g in GONE]
            await asyncio.sleep(0.1)
        # Another job gets each at once.
        for group in (resident, switching):
            assert (await o.acquire("z", group)).success
            await o.yield_("z", group)
