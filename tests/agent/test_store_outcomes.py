"""Outcomes are batched without a reply ever getting ahead of the disk: a kept outcome
goes with the next write (ahead of its records), or is written a moment later; the
runner flushes before it answers. A noop hand-over on a node costs three transactions."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tslice.agent import metrics
from tslice.agent.backends import noop
from tslice.agent.jobs import model
from tslice.agent.moves import grant_plan, runner
from tslice.agent.state import store
from tslice.rpc import refusals

S, K = model.State, model.Kind


class CountingStore(store.Store):
    """A real store that counts its write transactions (and can be made to refuse)."""

    transactions = 0
    refuse = False
    flushed: asyncio.Event | None = None

    def _write(self, *args: Any) -> None:
        if self.refuse:
            raise OSError("disk full")
        self.transactions += 1
        super()._write(*args)

    def flush(self) -> None:
        super().flush()
        if self.flushed is not None:
            self.flushed.set()


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[CountingStore]:
    opened = await CountingStore.open(tmp_path)
    try:
        yield opened
    finally:
        opened.refuse = False
        await opened.close()


def job(job_id: str, state: model.State, op_id: str = "") -> model.Job:
    return model.Job(job_id=job_id, group="g", state=state, operation_id=op_id, backend="noop")


def op(op_id: str, job_id: str, status: model.OpStatus) -> model.Operation:
    return model.Operation(
        op_id=op_id, job_id=job_id, kind=K.SNAPSHOT, backend="noop", status=status,
        started_at=1.0, group="g",
    )  # fmt: skip


async def loaded(path: Path) -> store.Store:
    """The records of the store's file, as a restarted agent would load them."""
    again = await store.Store.open(path.parent)
    await again.close()
    return again


async def on_disk(path: Path) -> dict[str, model.State]:
    return {j.job_id: j.state for j in (await loaded(path)).jobs.values()}


async def test_a_kept_outcome_goes_with_the_next_commit_ahead_of_its_record(
    db: CountingStore,
) -> None:
    db.keep_outcome(job("a", S.SAVED), op("o1", "a", model.OpStatus.COMPLETE))
    assert db.jobs[("a", "g")].state is S.SAVED  # in memory at once
    assert db.transactions == 0
    restoring = job("a", S.TRANSITIONING, "o2")
    previous = db.jobs[("a", "g")]
    db.commit(jobs=[restoring], ops=[op("o2", "a", model.OpStatus.PENDING)], previous=previous)
    assert db.transactions == 1  # the outcome went with the commit
    db.flush()  # nothing left to write
    assert db.transactions == 1
    assert await on_disk(db.path) == {"a": S.TRANSITIONING}  # the newer record last
    assert set((await loaded(db.path)).operations) == {"o1", "o2"}


async def test_outcomes_nobody_reads_are_written_together_a_moment_later(
    db: CountingStore,
) -> None:
    db.flushed = asyncio.Event()
    db.keep_outcome(job("a", S.SAVED), op("o1", "a", model.OpStatus.COMPLETE))
    db.keep_outcome(job("b", S.RUNNING), op("o2", "b", model.OpStatus.COMPLETE))
    assert db.transactions == 0
    await asyncio.wait_for(db.flushed.wait(), timeout=5.0)
    assert db.transactions == 1  # both, in one transaction
    assert await on_disk(db.path) == {"a": S.SAVED, "b": S.RUNNING}


async def test_a_refused_write_keeps_the_outcome_in_memory_and_a_refused_commit_retries_it(
    db: CountingStore, caplog: pytest.LogCaptureFixture
) -> None:
    db.refuse = True
    db.keep_outcome(job("a", S.SAVED), op("o1", "a", model.OpStatus.COMPLETE))
    with pytest.raises(refusals.Refused):
        db.commit(jobs=[job("b", S.RUNNING)], previous=None)
    assert ("b", "g") not in db.jobs  # the commit changed nothing
    db.refuse = False
    db.flush()  # the outcome is written after all
    assert await on_disk(db.path) == {"a": S.SAVED}
    db.refuse = True
    caplog.set_level(logging.ERROR, logger="tslice.agent.state.store")
    later = dataclasses.replace(job("a", S.RUNNING))
    db.keep_outcome(later, op("o3", "a", model.OpStatus.COMPLETE))
    db.flush()
    assert "could not persist the outcome of operation(s) o3" in caplog.text
    assert db.jobs[("a", "g")].state is S.RUNNING  # still served from memory


async def grant(core: runner.AgentCore, job_id: str, *, epoch: int, evict: str = "") -> bool:
    order = grant_plan.order(
        job_id=job_id,
        group="g",
        epoch=epoch,
        footprint_bytes=0,
        config=None,
        evict=[core.key(evict, "g")] if evict else [],
        restore=True,
    )
    return (await core.grant(order)).granted


async def test_a_hand_over_costs_three_transactions_and_its_reply_is_on_disk(
    db: CountingStore,
) -> None:
    core = runner.AgentCore(
        node="n",
        backends={"noop": noop.NoopBackend()},
        default_backend="noop",
        store=db,
        agent_metrics=metrics.AgentMetrics(),
    )
    await core.start()
    assert await grant(core, "a", epoch=1)
    assert await grant(core, "b", epoch=2, evict="a")  # b activated: nothing to restore
    db.flushed = None
    before = db.transactions
    # The hand-over: a's snapshot starts; its outcome goes with the start of b's restore;
    # b's outcome is written before the reply.
    assert await grant(core, "a", epoch=3, evict="b")
    assert db.transactions - before == 3
    assert await on_disk(db.path) == {"a": S.RUNNING, "b": S.SAVED}
    await core.close(grace_s=1.0)
