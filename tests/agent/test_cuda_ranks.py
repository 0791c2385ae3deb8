"""A multi-GPU job's ranks through the cuda backend (issue 20 §0 multi-rank, §1).

All of a job's processes move together: every process is locked before any is
checkpointed, every checkpoint runs at once (asserted structurally: the calls in flight
together, never by timing), every process comes back before any is unlocked. Ranks that
wait on each other (real processes in a barrier loop, tests/agent/barrier_ranks.py) are
quiesced by their hooks before the first lock, so no lock times out; ranks that hold
NCCL-like communicators without hooks are refused before anything is frozen.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.agent import barrier_ranks
from tslice.agent.backends import base, cuda, cuda_driver, cuda_fake, cuda_settings
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

S = cuda_driver.ProcessState
OFFLOAD = pb.SUSPEND_MODE_OFFLOAD
JOB = "tp-job"


async def eventually(check: Callable[[], bool], *, timeout: float = 30.0) -> None:
    """Wait until ``check()`` holds (it reads state other processes change)."""
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "the condition never held"
        await asyncio.sleep(0.01)


@pytest.fixture
def sleepers(sleeping: Callable[[int], list[int]]) -> list[int]:
    return sleeping(8)


# --------------------------------------------------------------------------- concurrency


async def test_eight_processes_are_checkpointed_and_restored_at_once(
    sleepers: list[int],
) -> None:
    driver = cuda_fake.FakeDriver(copy_bytes_per_s=1e12)
    for pid in sleepers:
        driver.add_process(pid, device_bytes=2**30)
    backend = cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(measure_bytes=False),
        driver=driver,
        registry=registration.ProcessRegistry(),
    )
    config = pb.BackendConfig(
        cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=sleepers))
    )
    saved = await backend.snapshot(base.JobContext(JOB, "g", config), OFFLOAD)
    # Structure, not timing: all eight copies were in flight together, and every
    # process was locked before any was checkpointed.
    assert driver.peak_in_flight["checkpoint"] == 8
    ops = [op for op, _ in driver.calls if op != "get_state"]
    assert ops == ["lock"] * 8 + ["checkpoint"] * 8
    driver.calls.clear()
    await backend.restore(base.JobContext(JOB, "g", state=saved.state))
    assert driver.peak_in_flight["restore"] == 8
    assert [op for op, _ in driver.calls if op != "get_state"] == ["restore"] * 8 + ["unlock"] * 8
    assert all(driver.states[p] is S.RUNNING for p in sleepers)


async def test_parallel_processes_bounds_a_phase(sleepers: list[int]) -> None:
    driver = cuda_fake.FakeDriver(copy_bytes_per_s=1e12)
    for pid in sleepers:
        driver.add_process(pid, device_bytes=2**30)
    backend = cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(measure_bytes=False, parallel_processes=3),
        driver=driver,
        registry=registration.ProcessRegistry(),
    )
    config = pb.BackendConfig(
        cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=sleepers))
    )
    await backend.snapshot(base.JobContext(JOB, "g", config), OFFLOAD)
    assert driver.peak_in_flight["checkpoint"] == 3
    assert all(driver.states[p] is S.CHECKPOINTED for p in sleepers)


# --------------------------------------------------------------------------- ranks


@pytest.fixture
async def agent_socket(tmp_path: Path) -> AsyncIterator[tuple[Path, registration.ProcessRegistry]]:
    registry = registration.ProcessRegistry()
    path = tmp_path / "register.sock"
    server = registration.RegistrationServer(path=path, registry=registry)
    await server.start()
    yield path, registry
    await server.close()


def _stopper(ranks: barrier_ranks.Ranks, log: list[tuple[str, bool]]) -> cuda_fake.FakeDriver:
    """A FakeDriver over the ranks: a lock waits until the rank is out of its collective
    and stops it (SIGSTOP); an unlock lets it go on (SIGCONT)."""
    driver = cuda_fake.FakeDriver(auto_add=True)
    driver.lock_ready = ranks.lock_ready

    def locked(pid: int) -> None:
        log.append(("lock", ranks.all_parked()))
        os.kill(pid, signal.SIGSTOP)

    def unlocked(pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        log.append(("unlock", ranks.all_parked()))

    driver.on_lock = locked
    driver.on_unlock = unlocked
    return driver


async def _started(
    agent_socket: tuple[Path, registration.ProcessRegistry], *, hooks: bool, nccl: bool
) -> AsyncIterator[barrier_ranks.Ranks]:
    path, registry = agent_socket
    runner = barrier_ranks.start(4, job_id=JOB, socket_path=path, hooks=hooks, nccl=nccl)
    ranks = next(runner)
    try:
        assert await asyncio.to_thread(ranks.wait_announced), "the ranks did not announce"
        await eventually(lambda: sorted(registry.pids(JOB)) == sorted(ranks.pids))
        if hooks:
            await eventually(lambda: all(registry.hooks.has(p) for p in ranks.pids))
        await eventually(lambda: min(ranks.rounds()) > 3)  # they are looping
        yield ranks
    finally:
        runner.close()


@pytest.fixture
async def hooked_ranks(
    agent_socket: tuple[Path, registration.ProcessRegistry],
) -> AsyncIterator[barrier_ranks.Ranks]:
    async for ranks in _started(agent_socket, hooks=True, nccl=True):
        yield ranks


@pytest.fixture
async def bare_ranks(
    agent_socket: tuple[Path, registration.ProcessRegistry],
) -> AsyncIterator[barrier_ranks.Ranks]:
    async for ranks in _started(agent_socket, hooks=False, nccl=True):
        yield ranks


async def test_ranks_in_a_barrier_are_checkpointed_and_restored_without_a_lock_timeout(
    hooked_ranks: barrier_ranks.Ranks, agent_socket: tuple[Path, registration.ProcessRegistry]
) -> None:
    _path, registry = agent_socket
    log: list[tuple[str, bool]] = []
    driver = _stopper(hooked_ranks, log)
    backend = cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(measure_bytes=False, lock_timeout_ms=20_000),
        driver=driver,
        registry=registry,
    )
    saved = await backend.snapshot(base.JobContext(JOB, ""), OFFLOAD)
    assert sorted(saved.state["pids"]) == sorted(hooked_ranks.pids)
    assert all(driver.states[p] is S.CHECKPOINTED for p in hooked_ranks.pids)
    # Every rank was parked by its hook before the first lock: none was in a collective.
    assert log == [("lock", True)] * 4
    frozen = hooked_ranks.rounds()
    await backend.restore(base.JobContext(JOB, "", state=saved.state))
    assert all(driver.states[p] is S.RUNNING for p in hooked_ranks.pids)
    # Unlocked while still parked, then resumed: the collectives go on, none hung.
    assert log[4:] == [("unlock", True)] * 4
    await eventually(lambda: min(hooked_ranks.rounds()) > max(frozen) + 3)
    # One lock each, none timed out (a timeout is NOT_READY, retried by the agent).
    assert sorted(p for op, p in driver.calls if op == "lock") == sorted(hooked_ranks.pids)


async def test_ranks_holding_nccl_peers_without_hooks_are_refused_before_anything_is_frozen(
    bare_ranks: barrier_ranks.Ranks, agent_socket: tuple[Path, registration.ProcessRegistry]
) -> None:
    _path, registry = agent_socket
    driver = _stopper(bare_ranks, [])
    backend = cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(measure_bytes=False),
        driver=driver,
        registry=registry,
    )
    with pytest.raises(base.RefusedBackendError) as caught:
        await backend.snapshot(base.JobContext(JOB, ""), OFFLOAD)
    message = str(caught.value)
    assert "NCCL communicators" in message
    assert "announce_process(job_id, quiesce=..., resume=...)" in message
    assert "app-channel" in message
    assert "Nothing was changed" in message
    assert driver.calls == []
    before = bare_ranks.rounds()
    await eventually(lambda: min(bare_ranks.rounds()) > max(before))  # still running


async def test_a_hook_that_cannot_quiesce_refuses_the_snapshot(
    sleepers: list[int],
) -> None:
    class Hooks:
        def __init__(self) -> None:
            self.calls: list[tuple[str, list[int]]] = []

        def has(self, pid: int) -> bool:
            return True

        async def quiesce(self, pids: list[int], *, timeout_s: float) -> None:
            self.calls.append(("quiesce", list(pids)))
            from tslice.agent.channel import quiesce

            raise quiesce.HookError(f"pid {pids[0]}'s quiesce hook failed: busy")

        async def resume(self, pids: list[int], *, timeout_s: float) -> None:
            self.calls.append(("resume", list(pids)))

    registry = registration.ProcessRegistry()
    hooks = Hooks()
    registry.hooks = hooks  # type: ignore[assignment]
    driver = cuda_fake.FakeDriver(auto_add=True)
    backend = cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(measure_bytes=False), driver=driver, registry=registry
    )
    config = pb.BackendConfig(
        cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=sleepers[:2]))
    )
    with pytest.raises(base.RefusedBackendError, match="could not quiesce") as caught:
        await backend.snapshot(base.JobContext(JOB, "g", config), OFFLOAD)
    assert "busy" in str(caught.value)
    assert [op for op, _ in driver.calls if op != "get_state"] == []
    assert hooks.calls == [("quiesce", sleepers[:2]), ("resume", sleepers[:2])]
