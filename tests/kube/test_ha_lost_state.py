"""A group's state ConfigMap deleted, or its record made unreadable, then a failover (issue
22 §2): a missing or unreadable record must not mean "nobody holds".

job-a holds, job-b waits; an operator deletes the group's ConfigMap (or garbles its
``data.record``); the leader is SIGKILLed. The new leader cannot know from the API server
who holds: it reads the group's agents, finds job-a resident on every node, and keeps
job-a as the holder. job-b (its Acquire re-issued at the new leader) is granted only
after job-a yields. The device journals are checked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

pytest.importorskip("lightkube")

from tests.kube.emulator import ApiServerEmulator
from tests.kube.ha_stack import NAMESPACE, HaStack
from tests.kube.stack import WAIT_S, events_of, next_event
from tslice.client import AsyncClient, EventKind
from tslice.sim import checker


def _state_name(api: ApiServerEmulator) -> str:
    from tests.kube import apistore

    selects = apistore.label_selector("timeslice.io/orchestrator-state=group")
    _, found = api.store.list("configmaps", NAMESPACE, selects)
    (cm,) = found
    return str(cm["metadata"]["name"])


def _delete(api: ApiServerEmulator) -> None:
    api.store.delete("configmaps", NAMESPACE, _state_name(api))


def _garble(api: ApiServerEmulator) -> None:
    name = _state_name(api)
    cm = api.store.get("configmaps", NAMESPACE, name)
    cm["data"]["record"] = "{not json"
    api.store.update("configmaps", NAMESPACE, name, cm)


@pytest.mark.parametrize("lose", [_delete, _garble], ids=["deleted", "unreadable"])
async def test_a_lost_record_keeps_its_holder_across_a_failover(
    api: ApiServerEmulator, stack: HaStack, lose: Callable[[ApiServerEmulator], None]
) -> None:
    old, new = stack.start_trainers(["job-a", "job-b"], ["gpu-a", "gpu-b"])
    both = [stack.addresses[old], stack.addresses[new]]
    win_a = checker.Window(job="job-a", group="trainer", requested=time.time())
    win_b = checker.Window(job="job-b", group="trainer", requested=0.0)
    async with (
        AsyncClient(both, job_id="job-a", lease_s=None) as a,
        AsyncClient(both, job_id="job-b", lease_s=None) as b,
    ):
        async with events_of(b, "trainer") as events:
            await a.acquire("trainer", timeout=WAIT_S)
            win_a.acquired = win_b.requested = time.time()
            waiting_b = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
            waiting_b.add_done_callback(lambda _: setattr(win_b, "acquired", time.time()))
            await next_event(events, EventKind.QUEUED, "job-b")
        lose(api)
        stack.kill(old)
        await asyncio.to_thread(stack.leads, new, 2)
        async with (
            AsyncClient(stack.addresses[new], job_id="job-c", lease_s=None) as watcher,
            events_of(watcher, "trainer") as events,
        ):
            # job-a holds for the new leader too; job-b waits behind it (or, wrongly, is
            # granted at once).
            queued = asyncio.create_task(next_event(events, EventKind.QUEUED, "job-b"))
            await asyncio.wait({waiting_b, queued}, return_when=asyncio.FIRST_COMPLETED)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            status = await watcher.status("trainer")
            assert not waiting_b.done(), f"job-b granted while job-a holds: {status}"
            assert status.locking_job == "job-a"
            assert "found resident on every node" in status.detail
            win_a.yielded = time.time()
            await a.yield_("trainer")
            assert (await asyncio.wait_for(waiting_b, WAIT_S)).success
            assert (await watcher.status("trainer")).locking_job == "job-b"
            win_b.yielded = time.time()
            await b.yield_("trainer")
    violations = checker.check(
        journal=stack.journal(), windows=[win_a, win_b], group_nodes={"trainer": ["gpu-a", "gpu-b"]}
    )
    assert violations == []
