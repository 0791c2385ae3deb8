"""End to end against a real Slurm (one cluster for the module, tests/slurm/conftest.py):
``sbatch`` jobs take turns on a node's simulated GPUs through tslice with Slurm's job ids
and credentials, exclusive throughout (the device journals are checked); a holder that is
cancelled or runs past its time limit loses the group within seconds and is in no queue;
a job that never calls tslice is not affected; a drained node leaves its groups as a
cordoned Kubernetes node does. Waits are on the orchestrator's events and log lines, and
on the controller's job states."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from tests.kube.stack import WAIT_S, events_of, next_event
from tests.slurm.cluster import ENDED
from tests.slurm.conftest import TESTER_TOKEN, Stack
from tslice.client import AsyncClient, EventKind, OrchestratorEvent
from tslice.common import errors
from tslice.security import tls
from tslice.sim import checker

pytestmark = pytest.mark.slow

JOB = str(pathlib.Path(__file__).with_name("job.py"))
#: "within seconds": the bound on a gone holder's hand-over that the tests assert.
HANDOVER_S = 15.0


def windows(path: pathlib.Path) -> list[checker.Window]:
    found = []
    for line in path.read_text().splitlines():
        w = json.loads(line)
        found.append(
            checker.Window(
                job=w["job"],
                group=w["group"],
                requested=w["requested"],
                acquired=w.get("acquired"),
                yielded=w.get("yielded"),
            )
        )
    return found


async def next_event_within(
    events: AsyncIterator[OrchestratorEvent], kind: EventKind, job: str, timeout_s: float
) -> OrchestratorEvent:
    """As ``next_event``, waiting up to ``timeout_s``."""

    async def first() -> OrchestratorEvent:
        async for event in events:
            if event.kind is kind and event.job_id == job:
                return event
        raise AssertionError(f"the event stream ended before a {kind.value} event")

    return await asyncio.wait_for(first(), timeout_s)


async def next_event_of(events: AsyncIterator[OrchestratorEvent], job: str) -> OrchestratorEvent:
    """The next event of ``job``, whatever its kind."""

    async def first() -> OrchestratorEvent:
        async for event in events:
            if event.job_id == job:
                return event
        raise AssertionError(f"the event stream ended before an event of job {job}")

    return await asyncio.wait_for(first(), WAIT_S)


@pytest.fixture
async def tester(stack: Stack) -> AsyncIterator[AsyncClient]:
    security = tls.ClientSecurity(token=tls.TokenSource(token=TESTER_TOKEN))
    async with AsyncClient(
        stack.address, job_id="test-holder", lease_s=None, security=security
    ) as client:
        yield client


def job(mode: str, group: str, out: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, JOB, mode, group, str(out), *args]


def ended_at(stack: Stack, job_id: str) -> float:
    """When Slurm says the job ended (its EndTime, whole seconds, this host's time)."""
    end = stack.slurm.command("squeue", "--noheader", "--states=all", f"--jobs={job_id}",
                              "--format=%e").strip()  # fmt: skip
    return datetime.datetime.fromisoformat(end).timestamp()


def handover_s(granted: OrchestratorEvent, since: float) -> float:
    assert granted.time is not None
    return granted.time.timestamp() - since


async def test_two_sbatch_jobs_take_turns_on_a_nodes_gpus(stack: Stack) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    (out / "turns").mkdir()
    # Both jobs start their rounds together (the barrier), so they take turns.
    jobs = [
        slurm.sbatch(
            job("turns", "gpu-a", out / f"turns-{i}.jsonl", "4", "0.3"),
            "--nodelist=gpu-a",
            "--gres=shard:1",
            env={"BARRIER": f"{out / 'turns'}:2"},
        )
        for i in range(2)
    ]
    for job_id in jobs:
        assert slurm.wait_state(job_id, ENDED) == "COMPLETED", slurm.output(job_id)
    seen = [w for i in range(2) for w in windows(out / f"turns-{i}.jsonl")]
    # The job ids are Slurm's, taken by tslice.Client() from $SLURM_JOB_ID.
    assert sorted({w.job for w in seen}) == sorted(jobs)
    order = [w.job for w in sorted(seen, key=lambda w: w.acquired or 0)]
    assert len(order) == 8
    assert sum(a != b for a, b in itertools.pairwise(order)) >= 3, order  # they took turns
    violations = checker.check(
        journal=stack.journal(), windows=seen, group_nodes={"gpu-a": ["gpu-a"]}
    )
    assert violations == []


async def test_scancel_of_the_holder_hands_the_group_over_within_seconds(
    stack: Stack, tester: AsyncClient
) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    no_lease = {"TSLICE_LEASE_S": "none"}  # only Slurm can take the group back
    async with events_of(tester, "gpu-b") as events:
        holder = slurm.sbatch(
            job("hold", "gpu-b", out / "cancelled.jsonl"), "--nodelist=gpu-b", env=no_lease
        )
        await next_event(events, EventKind.GRANTED, holder)
        waiter = slurm.sbatch(
            job("hold", "gpu-b", out / "next.jsonl"), "--nodelist=gpu-b", env=no_lease
        )
        await next_event(events, EventKind.QUEUED, waiter)
        cancelled = time.time()
        slurm.command("scancel", holder)
        yielded = await next_event(events, EventKind.YIELDED, holder)
        assert f"by Slurm mode: Slurm job {holder} ended (C" in yielded.detail  # CANCELLED, CG
        granted = await next_event(events, EventKind.GRANTED, waiter)
        print(f"scancel -> next job granted: {handover_s(granted, cancelled):.2f} s")
        assert handover_s(granted, cancelled) < HANDOVER_S
        status = await tester.status("gpu-b")
        assert status.locking_job == waiter
        assert holder not in status.waiting_jobs
        # A cancelled waiter leaves the queue, with an event: its Acquire's connection
        # closes as its process dies (CANCELLED), or else the controller says it ended.
        queued = slurm.sbatch(
            job("hold", "gpu-b", out / "queued.jsonl"), "--nodelist=gpu-b", env=no_lease
        )
        await next_event(events, EventKind.QUEUED, queued)
        slurm.command("scancel", queued)
        left = await next_event_of(events, queued)
        assert left.kind is EventKind.CANCELLED or "by Slurm mode" in left.detail, left
        assert queued not in (await tester.status("gpu-b")).waiting_jobs
        slurm.command("scancel", waiter)
        yielded = await next_event(events, EventKind.YIELDED, waiter)
    assert (await tester.status("gpu-b")).locking_job == ""


async def test_a_job_past_its_time_limit_hands_the_group_over_within_seconds(
    stack: Stack, tester: AsyncClient
) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    no_lease = {"TSLICE_LEASE_S": "none"}
    async with events_of(tester, "gpu-b") as events:
        holder = slurm.sbatch(
            job("hold", "gpu-b", out / "timed.jsonl"), "--nodelist=gpu-b", "--time=5",
            env=no_lease,
        )  # fmt: skip
        await next_event(events, EventKind.GRANTED, holder)
        waiter = slurm.sbatch(
            job("hold", "gpu-b", out / "after-timeout.jsonl"), "--nodelist=gpu-b", env=no_lease
        )
        await next_event(events, EventKind.QUEUED, waiter)
        # Its time limit ends now: the controller times it out at its next check (<= 30 s).
        now = datetime.datetime.now().isoformat(timespec="seconds")
        slurm.command("scontrol", "update", f"jobid={holder}", f"EndTime={now}")
        yielded = await next_event_within(events, EventKind.YIELDED, holder, 90)
        assert f"by Slurm mode: Slurm job {holder} ended" in yielded.detail
        assert slurm.wait_state(holder, ENDED) == "TIMEOUT"
        granted = await next_event(events, EventKind.GRANTED, waiter)
        print(
            f"time limit -> next job granted: {handover_s(granted, ended_at(stack, holder)):.2f} s"
        )
        assert handover_s(granted, ended_at(stack, holder)) < HANDOVER_S
        assert holder not in (await tester.status("gpu-b")).waiting_jobs
        slurm.command("scancel", waiter)
        await next_event(events, EventKind.YIELDED, waiter)


async def test_a_job_that_never_calls_tslice_is_not_affected(
    stack: Stack, tester: AsyncClient
) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    async with events_of(tester, "gpu-a") as events:
        holder = slurm.sbatch(
            job("hold", "gpu-a", out / "beside.jsonl"), "--nodelist=gpu-a",
            env={"TSLICE_LEASE_S": "none"},
        )  # fmt: skip
        await next_event(events, EventKind.GRANTED, holder)
        plain = slurm.sbatch(["/bin/sh", "-c", "echo plain job ran"], "--nodelist=gpu-a",
                             "--gres=gpu:1")  # fmt: skip
        assert slurm.wait_state(plain, ENDED) == "COMPLETED"
        assert slurm.output(plain).strip() == "plain job ran"
        # It ran beside the holder, which keeps the group; nothing about it was evicted.
        assert (await tester.status("gpu-a")).locking_job == holder
        slurm.command("scancel", holder)
        await next_event(events, EventKind.YIELDED, holder)
    assert f"job {plain} evicted" not in stack.orchestrator_logs()


async def test_a_job_cannot_act_as_another_and_an_ended_jobs_credential_is_void(
    stack: Stack, tester: AsyncClient
) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    async with events_of(tester, "gpu-b") as events:
        victim = slurm.sbatch(
            job("hold", "gpu-b", out / "victim.jsonl"), "--nodelist=gpu-b",
            env={"TSLICE_LEASE_S": "none"},
        )  # fmt: skip
        await next_event(events, EventKind.GRANTED, victim)
        credential = (slurm.run_dir / victim / "token").read_text().strip()
        intruder = slurm.sbatch(
            job("impersonate", "gpu-b", out / "intruder.jsonl"), "--nodelist=gpu-b",
            env={"OTHER_JOB": victim},
        )  # fmt: skip
        assert slurm.wait_state(intruder, ENDED) == "COMPLETED", slurm.output(intruder)
        outcomes = [json.loads(line) for line in (out / "intruder.jsonl").read_text().splitlines()]
        assert [o["call"] for o in outcomes] == ["acquire", "yield"]
        for outcome in outcomes:
            assert "PERMISSION_DENIED" in outcome["outcome"], outcome
            assert f"may not act as job '{victim}'" in outcome["outcome"]
        assert (await tester.status("gpu-b")).locking_job == victim
        slurm.command("scancel", victim)
        await next_event(events, EventKind.YIELDED, victim)
    # The victim's credential, copied while it ran, is void once it ended.
    security = tls.ClientSecurity(token=tls.TokenSource(token=credential))
    async with AsyncClient(stack.address, job_id=victim, lease_s=None, security=security) as old:
        with pytest.raises(errors.RPCError, match=f"UNAUTHENTICATED.*Slurm job {victim} is void"):
            await old.acquire("gpu-b", timeout=5)


async def test_array_tasks_act_as_one_named_job_until_every_task_ended(
    stack: Stack, tester: AsyncClient
) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    async with events_of(tester, "gpu-b") as events:
        array = slurm.sbatch(
            job("hold", "gpu-b", out / "array.jsonl"), "--nodelist=gpu-b", "--array=0-1",
            env={"TSLICE_LEASE_S": "none", "TSLICE_JOB_ID": "rl-array"},
        )  # fmt: skip
        await next_event(events, EventKind.GRANTED, "rl-array")
        slurm.command("scancel", array)
        yielded = await next_event(events, EventKind.YIELDED, "rl-array")
        assert "every Slurm job that acted as rl-array ended" in yielded.detail
    assert (await tester.status("gpu-b")).locking_job == ""


async def test_a_node_drained_while_in_a_group_leaves_it_as_a_cordoned_node_does(
    stack: Stack, tester: AsyncClient
) -> None:
    slurm = stack.slurm
    await tester.acquire("pair", timeout=WAIT_S)
    assert (await tester.status("pair")).nodes == ("gpu-a", "gpu-b")
    drained = stack.mark()
    slurm.command("scontrol", "update", "nodename=gpu-b", "state=drain", "reason=tslice-test")
    stack.logged(r"Slurm node gpu-b counts for no group: it is drained or draining "
                 r"\(Reason=tslice-test", since=drained)  # fmt: skip
    stack.logged(r"group pair: nodes changed \(gpu-a@\S+, gpu-b@\S+ -> gpu-a@\S+\)", since=drained)
    stack.logged(r"group gpu-b is gone", since=drained)
    # The group carries on over the node left; the holder keeps its turn there.
    await tester.acquire("pair", timeout=WAIT_S)
    status = await tester.status("pair")
    assert (status.locking_job, status.nodes) == ("test-holder", ("gpu-a",))
    with pytest.raises(errors.NotFound, match="no usable Slurm node"):
        await tester.acquire("gpu-b", timeout=5)
    resumed = stack.mark()
    slurm.command("scontrol", "update", "nodename=gpu-b", "state=resume")
    stack.logged(r"group gpu-b appeared", since=resumed)
    stack.logged(r"group pair: nodes changed \(gpu-a@\S+ -> gpu-a@\S+, gpu-b@\S+\)", since=resumed)
    await tester.acquire("pair", timeout=WAIT_S)
    assert (await tester.status("pair")).nodes == ("gpu-a", "gpu-b")
    await tester.yield_("pair")


def test_doctor_asks_the_agent_of_every_slurm_node_the_config_selects(stack: Stack) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tslice", "doctor",
         "--orchestrator-config", str(stack.root / "orchestrator.yaml")],
        capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, **stack.slurm.env, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"Slurm controller +ok +3 group\(s\)", done.stdout), done.stdout
    for node in stack.slurm.nodes:
        assert re.search(rf"agent {node} \(127\.0\.0\.1:\d+\) +ok +answers", done.stdout)


async def test_a_holder_whose_node_fails_loses_the_group(stack: Stack, tester: AsyncClient) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    start = stack.mark()
    holder = slurm.sbatch(
        job("hold", "gpu-b", out / "node-fail.jsonl"), "--nodelist=gpu-b", "--no-requeue",
        env={"TSLICE_LEASE_S": "none"},
    )  # fmt: skip
    stack.logged(rf"group gpu-b: switch \S+ -> {holder} done", since=start)
    # Down, the node's jobs fail (NODE_FAIL); slurmd still answers, so with
    # ReturnToService=2 the node may be back before a read sees it down, or not.
    slurm.command("scontrol", "update", "nodename=gpu-b", "state=down", "reason=tslice-test")
    assert slurm.wait_state(holder, ENDED) == "NODE_FAIL"
    slurm.command("scontrol", "update", "nodename=gpu-b", "state=resume", check=False)
    # Evicted at once (the group is there), or, when a read saw the node down first and the
    # group stopped, as the group comes back (the eviction held over): either line says so.
    stack.logged(
        rf"job {holder} (\(holder\) )?evicted from group '?gpu-b'? "
        rf"(\(it was holder\)|by Slurm mode): Slurm job {holder} ended \(NODE_FAIL\)",
        since=start,
    )
    assert (await tester.status("gpu-b")).locking_job == ""


async def test_a_job_that_ends_while_its_group_is_away_is_evicted_when_it_comes_back(
    stack: Stack, tester: AsyncClient
) -> None:
    slurm, out = stack.slurm, stack.slurm.root / "out"
    start = stack.mark()
    holder = slurm.sbatch(
        job("hold", "gpu-b", out / "away.jsonl"), "--nodelist=gpu-b",
        env={"TSLICE_LEASE_S": "none"},
    )  # fmt: skip
    stack.logged(rf"group gpu-b: switch \S+ -> {holder} done", since=start)
    waiting = asyncio.create_task(tester.acquire("gpu-b", job_id="test-next", timeout=WAIT_S))
    # Drained, the node leaves its groups (gpu-b goes, its holder and queue kept on disk);
    # meanwhile the holder ends, with no group left to evict it from.
    drained = stack.mark()
    slurm.command("scontrol", "update", "nodename=gpu-b", "state=drain", "reason=tslice-away")
    stack.logged(r"group gpu-b is gone", since=drained)
    slurm.command("scancel", holder)
    assert slurm.wait_state(holder, ENDED) == "CANCELLED"
    resumed = stack.mark()
    slurm.command("scontrol", "update", "nodename=gpu-b", "state=resume")
    # Back on its persisted queue, the group does not keep the ended job as its holder
    # (the eviction kept for the stopped group is applied as it comes back; after an
    # orchestrator restart, the job book's memory of ended jobs would evict it).
    stack.logged(
        rf"group gpu-b: job {holder} \(holder\) evicted from group 'gpu-b' by Slurm mode: "
        rf"Slurm job {holder} ended \(CANCELLED\)",
        since=resumed,
    )
    assert (await asyncio.wait_for(waiting, WAIT_S)).success
    await tester.yield_("gpu-b", job_id="test-next")
