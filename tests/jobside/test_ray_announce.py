"""Ray GPU workers announce themselves to their node agent (issue 20 §5), for the cuda backend.

A local Ray with two logical GPUs (none is real: Ray hands out the ids, which is all that
is needed) runs a job's actors: two GPU workers that do what veRL's workers do when verl
loads its plugins (``import tslice.rl.verl``), one GPU actor that makes its Phases
(``tslice.rl.ray.phases``), and a controller without GPUs (as veRL's TaskRunner). The
node agent's registration server (``tslice.agent.channel.registration``, the component of the
agent that the cuda backend reads its processes from) runs in this process on a Unix
socket the actors find through ``$TSLICE_AGENT_REGISTER_SOCKET``, as ``env_vars`` passes
it. The agent must know every GPU worker's PID, with its job and group, and not the
controller's.

Runs in the Ray venv (``make test-ray``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

import tslice.rl.ray  # noqa: E402
from tslice.agent.channel import registration  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings(
        "ignore:subprocess .* is still running:ResourceWarning",
        "ignore::pytest.PytestUnraisableExceptionWarning",
    ),
]


class VerlLikeWorker:
    """A GPU worker as veRL runs it: verl imports its plugins, tslice.rl.verl among them."""

    def __init__(self) -> None:
        import tslice.rl.verl  # noqa: F401 - what `import verl` does in a verl worker

    def pid(self) -> int:
        return os.getpid()


class PhasesActor:
    """A trainer actor that reports its own phases (and holds GPU state itself)."""

    def __init__(self) -> None:
        self.phases = tslice.rl.ray.phases()

    def pid(self) -> int:
        return os.getpid()


class Controller:
    """veRL's TaskRunner: drives the job, holds no GPU."""

    def __init__(self) -> None:
        import tslice.rl.verl

        self.announced = tslice.rl.ray.announce_gpu_worker()

    def pid(self) -> int:
        return os.getpid()

    def result(self) -> Any:
        return self.announced


@pytest.fixture
def agent_registry(tmp_path: Path) -> Iterator[tuple[Path, registration.ProcessRegistry]]:
    """The agent's registration server on its own event loop, in a thread."""
    registry = registration.ProcessRegistry()
    path = tmp_path / "register.sock"
    server = registration.RegistrationServer(path=path, registry=registry)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="agent-registration", daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield path, registry
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture
def local_ray() -> Iterator[None]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if ray.is_initialized():  # left by an earlier module (test_ray_env's Ray lives on)
        ray.shutdown()
    ray.init(
        num_cpus=8,
        num_gpus=3,  # logical: Ray hands out GPU ids; nothing here touches a device
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=100 * 1024**2,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_the_agent_knows_every_gpu_worker_s_pid(
    local_ray: None, agent_registry: tuple[Path, registration.ProcessRegistry]
) -> None:
    path, registry = agent_registry
    # No orchestrator is configured: the workers' announcement does not need one (and
    # the Phases of PhasesActor is then a no-op, which announces nothing).
    env = tslice.rl.ray.env_vars(
        job_id="verl-job", group="pool", environ={"TSLICE_AGENT_REGISTER_SOCKET": str(path)}
    )
    runtime = {"env_vars": env}
    workers = [
        ray.remote(VerlLikeWorker).options(num_gpus=1, runtime_env=runtime).remote()
        for _ in range(2)
    ]
    controller = ray.remote(Controller).options(num_gpus=0, runtime_env=runtime).remote()
    phases_actor = ray.remote(PhasesActor).options(num_gpus=1, runtime_env=runtime).remote()
    worker_pids = ray.get([w.pid.remote() for w in workers])
    phases_pid = ray.get(phases_actor.pid.remote())
    controller_pid = ray.get(controller.pid.remote())

    known = {r.pid: r for r in registry.registrations()}
    for pid in worker_pids:
        assert pid in known, f"GPU worker {pid} was not announced"
        assert (known[pid].job_id, known[pid].group) == ("verl-job", "pool")
    assert phases_pid not in known  # a no-op Phases (no orchestrator) announces nothing
    assert controller_pid not in known  # no GPU: nothing of the job's state is there
    assert ray.get(controller.result.remote()) is None
    assert registry.pids("verl-job") == [p for p in known if p in worker_pids]


def test_an_actor_that_makes_its_phases_is_announced(
    local_ray: None, agent_registry: tuple[Path, registration.ProcessRegistry]
) -> None:
    path, registry = agent_registry
    env = tslice.rl.ray.env_vars(
        job_id="trl-job",
        role="trainer",
        trainer_group="trainer",
        environ={"TSLICE_AGENT_REGISTER_SOCKET": str(path), "TSLICE_ORCHESTRATOR": "127.0.0.1:1"},
    )
    actor = ray.remote(PhasesActor).options(num_gpus=1, runtime_env={"env_vars": env}).remote()
    pid = ray.get(actor.pid.remote())
    known = {r.pid: r for r in registry.registrations()}
    assert pid in known
    assert (known[pid].job_id, known[pid].group) == ("trl-job", "trainer")
