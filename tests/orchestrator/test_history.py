"""The event history: kept beside the state, replayed by WatchEvents' ``since``, bounded
by age and size, with the events of a graceful stop kept across a restart.

(SIGKILL and the CLI are in tests/cli/test_events_history.py, with real processes.)
"""

from __future__ import annotations

import asyncio
import pathlib
import time

import grpc
import pytest
from google.protobuf import timestamp_pb2

from tests.orchestrator.orch_harness import Cluster, acquire, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import errors
from tslice.orchestrator import config as orch_config
from tslice.orchestrator.persistence import history

Kind = opb.OrchestratorEvent.Kind


def _ts(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


async def _stored(stub: object, **fields: object) -> list[opb.OrchestratorEvent]:
    request = opb.WatchEventsRequest(history_only=True, **fields)  # type: ignore[arg-type]
    return [e async for e in stub.WatchEvents(request)]  # type: ignore[attr-defined]


async def _hand_overs(stub: object, rounds: int, group: str = "g") -> None:
    for i in range(rounds):
        job = "a" if i % 2 == 0 else "b"
        await acquire(stub, job, group)
        await yield_(stub, job, group)


async def test_history_replays_then_follows_without_gap_or_repeat(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    # A long flush interval: the replay must find the events not written yet as well.
    await cluster.start_orchestrator(history={"flush_interval_s": 30.0})
    stub = cluster.stub()
    started = time.time() - 1
    await _hand_overs(stub, 4)
    call = stub.WatchEvents(opb.WatchEventsRequest(since=_ts(started), group_id="g"))
    await call.initial_metadata()
    await _hand_overs(stub, 2)  # live: after the mark
    seen: list[opb.OrchestratorEvent] = []
    async for event in call:
        seen.append(event)
        if sum(e.kind == Kind.KIND_GRANTED for e in seen) == 6:
            break
    call.cancel()
    granted = [(e.job_id, e.grant_epoch) for e in seen if e.kind == Kind.KIND_GRANTED]
    assert granted == [(j, n) for n, j in enumerate("ababab", start=1)]
    times = [e.time.ToNanoseconds() for e in seen]
    assert times == sorted(times)


async def test_history_filters_and_survives_a_graceful_restart(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(history={"flush_interval_s": 30.0})
    stub = cluster.stub()
    begin = time.time() - 1
    await _hand_overs(stub, 2, "g")
    await _hand_overs(stub, 2, "h")
    middle = time.time()
    await asyncio.sleep(0.01)  # the subject: event times on both sides of `middle`
    await _hand_overs(stub, 2, "g")
    # A graceful stop writes every pending event (the interval is 30 s).
    await cluster.restart_orchestrator()
    stub = cluster.stub()
    everything = await _stored(stub, since=_ts(begin))
    assert {e.group_id for e in everything} == {"g", "h"}
    only_g = await _stored(stub, since=_ts(begin), group_id="g")
    assert only_g and {e.group_id for e in only_g} == {"g"}
    only_b = await _stored(stub, since=_ts(begin), job_id="b")
    assert only_b and all("b" in (e.job_id, e.from_job) for e in only_b)
    assert any(e.from_job == "b" and e.job_id != "b" for e in only_b)
    grants = await _stored(stub, since=_ts(begin), kinds=[Kind.KIND_GRANTED])
    assert [e.group_id for e in grants] == ["g", "g", "h", "h", "g", "g"]
    before = await _stored(stub, since=_ts(begin), until=_ts(middle), kinds=[Kind.KIND_GRANTED])
    assert [e.group_id for e in before] == ["g", "g", "h", "h"]
    after = await _stored(stub, since=_ts(middle), kinds=[Kind.KIND_GRANTED])
    assert [e.group_id for e in after] == ["g", "g"]


async def test_bad_history_requests_are_refused_with_the_fix(
    cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stored(stub, since=_ts(10), until=_ts(5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "before since" in str(err.value.details())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stored(stub)  # history_only without since
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await cluster.stop_orchestrator()
    await cluster.start_orchestrator(
        history={"enabled": False}, state_dir=str(tmp_path / "orch-nohist")
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _stored(cluster.stub(), since=_ts(0))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "keeps no event history" in str(err.value.details())
    assert not (tmp_path / "orch-nohist" / history.FILE_NAME).exists()


def _event(t_s: float, job: str = "j") -> opb.OrchestratorEvent:
    return opb.OrchestratorEvent(
        time=_ts(t_s), kind=Kind.KIND_GRANTED, group_id="g", job_id=job, detail="x" * 100
    )


async def test_history_is_bounded_by_age_and_by_size(tmp_path: pathlib.Path) -> None:
    now = time.time()
    aged = history.HistorySettings(max_age_s=3600, max_bytes=1 << 30)
    store = await history.History.open(tmp_path, aged)
    store.append(1, [_event(now - 7200, "old"), _event(now - 10, "new")]).result()
    rows = await store.read_page(history.Query(), after_seq=0, before_seq=10)
    assert [e.job_id for _, e in rows] == ["new"]
    await store.close()

    small = history.HistorySettings(max_bytes=1 << 20)
    store = await history.History.open(tmp_path, small)
    seq = store.next_seq
    assert seq == 3  # numbering goes on after a reopen
    for _ in range(40):  # ~40 x 500 events of ~200 bytes: 4 MB offered
        batch = [_event(now, f"job-{seq + i}") for i in range(500)]
        assert store.append(seq, batch).result() == 500
        seq += 500
    count, used = await store.stats()
    assert used <= 1 << 20
    rows = await store.read_page(history.Query(), after_seq=0, before_seq=seq, limit=1)
    oldest = rows[0][0]
    assert 0 < count < seq - 3 and oldest > 3  # the oldest went, the newest stayed
    newest = await store.read_page(
        history.Query(job_id=f"job-{seq - 1}"), after_seq=0, before_seq=seq
    )
    assert len(newest) == 1
    await store.close()
    assert (tmp_path / history.FILE_NAME).stat().st_size < 3 << 20


def test_history_settings_defaults_match_the_config_file_model() -> None:
    built = orch_config.build(overrides={"local_agents": ["127.0.0.1:9"]})
    assert built.history == history.HistorySettings()
    custom = orch_config.build(
        overrides={"local_agents": ["127.0.0.1:9"], "history": {"max_age_s": 60}}
    )
    assert custom.history.max_age_s == 60 and custom.history.enabled
    with pytest.raises(errors.ConfigError, match=r"history\.max_bytes"):
        orch_config.build(overrides={"local_agents": ["127.0.0.1:9"], "history": {"max_bytes": 10}})
