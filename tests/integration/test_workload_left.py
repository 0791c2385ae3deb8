"""A job whose workload left does not wedge the next job's switch (real processes).

A real orchestrator and a real app-channel agent (``tslice.sim.cluster.LocalCluster``,
one node, group ``g``), job ``job-a`` a separate process with a registered workload
(callbacks that say on stdout what the agent told them), job ``job-b`` this test's
client. Before the fix, job-a's state stayed "resident" after its process was gone: the
agent retried job-b's switch ("no workload channel registered for job 'job-a'") every
10 s and the group stayed SWITCHING for ever.

- job-a closes its workload (a clean end of the stream) and exits: job-b is granted at
  once, nothing is snapshotted, job-a is IDLE on the node;
- job-a is SIGKILLed, after its yield or while it holds the group (its lease lapses):
  job-b is granted once the agent's grace (``lost_grace_s``, 1 s here) ran out;
- job-a's connection is cut while its process lives on, and it reconnects within the
  grace: its state is kept, really snapshotted for job-b (the event stream shows the
  bytes it moved) and restored for its next turn.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import tslice
from tests.harness.proxy import CuttableProxy
from tslice.client import AgentJobState, EventKind, GroupState
from tslice.sim.cluster import LocalCluster, SimAgent
from tslice.workload import register_workload

NODE = "node-1"
GROUP = "g"
SHORT_GRACE_S = 1.0
LONG_GRACE_S = 120.0
MOVED = 4096
#: How long job-b's Acquire may take before the test fails (the bug: for ever).
ACQUIRE_TIMEOUT_S = 60.0

pytestmark = pytest.mark.timeout(180)

JOB = textwrap.dedent(
    f"""
    import sys, time, tslice
    from tslice.workload import register_workload

    job_id, agent, orchestrator, mode, lease = sys.argv[1:6]

    def on_snapshot(suspend_mode, tags):
        print("snapshot", flush=True)
        return {{"device_bytes": {MOVED}, "host_bytes": {MOVED}}}

    def on_restore(tags):
        print("restore", flush=True)
        return {{"device_bytes": {MOVED}}}

    handle = register_workload(agent, job_id, {GROUP!r}, on_snapshot=on_snapshot,
                               on_restore=on_restore, backoff_initial_s=0.05,
                               backoff_max_s=0.2)
    assert handle.wait_registered(20), handle.error
    client = tslice.Client(orchestrator, job_id=job_id, lease_s=float(lease))
    client.acquire({GROUP!r})
    if mode != "hold":
        client.yield_({GROUP!r})
    print("ready", flush=True)
    for line in sys.stdin:
        word = line.strip()
        if word == "close":
            handle.close()
            client.close()
            print("bye", flush=True)
            break
        if word == "acquire":
            result = client.acquire({GROUP!r})
            print(f"acquired restored={{result.context_restored}}", flush=True)
        if word == "yield":
            client.yield_({GROUP!r})
            print("yielded", flush=True)
    """
)


class Job:
    """job-a: its process, and the lines it printed."""

    def __init__(self, *, agent: str, orchestrator: str, mode: str, lease_s: float) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", JOB, "job-a", agent, orchestrator, mode, str(lease_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )

    def expect(self, word: str) -> str:
        """Read lines until one starts with ``word`` (fails if the process ends first)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith(word):
                return line.strip()
        raise AssertionError(f"job-a exited ({self.proc.wait()}) before {word!r}: {self.lines}")

    def say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def cluster(tmp_path: Path, grace_s: float) -> LocalCluster:
    config = tmp_path / "agent.yaml"
    config.write_text(f"backend_settings:\n  app-channel: {{lost_grace_s: {grace_s}}}\n")
    agent = SimAgent(name=NODE, backend="app-channel", extra_args=("--config", str(config)))
    return LocalCluster(agents=[agent], groups={GROUP: (NODE,)}, base_dir=tmp_path / "cluster")


@pytest.fixture
def short_grace(tmp_path: Path) -> Iterator[LocalCluster]:
    with cluster(tmp_path, SHORT_GRACE_S) as running:
        yield running


@pytest.fixture
def long_grace(tmp_path: Path) -> Iterator[LocalCluster]:
    with cluster(tmp_path, LONG_GRACE_S) as running:
        yield running


def job_a(local: LocalCluster, *, mode: str = "yield", agent: str | None = None) -> Job:
    job = Job(
        agent=agent or local.address(NODE),
        orchestrator=local.orchestrator_address,
        mode=mode,
        lease_s=1.0,
    )
    job.expect("ready")
    return job


def job_a_state(client: tslice.Client) -> AgentJobState:
    states = {s.job_id: s.job_state for s in client.status(GROUP).agent_job_states}
    return states["job-a"]


def assert_granted_to_b(client: tslice.Client) -> None:
    """job-b holds the group, and its state is resident: the switch is over."""
    status = client.status(GROUP)
    assert status.group_state is GroupState.LOCKED, status
    assert (status.locking_job, status.loaded_job) == ("job-b", "job-b"), status


def test_a_job_that_closed_its_workload_and_exited_does_not_wedge_the_next_switch(
    short_grace: LocalCluster,
) -> None:
    job = job_a(short_grace)
    try:
        job.say("close")
        job.expect("bye")
        assert job.proc.wait(20) == 0
        with tslice.Client(short_grace.orchestrator_address, job_id="job-b") as client:
            assert client.acquire(GROUP, timeout=ACQUIRE_TIMEOUT_S).success
            assert_granted_to_b(client)
            assert job_a_state(client) is AgentJobState.IDLE  # nothing of job-a resident
            client.yield_(GROUP)
        assert "snapshot" not in job.lines
    finally:
        job.stop()


@pytest.mark.parametrize("mode", ["yield", "hold"])
def test_a_sigkilled_job_does_not_wedge_the_next_switch(
    short_grace: LocalCluster, mode: str
) -> None:
    # "yield": job-a yielded and stays resident (deferred snapshot) when it is killed;
    # "hold": it holds the group, which its lease (1 s) gives back.
    job = job_a(short_grace, mode=mode)
    try:
        with tslice.Client(short_grace.orchestrator_address, job_id="job-b") as client:
            job.kill()
            assert client.acquire(GROUP, timeout=ACQUIRE_TIMEOUT_S).success
            assert_granted_to_b(client)
            assert job_a_state(client) is AgentJobState.IDLE
            client.yield_(GROUP)
    finally:
        job.stop()


def test_a_connection_cut_and_back_within_the_grace_keeps_the_state(
    long_grace: LocalCluster,
) -> None:
    proxy = CuttableProxy(long_grace.address(NODE))
    job = job_a(long_grace, agent=proxy.address)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    # job-b has a workload too, as every job on an app-channel node does: job-a's next
    # turn snapshots it.
    job_b = register_workload(
        long_grace.address(NODE),
        "job-b",
        GROUP,
        on_snapshot=lambda mode, tags: None,
        on_restore=lambda tags: None,
    )
    try:
        assert job_b.wait_registered(20), job_b.error
        with tslice.Client(long_grace.orchestrator_address, job_id="job-b") as client:
            events = client.watch_events(GROUP, kinds=[EventKind.SNAPSHOT_DONE])
            proxy.refuse()
            proxy.cut()  # job-a's process lives on, but cannot reach the agent for now
            acquired = pool.submit(client.acquire, GROUP, timeout=ACQUIRE_TIMEOUT_S)
            proxy.reopen()
            assert acquired.result().success
            assert_granted_to_b(client)
            # job-a's workload was told to snapshot, moved its state, and is SAVED.
            assert job.expect("snapshot") == "snapshot"
            assert job_a_state(client) is AgentJobState.SAVED
            snapshot = next(events)
            assert (snapshot.job_id, snapshot.bytes) == ("job-a", MOVED), snapshot
            events.close()
            client.yield_(GROUP)

            job.say("acquire")  # job-a's next turn brings its state back
            assert job.expect("acquired") == "acquired restored=True"
            assert "restore" in job.lines
            assert job_a_state(client) is AgentJobState.RUNNING
            job.say("yield")
            job.expect("yielded")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        job_b.close()
        job.stop()
        proxy.close()
