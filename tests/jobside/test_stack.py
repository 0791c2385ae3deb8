"""Smoke tests of the fixture: the job-side client against real server processes."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from concurrent import futures

import tslice
from tests.jobside.stack import Stack, running_stack
from tslice.client import EventKind


def test_acquire_and_yield_through_the_client(stack: Stack) -> None:
    with tslice.Client(stack.address, job_id="job-a") as client:
        assert sorted(client.list_groups()) == ["sampler", "trainer"]
        assert client.acquire("trainer").success
        assert client.status("trainer").locking_job == "job-a"
        assert client.yield_("trainer").success
        assert client.status("trainer").locking_job == ""


def test_a_waiter_is_granted_when_the_holder_yields(tmp_path: pathlib.Path) -> None:
    # noop agent: the switch from job-a to job-b needs no registered workload.
    with (
        running_stack(tmp_path, groups=("trainer",), backend="noop") as stack,
        tslice.Client(stack.address, job_id="job-a") as a,
        tslice.Client(stack.address, job_id="job-b") as b,
        futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        assert a.acquire("trainer").success
        events = a.watch_events("trainer", kinds=[EventKind.QUEUED], timeout=60)
        waiting = pool.submit(b.acquire, "trainer", timeout=60)
        queued = next(events)  # subscribed before the acquire: the event is not missed
        assert queued.job_id == "job-b"
        assert not waiting.done()
        assert a.yield_("trainer").pending_waiters == 1
        assert waiting.result(60).success
        assert b.status("trainer").locking_job == "job-b"
        b.yield_("trainer")


def test_a_job_process_finds_the_stack_from_its_environment(stack: Stack) -> None:
    script = (
        "import tslice\n"
        "with tslice.Client() as client:\n"  # address and job id from the environment
        "    client.acquire('sampler')\n"
        "    print(client.status('sampler').locking_job)\n"
        "    client.yield_('sampler')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=stack.env("job-env"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "job-env"
    env = stack.env("job-env")
    assert env["TIMESLICE_TRAINER_GROUP"] == "trainer"
    assert env["TIMESLICE_SAMPLER_GROUP"] == "sampler"
    assert env["TSLICE_AGENT"] == stack.agent_address
