"""A question asked of a group's worker whose asker went away (a GetGroupStatus or a Hold
whose client gave up while the worker was busy) is dropped quietly: it is not computed
(a Hold session opened for nobody would keep a lease alive) and logs no traceback."""

from __future__ import annotations

import asyncio
import logging
import pathlib

import pytest

from tslice.orchestrator.group import executor as worker
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import store as st
from tslice.orchestrator.switch import step as switch


async def test_a_cancelled_question_is_not_computed_and_logs_nothing(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = await st.Store.open(tmp_path)
    group = lk.GroupLock()
    w = worker.Worker(
        group_id="g",
        nodes=(),
        db=db,
        backoff=switch.Backoff(0.01, 0.1),
        saved=None,
        record=group.record,
        stopping=lambda: False,
        applied=lambda: None,
        settled=lambda: None,
    )
    computed: list[float] = []
    asked = asyncio.ensure_future(w.ask(computed.append))
    await asyncio.sleep(0)  # posted: the worker is not running yet (busy)
    asked.cancel()
    caplog.set_level(logging.ERROR)
    running = asyncio.ensure_future(w.run())
    try:
        # A later question is answered: the cancelled one went through the worker first.
        assert await w.ask(lambda now: "answered") == "answered"
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await db.close()
    assert asked.cancelled()
    assert computed == []
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
