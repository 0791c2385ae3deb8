"""An AcquireSet that fails gives back its granted parts even when its caller goes away
during the withdrawal (issue 21 §1's promise: no part of a failed set stays held).

The caller's deadline and the request's ``timeout_ms`` are often the same instant: the
orchestrator's own deadline fails the set, and the gRPC cancellation of the call lands
while the set withdraws. Seen under load in tests/integration/test_acquire_set.py (the
granted group stayed held by the job, with nobody answered). The drivers here only
record give_back: the interleaving is what a real server cannot be made to do on cue.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tslice.orchestrator.group import callers
from tslice.orchestrator.sets import acquire as set_acquire


class _Driver:
    def __init__(self) -> None:
        self.given_back = asyncio.Event()
        self.why = ""

    async def give_back(self, job: str, epoch: int, why: str) -> None:
        await asyncio.sleep(0)  # (a real one waits for its group's batch)
        self.why = why
        self.given_back.set()


async def test_a_set_whose_caller_goes_away_while_it_withdraws_still_gives_back() -> None:
    loop = asyncio.get_running_loop()
    granted: asyncio.Future[callers.Grant] = loop.create_future()
    granted.set_result(callers.Grant(epoch=3, restored=False))
    switching: asyncio.Future[callers.Grant] = loop.create_future()
    drivers: dict[str, Any] = {"a": _Driver(), "b": _Driver()}
    withdrawing = asyncio.ensure_future(
        set_acquire._withdraw(drivers, "w", {"a": granted, "b": switching}, "its deadline")
    )
    await asyncio.sleep(0)  # it cancelled the waiting part and waits for it to leave
    withdrawing.cancel()  # the caller's own deadline: gRPC cancels the handler
    await asyncio.gather(withdrawing, return_exceptions=True)
    await asyncio.wait_for(drivers["a"].given_back.wait(), 5)
    assert drivers["a"].why == "its deadline"
    assert not drivers["b"].given_back.is_set()  # (never granted: it left its queue)
