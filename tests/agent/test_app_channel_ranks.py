"""The app-channel backend moves every rank of a multi-process job at once, all or nothing.

Real workload streams over loopback gRPC (``register_workload`` with ``rank=``); the
ranks' callbacks meet at a barrier, so a move that asked the ranks one after another
fails the test (the first rank would wait for the others until the barrier's bound).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tslice.agent import channel
from tslice.agent.backends import app_channel_ranks, base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.workload import register_workload

from .channel_ranks import Rank, job, rank_agent, register_ranks

UNSPECIFIED = pb.SUSPEND_MODE_UNSPECIFIED


async def test_snapshot_and_restore_move_every_rank_at_once() -> None:
    asked = threading.Barrier(3)
    ranks = [Rank(r, gate=asked) for r in range(3)]
    async with rank_agent() as agent:
        await register_ranks(agent, "job-r", "g", ranks)
        saved = await agent.backend.snapshot(job("job-r"), UNSPECIFIED)
        # Every rank was asked before any answered (the barrier let them through together).
        assert [r.calls for r in ranks] == [["snapshot"]] * 3
        assert all(r.device is None and r.host == r.original for r in ranks)
        assert (saved.device_bytes, saved.host_bytes) == (3 * 64, 3 * 64)
        assert saved.state["residency"] == "none"
        assert saved.state["ranks"] == {"0": "none", "1": "none", "2": "none"}
        assert not saved.still_resident

        back_gate = threading.Barrier(3)
        for r in ranks:
            r.restore_gate = back_gate
        back = await agent.backend.restore(job("job-r"))
        assert all(r.device == r.original and r.host is None for r in ranks)
        assert back.device_bytes == 3 * 64
        assert back.state["residency"] == "full"
        assert await agent.backend.recover(job("job-r")) == pb.JOB_STATE_RUNNING


async def test_one_rank_failing_its_snapshot_brings_the_others_back() -> None:
    asked = threading.Barrier(3)
    ranks = [Rank(r, gate=asked) for r in range(3)]
    ranks[1].fail_snapshot = True
    async with rank_agent() as agent:
        await register_ranks(agent, "job-f", "g", ranks)
        with pytest.raises(app_channel_ranks.RanksRolledBackError) as failed:
            await agent.backend.snapshot(job("job-f"), UNSPECIFIED)
        message = str(failed.value)
        assert "failed on rank 1 of 3" in message and "ran out of host memory" in message
        assert "ranks 0, 1, 2, sent the snapshot, were brought back" in message
        # Refused, not fatal: the job is unchanged, every rank resident with its data.
        assert isinstance(failed.value, base.RefusedBackendError)
        # Rank 1 too: it failed after moving its bytes off the device.
        assert [r.calls for r in ranks] == [["snapshot", "restore"]] * 3
        assert all(r.device == r.original and r.host is None for r in ranks)
        states = agent.hub.rank_states("job-f", "g")
        assert {rank: s.residency for rank, s in states.items()} == {
            0: "full",
            1: "full",
            2: "full",
        }
        assert await agent.backend.recover(job("job-f")) == pb.JOB_STATE_RUNNING

        # Once the rank recovers, the next snapshot moves all three.
        ranks[1].fail_snapshot = False
        saved = await agent.backend.snapshot(job("job-f"), UNSPECIFIED)
        assert saved.state["residency"] == "none"
        assert all(r.device is None for r in ranks)


async def test_a_failed_restore_says_which_ranks_are_where() -> None:
    ranks = [Rank(r) for r in range(3)]
    async with rank_agent() as agent:
        await register_ranks(agent, "job-x", "g", ranks)
        await agent.backend.snapshot(job("job-x"), UNSPECIFIED)
        back_gate = threading.Barrier(3)
        for r in ranks:
            r.restore_gate = back_gate
        ranks[2].fail_restore = True
        with pytest.raises(base.FatalBackendError) as failed:
            await agent.backend.restore(job("job-x"))
        message = str(failed.value)
        assert "restore of job 'job-x' (group 'g') failed on rank 2 of 3" in message
        assert "cannot allocate device memory" in message
        assert "ranks 0, 1 residency full" in message and "rank 2 residency none" in message
        assert [r.device == r.original for r in ranks] == [True, True, False]


async def test_a_rank_that_left_has_nothing_to_move_and_blocks_a_restore() -> None:
    ranks = [Rank(r) for r in range(3)]
    async with rank_agent() as agent:
        handles = await register_ranks(agent, "job-l", "g", ranks)
        left = asyncio.Event()
        agent.hub.add_listener(lambda e: left.set() if e.left and e.rank == 2 else None)
        await asyncio.to_thread(handles[2].close)  # its stream ends cleanly: it left
        await asyncio.wait_for(left.wait(), 10)
        assert sorted(agent.hub.rank_states("job-l", "g")) == [0, 1]
        assert sorted(agent.hub.departed_ranks("job-l", "g")) == [2]
        saved = await agent.backend.snapshot(job("job-l"), UNSPECIFIED)
        assert [r.calls for r in ranks] == [["snapshot"], ["snapshot"], []]
        assert saved.state["ranks"] == {"0": "none", "1": "none", "2": "none"}
        with pytest.raises(app_channel_ranks.RankLeftError, match="rank 2 of job 'job-l'"):
            await agent.backend.restore(job("job-l"))
        assert [r.calls for r in ranks] == [["snapshot"], ["snapshot"], []]  # nothing sent


async def test_a_workload_that_sends_no_rank_is_the_jobs_only_one() -> None:
    only = Rank(0)
    async with rank_agent() as agent:
        await register_ranks(agent, "job-1", "g", [only])
        assert not app_channel_ranks.is_ranked(agent.hub, "job-1", "g")
        saved = await agent.backend.snapshot(job("job-1"), UNSPECIFIED)
        assert "ranks" not in saved.state  # the single-workload record, as before
        assert saved.state["residency"] == "none" and only.host == only.original
        await agent.backend.restore(job("job-1"))
        assert only.device == only.original


async def test_each_rank_registers_once_and_a_command_must_name_one() -> None:
    ranks = [Rank(0), Rank(1)]
    async with rank_agent() as agent:
        await register_ranks(agent, "job-n", "g", ranks)
        again = register_workload(
            agent.address,
            "job-n",
            "g",
            on_snapshot=Rank(1).on_snapshot,
            on_restore=Rank(1).on_restore,
            rank=1,
            backoff_initial_s=0.05,
        )
        agent.handles.append(again)
        refusal = await asyncio.to_thread(again.wait_refused, 10)
        assert refusal is not None
        assert "job 'job-n' (group 'g') rank 1 already has a live workload" in refusal
        assert agent.hub.known_sessions() == [("job-n", "g")]
        with pytest.raises(channel.CommandRefusedError, match=r"ranks 0, 1 .* name the rank"):
            await agent.hub.snapshot("job-n", "g", timeout_s=5)
        assert ranks[0].calls == ranks[1].calls == []
    with pytest.raises(ValueError, match="rank must be an int between 0 and 4095"):
        register_workload("127.0.0.1:1", "job-n", "g", on_snapshot=print, on_restore=print, rank=-1)
