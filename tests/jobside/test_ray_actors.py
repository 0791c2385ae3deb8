"""tslice inside Ray actors: two jobs, each a trainer actor and a sampler actor, on a local Ray.

A real orchestrator and an ``app-channel`` agent run as subprocesses (``stack``); Ray runs
on loopback only. Every actor makes its own client from the environment the driver passes
through ``runtime_env`` (``tslice.rl.ray.env_vars``) and registers itself as the workload
of its group, so the agent moves its state: ``snapshot``/``restore`` flip the actor's
``resident`` flag. Inside every phase the actor asks the orchestrator who holds each
group and notes whether its state is resident; the test then proves, from those records:

- exclusion: while a job is inside a phase, no other job holds any group (in local mode
  the groups share the agent's devices), and the phase's own groups are held by the job;
- residency: the job's state was restored before the phase began;
- every phase of every role ran, and the two jobs took turns (each was snapshotted).

Runs in the Ray venv (``make test-ray``): Ray installs its own protobuf, and the servers
run from ``$TSLICE_SERVER_PYTHON``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

# Before Ray is imported: a local Ray then binds and talks on 127.0.0.1 only (its
# default is the machine's outward-facing address).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

import tslice  # noqa: E402
import tslice.rl.ray  # noqa: E402
from tests.jobside.stack import Stack, running_stack  # noqa: E402
from tslice.client import EventKind  # noqa: E402
from tslice.rl import Phase, phase_groups  # noqa: E402

# Ray's own processes (raylet, GCS, workers) can still be running when Ray drops its Popen
# objects at shutdown; their ResourceWarning is Ray's, not tslice's (seen once in CI after a
# slow Ray start).
RAY_POPEN = pytest.mark.filterwarnings(
    "ignore:subprocess .* is still running:ResourceWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning",
)
pytestmark = [pytest.mark.timeout(300), RAY_POPEN]

GROUPS = ("trainer", "sampler")
STEPS = 3


class JobActor:
    """One side (role) of an RL job; its phase bodies only record what they observe."""

    def __init__(self) -> None:
        self.resident = True  # the workload's state, as the agent last left it
        self.snapshots = 0
        self.restores = 0
        self.records: list[dict[str, Any]] = []
        self.phases = tslice.rl.ray.phases(workload=self)
        self.client = tslice.rl.ray.client()

    # The workload (duck-typed adapter): the agent calls these on the handle's thread.
    def snapshot(self, mode: str, tags: list[str]) -> None:
        self.resident = False
        self.snapshots += 1

    def restore(self, tags: list[str]) -> None:
        self.resident = True
        self.restores += 1

    def _observe(self, what: str, step: int, groups: tuple[str, ...]) -> None:
        self.records.append(
            {
                "job": self.phases.job_id,
                "role": self.phases.role.value,
                "what": what,
                "step": step,
                "groups": groups,
                "holders": {g: self.client.status(g).locking_job for g in GROUPS},
                "resident": self.resident,
                "pid": os.getpid(),
            }
        )

    def run(self, phase: str, step: int = 0) -> None:
        """``phase`` as a ``with`` block around a body that observes."""
        with self.phases.phase(phase):
            self._observe(phase, step, self.phases.groups_for(phase))

    def begin(self, phase: str, step: int = 0) -> dict[str, Any]:
        """Hook style: the phase stays open after the call returns."""
        grants = self.phases.begin(phase)
        self._observe(phase, step, self.phases.groups_for(phase))
        epochs = {group: grant.grant_epoch for group, grant in grants.items()}
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        return {"pid": os.getpid(), "epochs": epochs, "restarted": restarted}

    def end(self, phase: str) -> None:
        self.phases.end(phase)

    def receive_weights(self, step: int) -> None:
        """The sampler's receiving end of weight_sync: it holds nothing itself, the
        trainer holds both groups around it."""
        self._observe("receive_weights", step, phase_groups("trainer", "weight_sync", *GROUPS))

    def report(self) -> dict[str, Any]:
        return {"records": self.records, "snapshots": self.snapshots, "restores": self.restores}

    def crash(self) -> None:
        """Die as a crashed trainer does: no phase ended, no client closed."""
        os._exit(1)

    def close(self) -> None:
        tslice.rl.ray.close()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # The actor class lives in this test module, which Ray's workers cannot import.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        num_cpus=8,  # logical: each actor reserves one; the machine has two cores
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=100 * 1024**2,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def _actor(stack: Stack, job: str, role: str, **options: Any) -> Any:
    env = tslice.rl.ray.env_vars(job_id=job, role=role, environ=stack.env(job))
    return ray.remote(JobActor).options(runtime_env={"env_vars": env}, **options).remote()


def _run_job(trainer: Any, sampler: Any, failures: list[BaseException]) -> None:
    """One job's synchronous RL loop, driven from the driver as veRL's controller does."""
    try:
        for step in range(STEPS):
            ray.get(sampler.run.remote("generate", step))
            ray.get(trainer.run.remote("train", step))
            ray.get(trainer.begin.remote("weight_sync", step))
            ray.get(sampler.receive_weights.remote(step))
            ray.get(trainer.end.remote("weight_sync"))
        ray.get([sampler.run.remote("eval", STEPS), trainer.run.remote("save", STEPS)])
    except BaseException as exc:
        failures.append(exc)


def test_two_jobs_of_trainer_and_sampler_actors_take_turns(local_ray: None, tmp_path: Any) -> None:
    with running_stack(tmp_path, groups=GROUPS, backend="app-channel") as stack:
        jobs = {
            job: (_actor(stack, job, "trainer"), _actor(stack, job, "sampler"))
            for job in ("job-a", "job-b")
        }
        # Every actor loads its model first, so that the two loops start together.
        ray.get([actor.run.remote("init") for pair in jobs.values() for actor in pair])
        failures: list[BaseException] = []
        threads = [
            threading.Thread(target=_run_job, args=(*pair, failures), name=job)
            for job, pair in jobs.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        reports = {
            (job, role): ray.get(actor.report.remote())
            for job, pair in jobs.items()
            for role, actor in zip(("trainer", "sampler"), pair, strict=True)
        }
        ray.get([actor.close.remote() for pair in jobs.values() for actor in pair])
        assert not failures, failures

    records = [r for report in reports.values() for r in report["records"]]
    for r in records:
        others = {g: h for g, h in r["holders"].items() if h not in ("", r["job"])}
        assert not others, f"{r['job']} {r['role']} in {r['what']} while another job held {others}"
        for group in r["groups"]:
            assert r["holders"][group] == r["job"], f"{r} ran without holding {group}"
        assert r["resident"], f"{r['job']} {r['role']} ran {r['what']} with its state not restored"

    ran = Counter((r["job"], r["role"], r["what"]) for r in records)
    for job in ("job-a", "job-b"):
        expected = {
            (job, "trainer", "init"): 1,
            (job, "sampler", "init"): 1,
            (job, "sampler", "generate"): STEPS,
            (job, "trainer", "train"): STEPS,
            (job, "trainer", "weight_sync"): STEPS,
            (job, "sampler", "receive_weights"): STEPS,
            (job, "sampler", "eval"): 1,
            (job, "trainer", "save"): 1,
        }
        assert {k: ran[k] for k in expected} == expected
        # Both loops asked for the sampler group together: the agent had to move each
        # job's state out for the other at least once.
        assert sum(reports[(job, role)]["snapshots"] for role in ("trainer", "sampler")) >= 1

    # Each actor ran in its own process (a client per actor process).
    assert len({r["pid"] for r in records}) == 4
    assert {p.value for p in Phase} == {r["what"] for r in records} - {"receive_weights"}


def test_a_restarted_actor_rejoins_its_jobs_grant(local_ray: None, tmp_path: Any) -> None:
    """Ray restarts an actor that crashed inside a phase: the new incarnation (a new process,
    a new client) re-enters the phase and is granted at once, in the same grant, while the
    other job keeps waiting; the other job gets the group only when the phase ends."""
    with running_stack(tmp_path, groups=GROUPS, backend="app-channel") as stack:
        env_a = {**stack.env("job-a"), "TSLICE_LEASE_S": "300"}  # no expiry during the test
        a = (
            ray.remote(JobActor)
            .options(
                runtime_env={"env_vars": tslice.rl.ray.env_vars(role="trainer", environ=env_a)},
                max_restarts=1,
            )
            .remote()
        )
        b = _actor(stack, "job-b", "trainer")
        with tslice.Client(stack.address, job_id=None) as watcher:
            events = watcher.watch_events("trainer", kinds=(EventKind.QUEUED,))
            first = ray.get(a.begin.remote("train"))
            b_train = b.run.remote("train")
            # job-b waits behind job-a (job-a's own acquire was queued for a moment too)
            next(e for e in events if e.job_id == "job-b")
            events.close()

            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(a.crash.remote())
            # A call made while Ray restarts the actor is retried until the new one runs it.
            again = ray.get(a.begin.options(max_task_retries=-1).remote("train"))
            assert again["restarted"] and not first["restarted"]
            assert again["pid"] != first["pid"]
            assert again["epochs"] == first["epochs"]  # the same grant: job-b never got it
            held = watcher.status("trainer")
            assert held.locking_job == "job-a" and "job-b" in held.waiting_jobs

            ray.get(a.end.remote("train"))
            ray.get(b_train)
            (b_record,) = ray.get(b.report.remote())["records"]
            assert b_record["holders"]["trainer"] == "job-b"
            assert watcher.status("trainer").grant_epoch > first["epochs"]["trainer"]
        ray.get([a.close.remote(), b.close.remote()])
