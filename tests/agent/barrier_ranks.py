"""A test workload whose ranks wait on each other: N real processes in a loop of barriers.

Each rank stands for one GPU process of a multi-GPU job: a round of the loop is a
collective (every rank waits in ``barrier.wait()`` until all arrived), and
``in_collective[rank]`` says that the rank is inside one (a CUDA call in flight that
only completes when every peer has joined). The FakeDriver's lock waits for that to
clear, as the real driver waits for a process's calls in flight; a locked rank is
stopped (SIGSTOP), so a peer waiting for it in a collective never gets out.

Quiesce hooks (``announce_process(..., quiesce=, resume=)``) park every rank at the
same round: the barrier's action, run once per round by the last rank to arrive, turns
"a quiesce was asked" into "every rank parks after this round", so no rank is left in a
round the others never join. Optionally each rank maps an NCCL-like shared-memory
segment (``/dev/shm/nccl-*``), as NCCL's intra-node transports do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import multiprocessing
import os
import signal
import uuid
from collections.abc import Iterator
from multiprocessing.sharedctypes import Synchronized, SynchronizedArray
from pathlib import Path
from typing import Any

from tslice.workload import process

CTX = multiprocessing.get_context("spawn")


@dataclasses.dataclass
class Shared:
    """What the ranks and the test share."""

    size: int
    barrier: Any
    asked: Synchronized[int]
    decided: Synchronized[int]
    in_collective: SynchronizedArray[int]
    rounds: SynchronizedArray[int]
    parked: list[Any]
    go_on: list[Any]
    announced: list[Any]

    @classmethod
    def make(cls, size: int) -> Shared:
        asked = CTX.Value("i", 0)
        decided = CTX.Value("i", 0)
        return cls(
            size=size,
            barrier=CTX.Barrier(size, action=_Decide(asked, decided)),
            asked=asked,
            decided=decided,
            in_collective=CTX.Array("i", size),
            rounds=CTX.Array("i", size),
            parked=[CTX.Event() for _ in range(size)],
            go_on=[CTX.Event() for _ in range(size)],
            announced=[CTX.Event() for _ in range(size)],
        )


class _Decide:
    """The barrier action (picklable): what was asked when the round completed."""

    def __init__(self, asked: Any, decided: Any) -> None:
        self.asked = asked
        self.decided = decided

    def __call__(self) -> None:
        self.decided.value = self.asked.value


@dataclasses.dataclass(frozen=True)
class RankArgs:
    rank: int
    job_id: str
    socket_path: str
    hooks: bool
    nccl_shm: str


def rank_main(args: RankArgs, shared: Shared) -> None:
    rank, job_id, socket_path, hooks, nccl_shm = (
        args.rank,
        args.job_id,
        args.socket_path,
        args.hooks,
        args.nccl_shm,
    )
    segment = None
    if nccl_shm:
        # What NCCL's SHM/P2P transports leave in a rank's address space.
        fd = os.open(nccl_shm, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        segment = mmap.mmap(fd, 4096)
        os.close(fd)

    def quiesce() -> None:
        shared.asked.value = 1
        if not shared.parked[rank].wait(60):
            raise TimeoutError(f"rank {rank} did not park within 60 s")

    def resume() -> None:
        shared.asked.value = 0
        shared.parked[rank].clear()
        shared.go_on[rank].set()

    if hooks:
        process.announce_process(job_id, socket_path=socket_path, quiesce=quiesce, resume=resume)
    else:
        process.announce_process(job_id, socket_path=socket_path)
    shared.announced[rank].set()
    while True:
        shared.in_collective[rank] = 1
        shared.barrier.wait()
        shared.in_collective[rank] = 0
        shared.rounds[rank] += 1
        if shared.decided.value:
            shared.go_on[rank].clear()
            shared.parked[rank].set()
            shared.go_on[rank].wait()
    del segment  # (never reached: the test kills the ranks)


@dataclasses.dataclass
class Ranks:
    shared: Shared
    procs: list[Any]

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def rank_of(self, pid: int) -> int:
        return self.pids.index(pid)

    def lock_ready(self, pid: int) -> bool:
        return self.shared.in_collective[self.rank_of(pid)] == 0

    def all_parked(self) -> bool:
        return all(event.is_set() for event in self.shared.parked)

    def rounds(self) -> list[int]:
        return list(self.shared.rounds)

    def wait_announced(self, timeout: float = 60) -> bool:
        return all(event.wait(timeout) for event in self.shared.announced)


def start(
    size: int, *, job_id: str, socket_path: Path, hooks: bool, nccl: bool = False
) -> Iterator[Ranks]:
    """Start ``size`` ranks (a generator for a fixture: killed at the end)."""
    shared = Shared.make(size)
    segments = [
        f"/dev/shm/nccl-tslice-test-{uuid.uuid4().hex[:8]}" if nccl else "" for _ in range(size)
    ]
    procs = [
        CTX.Process(
            target=rank_main,
            args=(RankArgs(rank, job_id, str(socket_path), hooks, segments[rank]), shared),
            daemon=True,
        )
        for rank in range(size)
    ]
    for proc in procs:
        proc.start()
    try:
        yield Ranks(shared, procs)
    finally:
        for proc in procs:
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.join(10)
        for name in segments:
            if name:
                Path(name).unlink(missing_ok=True)
