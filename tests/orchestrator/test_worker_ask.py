"""A question asked of a group's executor whose asker went away (a GetGroupStatus or a
Hold whose client gave up while the group was busy) is dropped quietly: it is not computed
(a Hold session opened for nobody would keep a lease alive) and logs no traceback."""

from __future__ import annotations

import asyncio
import logging
import pathlib
from typing import Any

import pytest

from tslice.orchestrator.group import executor
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import health, store
from tslice.orchestrator.switch import step


class Group:
    """The group's side of its executor (and its coordination): nothing to do here."""

    shared = False  # (shares no devices: its holder is never noted)

    def applied(self) -> None:
        return None

    def settled(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the executor asked the group for {name}")


async def test_a_cancelled_question_is_not_computed_and_logs_nothing(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = await store.Store.open(tmp_path)
    run = executor.Executor(
        group_id="g",
        nodes=(),
        lk=lk.GroupLock(),
        group=Group(),  # type: ignore[arg-type]
        coordination=Group(),  # type: ignore[arg-type]
        switches=None,  # type: ignore[arg-type]
        events=None,  # type: ignore[arg-type]
        db=db,
        store_health=health.StoreHealth(),
        backoff=step.Backoff(0.01, 0.1),
    )
    computed: list[float] = []
    caplog.set_level(logging.ERROR)
    try:
        asked = run.ask(computed.append)  # posted: the batch runs at the next turn
        asked.cancel()
        # A later question is answered: the cancelled one went through the batch first.
        assert await run.ask(lambda now: "answered") == "answered"
    finally:
        await db.close()
    assert asked.cancelled()
    assert computed == []
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    await asyncio.sleep(0)
