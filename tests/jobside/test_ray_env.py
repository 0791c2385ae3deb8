"""``tslice.rl.ray`` without Ray: the driver's env_vars, one Phases per process, no pickling.

Ray itself is not needed (the module never imports it); the actors' side runs against a
real orchestrator and agent in ``test_ray_actors.py``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator

import pytest

import tslice
import tslice.rl.ray
from tests.jobside.stack import Stack
from tslice.common import errors
from tslice.workload import CallbackAdapter

# Ray's own processes (raylet, GCS, workers) can still be running when Ray drops its Popen
# objects at shutdown; their ResourceWarning is Ray's, not tslice's (seen once in CI after a
# slow Ray start).
RAY_POPEN = pytest.mark.filterwarnings(
    "ignore:subprocess .* is still running:ResourceWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning",
)
pytestmark = RAY_POPEN

_ENV_PREFIXES = ("TSLICE_", "TIMESLICE_", "SNAPSHOT_AGENT_ADDR")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No stray variable of the outer environment, and no Phases left from another test."""
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) and name != "TSLICE_SERVER_PYTHON":
            monkeypatch.delenv(name)
    tslice.rl.ray.close()
    yield
    tslice.rl.ray.close()


def test_env_vars_forwards_the_drivers_tslice_variables_and_nothing_else() -> None:
    driver = {
        "TIMESLICE_ORCH_ADDR": "orch:50051",
        "TIMESLICE_JOB_ID": "job-a",
        "TIMESLICE_TRAINER_GROUP": "trainers",
        "TSLICE_LEASE_S": "60",
        "TSLICE_AGENT": "unix:/run/tslice/agent.sock",
        "TSLICE_GROUP": " ",  # blank: not forwarded
        "HOME": "/root",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert tslice.rl.ray.env_vars(environ=driver) == {
        "TIMESLICE_ORCH_ADDR": "orch:50051",
        "TIMESLICE_JOB_ID": "job-a",
        "TIMESLICE_TRAINER_GROUP": "trainers",
        "TSLICE_LEASE_S": "60",
        "TSLICE_AGENT": "unix:/run/tslice/agent.sock",
    }


def test_env_vars_arguments_win_in_both_spellings() -> None:
    driver = {"TSLICE_JOB_ID": "stale", "TIMESLICE_SAMPLER_GROUP": "old-pool"}
    env = tslice.rl.ray.env_vars(
        "job-b",
        address="127.0.0.1:50051",
        trainer_group="gpu-train",
        sampler_group="gpu-roll",
        role="sampler",
        agent="127.0.0.1:9001",
        environ=driver,
    )
    assert env["TSLICE_JOB_ID"] == env["TIMESLICE_JOB_ID"] == "job-b"
    assert env["TSLICE_ORCHESTRATOR"] == env["TIMESLICE_ORCH_ADDR"] == "127.0.0.1:50051"
    assert env["TSLICE_TRAINER_GROUP"] == env["TIMESLICE_TRAINER_GROUP"] == "gpu-train"
    assert env["TSLICE_SAMPLER_GROUP"] == env["TIMESLICE_SAMPLER_GROUP"] == "gpu-roll"
    assert env["TSLICE_ROLE"] == "sampler"
    assert env["TSLICE_AGENT"] == env["TSLICE_AGENT_ADDR"] == "127.0.0.1:9001"
    assert all(isinstance(v, str) for v in env.values())  # what Ray's runtime_env accepts
    hybrid = tslice.rl.ray.env_vars("job-c", group="gpus", environ={})
    assert hybrid["TSLICE_GROUP"] == hybrid["TIMESLICE_GROUP"] == "gpus"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"job_id": "job a"}, "job_id="),
        ({"trainer_group": ""}, "trainer_group="),
        ({"group": "a b"}, "group="),
        ({"role": "learner"}, "unknown role 'learner'"),
        ({"address": " "}, "address= is empty"),
    ],
)
def test_env_vars_refuses_bad_settings_in_the_driver(kwargs: dict[str, str], says: str) -> None:
    with pytest.raises(tslice.TsliceError, match=says):
        tslice.rl.ray.env_vars(environ={}, **kwargs)  # type: ignore[arg-type]


def test_one_phases_and_one_client_per_process_in_noop_mode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    phases = tslice.rl.ray.phases(role="sampler")
    assert not phases.enabled
    assert tslice.rl.ray.phases() is phases
    assert tslice.rl.ray.phases(role="sampler") is phases
    assert phases.client is tslice.rl.ray.client()
    with pytest.raises(errors.ConfigError, match="one process plays one role"):
        tslice.rl.ray.phases(role="trainer")
    with phases.phase("generate"):  # no-op: runs the block
        pass
    tslice.rl.ray.close()
    assert tslice.rl.ray.phases(role="trainer") is not phases


def test_a_forked_child_makes_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tslice.rl.ray.phases()
    monkeypatch.setattr(os, "getpid", lambda: -1)  # what a forked child sees
    child = tslice.rl.ray.phases()
    assert child is not parent and child.client is not parent.client


def test_the_process_phases_take_groups_from_the_environment(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in tslice.rl.ray.env_vars(role="trainer", environ=stack.env("job-r")).items():
        monkeypatch.setenv(name, value)
    snapshots: list[str] = []
    workload = CallbackAdapter(
        on_snapshot=lambda m, t: snapshots.append(m), on_restore=lambda t: None
    )
    phases = tslice.rl.ray.phases(workload=workload)
    assert phases.enabled and phases.role.value == "trainer"
    with tslice.Client(stack.address, job_id=None) as observer:
        phases.begin("train")
        assert observer.status("trainer").locking_job == "job-r"
        tslice.rl.ray.close()  # what runs at exit: open phases end, the client closes
        assert observer.status("trainer").locking_job == ""
    assert tslice.rl.ray.phases() is not phases


def test_a_client_refuses_pickling_and_says_where_to_make_it() -> None:
    """Ray pickles what an actor receives or closes over; a client must be made in the
    actor instead, and the error says so (not 'cannot pickle _thread.lock')."""
    with tslice.Client("127.0.0.1:1", job_id="job-p") as client:
        with pytest.raises(TypeError, match=r"create it in the process that uses it"):
            pickle.dumps(client)
        with pytest.raises(TypeError, match=r"tslice\.rl\.ray"):
            pickle.dumps(tslice.rl.Phases(client=client))
