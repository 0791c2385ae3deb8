"""The ledger writes the outcomes of one loop turn in one transaction, before anything
woken by them runs, and never lets an older outcome overwrite a newer record."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from tslice.agent import ledger, store
from tslice.agent.jobs import model

S, K = model.State, model.Kind


class CountingStore(store.Store):
    """A real store that counts its write transactions (and can be made to refuse)."""

    transactions = 0
    refuse = False

    def _put_sync(self, *args: Any) -> None:
        if self.refuse:
            raise OSError("disk full")
        self.transactions += 1
        super()._put_sync(*args)


async def opened(tmp_path: Path) -> tuple[CountingStore, ledger.Ledger]:
    db = CountingStore(tmp_path / store.DB_FILE)
    await db._run(db._open_sync)
    return db, ledger.Ledger(node="n", state=db, retention_s=3600, max_operations=100)


def job(job_id: str, state: model.State, op_id: str = "") -> model.Job:
    return model.Job(job_id=job_id, group="g", state=state, operation_id=op_id)


def op(op_id: str, job_id: str, status: model.OpStatus) -> model.Operation:
    return model.Operation(
        op_id=op_id, job_id=job_id, kind=K.SNAPSHOT, backend="noop", status=status,
        started_at=1.0, group="g",
    )  # fmt: skip


async def on_disk(db: store.Store) -> dict[str, model.State]:
    return {j.job_id: j.state for j in (await db.load()).job_map.values()}


async def test_the_outcomes_of_one_turn_share_a_transaction_written_before_their_waiters(
    tmp_path: Path,
) -> None:
    db, book = await opened(tmp_path)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waiter() -> int:  # a Grant waiting for its moves: what it sees on waking
        await done
        return db.transactions

    woken = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the waiter now waits on the future
    book.record_outcome(job("a", S.SAVED), op("o1", "a", model.OpStatus.COMPLETE))
    book.record_outcome(job("b", S.RUNNING), op("o2", "b", model.OpStatus.COMPLETE))
    done.set_result(None)  # as the runner wakes an operation's waiters after its outcome
    assert book.jobs[("a", "g")].state is S.SAVED  # in memory at once
    assert db.transactions == 0
    assert await woken == 1  # both outcomes were on disk, in one transaction, when it woke
    assert await on_disk(db) == {"a": S.SAVED, "b": S.RUNNING}
    await db.close()


async def test_a_commit_in_the_same_turn_writes_the_outcome_first_and_its_record_last(
    tmp_path: Path,
) -> None:
    db, book = await opened(tmp_path)
    book.record_outcome(job("a", S.SAVED), op("o1", "a", model.OpStatus.COMPLETE))
    restoring = job("a", S.TRANSITIONING, "o2")
    previous = book.jobs[("a", "g")]
    book.commit(jobs_=[restoring], ops=[op("o2", "a", model.OpStatus.PENDING)], previous=previous)
    assert db.transactions == 1  # the outcome went with the commit
    await asyncio.sleep(0)  # the turn's flush, with nothing left to write
    assert db.transactions == 1
    assert await on_disk(db) == {"a": S.TRANSITIONING}
    assert set((await db.load()).operation_map) == {"o1", "o2"}
    await db.close()


async def test_a_refused_write_keeps_the_outcome_in_memory_and_a_refused_commit_retries_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db, book = await opened(tmp_path)
    db.refuse = True
    book.record_outcome(job("a", S.SAVED), op("o1", "a", model.OpStatus.COMPLETE))
    with pytest.raises(ledger.refusals.Refused):
        book.commit(jobs_=[job("b", S.RUNNING)], previous=None)
    assert ("b", "g") not in book.jobs  # the commit changed nothing
    db.refuse = False
    book.flush()  # what the turn's scheduled flush does: the outcome is written after all
    assert await on_disk(db) == {"a": S.SAVED}
    db.refuse = True
    caplog.set_level(logging.ERROR, logger="tslice.agent.ledger")
    later = dataclasses.replace(job("a", S.RUNNING))
    book.record_outcome(later, op("o3", "a", model.OpStatus.COMPLETE))
    book.flush()
    assert "could not persist the outcome of operation(s) o3" in caplog.text
    assert book.jobs[("a", "g")].state is S.RUNNING  # still served from memory
    db.refuse = False
    await db.close()
