"""Parts of ``bench/gpu_check.py`` that drive the ``cuda`` backend on real processes.

1. **One process** (``cuda_part``): a child PyTorch process fills ``--size-gib`` of
   device memory with random integers, records a fingerprint and announces itself to a
   registration socket (SO_PEERCRED); ``--reps`` cycles of snapshot and restore check
   that NVML saw the memory held before and released after (and that the backend
   verified it), that the data is bit-exact, that a second restore is a no-op, that a
   restarted agent reads the job back as SAVED, and that a host budget smaller than the
   job's state refuses its snapshot before anything is frozen.
2. **Ranks** (``ranks_part``): ``--ranks`` processes of one job on the same GPU,
   checkpointed all at once (the default) and one at a time (``parallel_processes=1``),
   bit-exact both ways.

In ``--simulate`` mode the children hold CPU tensors and the FakeDriver and FakeNvml
stand for the GPU (with a 10 GB/s link per process), to check the script anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gpu_check_report import GIB, Report, Row

JOB_ID = "gpu-check"
#: The children run from the source tree too, whatever the installed tslice.
SRC = str(Path(__file__).resolve().parent.parent / "src")
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"

# A job's process whose CUDA state is checkpointed: it never knows it happens.
CHILD = textwrap.dedent("""\
    import json, sys
    import torch
    from tslice.workload import process

    device, total, count, job = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    per = max(1, total // count // 4)
    gen = torch.Generator(device=device).manual_seed(1234)
    tensors = [torch.randint(-2**31, 2**31 - 1, (per,), dtype=torch.int32, device=device,
                             generator=gen) for _ in range(count)]
    index = torch.arange(per, dtype=torch.int64, device=device)

    def fingerprint():
        out = []
        for t in tensors:
            wide = t.to(torch.int64)
            out.append([int(wide.sum()), int((wide * index).sum())])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return out

    first = fingerprint()
    pid = process.announce_process(job)
    print(json.dumps({"pid": pid, "bytes": per * 4 * count, "fingerprint": first}), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print(json.dumps({"fingerprint": fingerprint()}), flush=True)
        else:
            break
""")


@dataclasses.dataclass
class Child:
    proc: asyncio.subprocess.Process
    pid: int
    nbytes: int
    fingerprint: Any

    async def check(self) -> bool:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"check\n")
        await self.proc.stdin.drain()
        return bool((await _read_json(self.proc.stdout, 120))["fingerprint"] == self.fingerprint)


async def _read_json(stream: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    line = await asyncio.wait_for(stream.readline(), timeout=timeout)
    if not line:
        raise RuntimeError("a GPU job exited early (see its stderr above)")
    data: dict[str, Any] = json.loads(line)
    return data


@contextlib.asynccontextmanager
async def children(
    count: int, nbytes: int, tensors: int, device: str, job: str
) -> AsyncIterator[tuple[Any, list[Child]]]:
    """A registration server and ``count`` children announced to it: (registry, children)."""
    from tslice.agent.channel import registration

    workdir = Path(tempfile.mkdtemp(prefix="tslice-gpu-check-"))
    registry = registration.ProcessRegistry()
    server = registration.RegistrationServer(path=workdir / "register.sock", registry=registry)
    await server.start()
    env = {**os.environ, registration.SOCKET_ENV: str(server.path)}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    procs: list[asyncio.subprocess.Process] = []
    try:
        for _ in range(count):
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    CHILD,
                    device,
                    str(nbytes),
                    str(tensors),
                    job,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    env=env,
                )
            )
        made = []
        for proc in procs:
            assert proc.stdout is not None
            ready = await _read_json(proc.stdout, 180)
            made.append(Child(proc, int(ready["pid"]), int(ready["bytes"]), ready["fingerprint"]))
        yield registry, made
    finally:
        for proc in procs:
            if proc.returncode is None:
                assert proc.stdin is not None
                proc.stdin.write(b"exit\n")
                try:
                    await asyncio.wait_for(proc.wait(), timeout=30)
                except asyncio.TimeoutError:
                    proc.kill()
                    await proc.wait()
        await server.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _node(simulate: bool, kids: list[Child]) -> tuple[Any, Any]:
    """(nvml, driver): fakes in ``--simulate`` (a 10 GB/s link per process), else the
    real NVML (None where missing) and None (the backend picks the driver)."""
    from tslice.agent import nvml as nvml_mod
    from tslice.agent.backends import cuda_fake

    if simulate:
        nvml = nvml_mod.FakeNvml([nvml_mod.FakeGpu(GPU0)])
        driver = cuda_fake.FakeDriver(nvml=nvml, copy_bytes_per_s=10e9)
        for kid in kids:
            nvml.gpus[0].compute[kid.pid] = kid.nbytes
            driver.add_process(kid.pid)
        return nvml, driver
    try:
        return nvml_mod.open_nvml(), None
    except nvml_mod.NvmlUnavailableError:
        return None, None


def _backend(registry: Any, nvml: Any, driver: Any, **settings: Any) -> Any:
    from tslice.agent.backends import cuda, cuda_settings

    return cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(**settings), driver=driver, nvml=nvml, registry=registry
    )


def _held(nvml: Any, pid: int) -> int | None:
    from tslice.agent import discovery

    if nvml is None:
        return None
    return discovery.device_bytes_by_pid(discovery.gpu_processes(nvml)).get(pid, 0)


def released(held: int | None, left: int | None) -> bool:
    """NVML proves a release only where it measured memory held before and none after
    (``left == 0`` alone passed when NVML measured nothing at all)."""
    return bool(held) and left == 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


async def cuda_part(args: argparse.Namespace, report: Report) -> None:
    from tslice.agent.backends import base
    from tslice.agent.moves import parking
    from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

    device = "cpu" if args.simulate else "cuda"
    async with children(1, int(args.size_gib * GIB), args.tensors, device, JOB_ID) as (
        registry,
        kids,
    ):
        (kid,) = kids
        report.check(
            "registration: peer pid is the GPU job",
            registry.pids(JOB_ID) == [kid.proc.pid],
            f"registered {registry.pids(JOB_ID)}, child {kid.proc.pid}",
        )
        nvml, driver = _node(args.simulate, kids)
        if nvml is None:
            report.environment["nvml"] = "unavailable: the release checks cannot be made"
        backend = _backend(registry, nvml, driver)
        try:
            await backend.check_health()
        except base.BackendUnavailableError as exc:
            report.check("cuda backend available", False, str(exc))
            return
        ctx = base.JobContext(job_id=JOB_ID, group="gpu-check")

        # The host budget: a state larger than the budget is refused before it is frozen.
        needed = await backend.host_bytes_needed(ctx)
        budget = parking.HostBudget(budget_bytes=max(1, (needed or kid.nbytes) // 2))
        why = budget.refusal([], key=(JOB_ID, "gpu-check"), needed=needed or 0, counted={"cuda"})
        report.check(
            "host budget: a state beyond it is refused, nothing frozen",
            bool(why) and needed is not None and await kid.check(),
            f"NVML estimate {needed} bytes; {why[:120] or 'not refused'}",
        )

        snaps: list[float] = []
        restores: list[float] = []
        noops: list[float] = []
        moved: list[int] = []
        for rep in range(args.reps):
            held = _held(nvml, kid.pid)
            t0 = time.perf_counter()
            saved = await backend.snapshot(ctx, pb.SUSPEND_MODE_OFFLOAD)
            snaps.append(time.perf_counter() - t0)
            report.environment["checkpoint driver"] = saved.state["driver"]
            moved.append(saved.device_bytes or kid.nbytes)
            left = _held(nvml, kid.pid)
            if left is not None:
                report.check(
                    f"cycle {rep + 1}: device memory held before, released after",
                    released(held, left),
                    f"{held} bytes before, {left} after",
                )
            report.check(
                f"cycle {rep + 1}: the backend verified the release",
                saved.state.get("released") == "verified",
                str(saved.state.get("released")),
            )
            ctx = dataclasses.replace(ctx, state=json.loads(json.dumps(saved.state)))
            if rep == 0:
                restarted = _backend(registry, nvml, driver)
                state = await restarted.recover(ctx)
                report.check(
                    "agent restart: checkpointed job reads back SAVED",
                    state == pb.JOB_STATE_SAVED,
                    f"recover() -> {state}",
                )
                backend = restarted
            t0 = time.perf_counter()
            back = await backend.restore(ctx)
            restores.append(time.perf_counter() - t0)
            ctx = dataclasses.replace(ctx, state=json.loads(json.dumps(back.state)))
            report.check(f"cycle {rep + 1}: data bit-exact after restore", await kid.check())
            t0 = time.perf_counter()
            again = await backend.restore(ctx)
            noops.append(time.perf_counter() - t0)
            report.check(
                f"cycle {rep + 1}: restore of a running job is a no-op",
                again.device_bytes == 0 and await kid.check(),
            )
        nbytes = int(statistics.median(moved))
        note = f"driver={report.environment['checkpoint driver']}, median of {args.reps}"
        report.rows += [
            Row("cuda snapshot (lock+checkpoint)", _median(snaps), nbytes, note),
            Row("cuda restore (restore+unlock)", _median(restores), nbytes, note),
            Row("cuda restore of running job", _median(noops), 0, "no-op by design"),
        ]
        await backend.close()


async def ranks_part(args: argparse.Namespace, report: Report) -> None:
    """``--ranks`` processes of one job on one GPU: together against one at a time."""
    from tslice.agent.backends import base
    from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

    device = "cpu" if args.simulate else "cuda"
    each = int(args.size_gib * GIB) // args.ranks
    job = f"{JOB_ID}-ranks"
    async with children(args.ranks, each, args.tensors, device, job) as (registry, kids):
        nvml, driver = _node(args.simulate, kids)
        times: dict[int, tuple[list[float], list[float]]] = {0: ([], []), 1: ([], [])}
        total = sum(kid.nbytes for kid in kids)
        for rep in range(args.reps):
            for parallel in (0, 1):
                backend = _backend(registry, nvml, driver, parallel_processes=parallel)
                ctx = base.JobContext(job_id=job, group="gpu-check")
                t0 = time.perf_counter()
                saved = await backend.snapshot(ctx, pb.SUSPEND_MODE_OFFLOAD)
                times[parallel][0].append(time.perf_counter() - t0)
                ctx = dataclasses.replace(ctx, state=json.loads(json.dumps(saved.state)))
                t0 = time.perf_counter()
                await backend.restore(ctx)
                times[parallel][1].append(time.perf_counter() - t0)
                exact = all([await kid.check() for kid in kids])
                report.check(
                    f"ranks, cycle {rep + 1} ({'together' if parallel == 0 else 'one at a time'})"
                    ": every rank bit-exact",
                    exact,
                )
                await backend.close()
        note = f"{args.ranks} processes on one GPU, median of {args.reps}"
        for parallel, label in ((0, "together"), (1, "one at a time")):
            snap, rest = times[parallel]
            report.rows += [
                Row(f"ranks snapshot, {label}", _median(snap), total, note),
                Row(f"ranks restore, {label}", _median(rest), total, note),
            ]
        together = _median(times[0][0]) + _median(times[0][1])
        serial = _median(times[1][0]) + _median(times[1][1])
        if together:
            report.environment["ranks one at a time / together"] = f"{serial / together:.2f}x"
