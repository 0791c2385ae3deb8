"""GPU check: the cuda backend and the TorchAdapter on a real GPU, in one run (< 5 min on an H200).

1. **cuda backend.** A child PyTorch process fills ``--size-gib`` of device memory
   with random integers, records a fingerprint of them and announces itself to a
   registration socket (SO_PEERCRED). Through :class:`tslice.agent.backends.cuda.CudaBackend`
   (cuda-bindings, else ``cuda-checkpoint``) the check then runs ``--reps`` cycles of
   lock → checkpoint (snapshot) and restore → unlock, and checks that NVML shows the
   child's memory gone while it is checkpointed, that the fingerprint is unchanged
   after each restore, that a second restore is a no-op, and, on the first cycle,
   that a *new* backend instance (an agent restart) reads the job back as SAVED and
   restores it.
2. **TorchAdapter** (``tslice.workload.adapters.torch``, skipped if missing):
   offload and restore of a module holding the same bytes, bit-exact, against
   plain PyTorch copies into pinned host buffers (``non_blocking=True``) of the
   same tensors.
3. **Overlapped switch** (issue 9 §2, ``bench/torch_overlap.py``): two jobs of
   ``--size-gib`` take turns, sequentially (snapshot, then restore) and overlapped
   (progressive offload on one side, restore on the other within one state's memory),
   both bit-exact.

It prints a table (or one JSON object with ``--json``) and exits 0 if every check
passed, 1 if one failed, 2 if there is no GPU. ``--simulate`` runs the same flow on
CPU tensors with the in-memory FakeDriver, to check the script itself anywhere.

    PYTHONPATH=src python3 bench/gpu_check.py [--size-gib 8] [--tensors 32] [--reps 3] [--json]

On a machine with the NVIDIA driver >= 570, PyTorch with CUDA, cuda-bindings (or
cuda-checkpoint on PATH) and nvidia-ml-py; tslice's own dependencies (protobuf,
grpcio, pydantic) must be importable.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

GIB = 1024**3
JOB_ID = "gpu-check"
#: The child runs from the source tree too, whatever the installed tslice.
SRC = str(Path(__file__).resolve().parent.parent / "src")

# The job whose CUDA state is checkpointed: it never knows it happens.
CHILD = textwrap.dedent("""\
    import json, sys
    import torch
    from tslice.workload import process

    device, total, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
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
    pid = process.announce_process(sys.argv[4])
    print(json.dumps({"pid": pid, "bytes": per * 4 * count, "fingerprint": first}), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print(json.dumps({"fingerprint": fingerprint()}), flush=True)
        else:
            break
""")


@dataclasses.dataclass
class Row:
    name: str
    seconds: float | None = None
    nbytes: int | None = None
    note: str = ""

    @property
    def gbps(self) -> float | None:
        if not self.seconds or not self.nbytes:
            return None
        return self.nbytes / self.seconds / 1e9


@dataclasses.dataclass
class Report:
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    rows: list[Row] = dataclasses.field(default_factory=list)
    checks: list[tuple[str, bool, str]] = dataclasses.field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        return bool(ok)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=8.0, help="device bytes per part (GiB)")
    parser.add_argument("--tensors", type=int, default=32, help="tensors holding them")
    parser.add_argument("--reps", type=int, default=3, help="measured cycles per part")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="CPU tensors and the FakeDriver: checks the script, measures nothing",
    )
    parser.add_argument("--skip-cuda", action="store_true", help="skip part 1")
    parser.add_argument("--skip-torch", action="store_true", help="skip part 2")
    parser.add_argument("--skip-overlap", action="store_true", help="skip part 3")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


# --------------------------------------------------------------------------- part 1


async def _read_json(stream: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    line = await asyncio.wait_for(stream.readline(), timeout=timeout)
    if not line:
        raise RuntimeError("the GPU job exited early (see its stderr above)")
    data: dict[str, Any] = json.loads(line)
    return data


async def cuda_part(args: argparse.Namespace, report: Report) -> None:
    try:
        from tslice.agent import discovery, registration
        from tslice.agent import nvml as nvml_mod
        from tslice.agent.backends import base, cuda, cuda_fake
        from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
    except ImportError as exc:
        report.check(
            "import tslice's agent",
            False,
            f"{exc}; install tslice's dependencies (protobuf>=7.35, grpcio, pydantic, "
            "typing_extensions), e.g. from carried wheels with pip --no-index",
        )
        return

    device = "cpu" if args.simulate else "cuda"
    total = int(args.size_gib * GIB)
    workdir = Path(tempfile.mkdtemp(prefix="tslice-gpu-check-"))
    registry = registration.ProcessRegistry()
    server = registration.RegistrationServer(path=workdir / "register.sock", registry=registry)
    await server.start()
    env = {**os.environ, registration.SOCKET_ENV: str(server.path)}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        device,
        str(total),
        str(args.tensors),
        JOB_ID,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        ready = await _read_json(child.stdout, timeout=180)
        pid = int(ready["pid"])
        report.check(
            "registration: peer pid is the GPU job",
            registry.pids(JOB_ID) == [child.pid],
            f"registered {registry.pids(JOB_ID)}, child {child.pid}",
        )

        async def fingerprint() -> Any:
            child.stdin.write(b"check\n")  # type: ignore[union-attr]
            await child.stdin.drain()  # type: ignore[union-attr]
            return (await _read_json(child.stdout, timeout=120))["fingerprint"]  # type: ignore[arg-type]

        nvml: Any
        if args.simulate:
            nvml = nvml_mod.FakeNvml([nvml_mod.FakeGpu("GPU-00000000-0000-0000-0000-000000000000")])
            nvml.gpus[0].compute[pid] = int(ready["bytes"])
            driver: Any = cuda_fake.FakeDriver(nvml=nvml)
            driver.add_process(pid)

            def make() -> cuda.CudaBackend:
                return cuda.CudaBackend(driver=driver, nvml=nvml, registry=registry)
        else:
            try:
                nvml = nvml_mod.open_nvml()
            except nvml_mod.NvmlUnavailableError as exc:
                nvml = None
                report.environment["nvml"] = f"unavailable: {exc}"

            def make() -> cuda.CudaBackend:
                return cuda.CudaBackend(registry=registry)

        backend = make()
        try:
            await backend.check_health()
        except base.BackendUnavailableError as exc:
            report.check("cuda backend available", False, str(exc))
            return

        def resident() -> int | None:
            if nvml is None:
                return None
            return discovery.device_bytes_by_pid(discovery.gpu_processes(nvml)).get(pid, 0)

        ctx = base.JobContext(job_id=JOB_ID, group="gpu-check")
        snaps: list[float] = []
        restores: list[float] = []
        noops: list[float] = []
        moved: list[int] = []
        for rep in range(args.reps):
            held = resident()
            t0 = time.perf_counter()
            saved = await backend.snapshot(ctx, pb.SUSPEND_MODE_OFFLOAD)
            snaps.append(time.perf_counter() - t0)
            report.environment["checkpoint driver"] = saved.state["driver"]
            # NVML may not report per-process memory (then: the tensors' bytes).
            moved.append(saved.device_bytes or int(ready["bytes"]))
            left = resident()
            if left is not None:
                report.check(
                    f"cycle {rep + 1}: device memory released",
                    left == 0,
                    f"{held} bytes before, {left} after",
                )
            # The agent persists OpResult.state as JSON; do the same.
            ctx = dataclasses.replace(ctx, state=json.loads(json.dumps(saved.state)))
            if rep == 0:
                restarted = make()
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
            report.check(
                f"cycle {rep + 1}: data bit-exact after restore",
                await fingerprint() == ready["fingerprint"],
            )
            t0 = time.perf_counter()
            again = await backend.restore(ctx)
            noops.append(time.perf_counter() - t0)
            report.check(
                f"cycle {rep + 1}: restore of a running job is a no-op",
                again.device_bytes == 0 and await fingerprint() == ready["fingerprint"],
            )
        nbytes = int(statistics.median(moved))
        note = f"driver={report.environment['checkpoint driver']}, median of {args.reps}"
        report.rows += [
            Row("cuda snapshot (lock+checkpoint)", _median(snaps), nbytes, note),
            Row("cuda restore (restore+unlock)", _median(restores), nbytes, note),
            Row("cuda restore of running job", _median(noops), 0, "no-op by design"),
        ]
        await backend.close()
    finally:
        if child.returncode is None:
            child.stdin.write(b"exit\n")
            try:
                await asyncio.wait_for(child.wait(), timeout=30)
            except asyncio.TimeoutError:
                child.kill()
                await child.wait()
        await server.close()
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------- part 2


def torch_part(args: argparse.Namespace, report: Report) -> None:
    import torch

    try:
        from tslice.workload.adapters import torch as torch_adapter
    except ImportError as exc:
        report.rows.append(Row("TorchAdapter", note=f"skipped: {exc}"))
        return
    device = torch.device("cpu" if args.simulate else "cuda")
    pin = device.type == "cuda"

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    per = max(1, int(args.size_gib * GIB) // args.tensors // 4)
    nbytes = per * 4 * args.tensors
    gen = torch.Generator(device=device).manual_seed(99)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(per, device=device, generator=gen), requires_grad=False)
        for _ in range(args.tensors)
    )
    reference = [p.detach().to("cpu", copy=True) for p in model.params]
    adapter = torch_adapter.TorchAdapter(model)
    adapter.reserve_host_buffers()
    offloads: list[float] = []
    restores: list[float] = []
    for rep in range(args.reps + 1):  # the first cycle is a warm-up
        sync()
        t0 = time.perf_counter()
        adapter.snapshot(torch_adapter.OFFLOAD)
        sync()
        t1 = time.perf_counter()
        if device.type == "cuda" and rep == 0:
            report.check(
                "TorchAdapter: device memory released",
                torch.cuda.memory_allocated(device) < nbytes // 2,
                f"{torch.cuda.memory_allocated(device)} bytes still allocated",
            )
        adapter.restore()
        sync()
        t2 = time.perf_counter()
        if rep:
            offloads.append(t1 - t0)
            restores.append(t2 - t1)
    exact = all(
        torch.equal(p.detach().cpu(), r) for p, r in zip(model.params, reference, strict=True)
    )
    report.check("TorchAdapter: bit-exact after restore", exact)

    hosts = [torch.empty(per, dtype=torch.float32, pin_memory=pin) for _ in range(args.tensors)]
    d2h: list[float] = []
    h2d: list[float] = []
    for rep in range(args.reps + 1):
        sync()
        t0 = time.perf_counter()
        for p, h in zip(model.params, hosts, strict=True):
            h.copy_(p.detach(), non_blocking=pin)
        sync()
        t1 = time.perf_counter()
        for p, h in zip(model.params, hosts, strict=True):
            p.data.copy_(h, non_blocking=pin)
        sync()
        t2 = time.perf_counter()
        if rep:
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
    note = f"median of {args.reps}, {args.tensors} tensors"
    off, res, base_d2h, base_h2d = _median(offloads), _median(restores), _median(d2h), _median(h2d)
    report.rows += [
        Row("TorchAdapter offload", off, nbytes, note),
        Row("TorchAdapter restore", res, nbytes, note),
        Row("pinned copy device->host", base_d2h, nbytes, "tensor.copy_(non_blocking)"),
        Row("pinned copy host->device", base_h2d, nbytes, "tensor.copy_(non_blocking)"),
    ]
    if off and res:
        report.environment["TorchAdapter / pinned copy"] = (
            f"offload {base_d2h / off:.2f}x, restore {base_h2d / res:.2f}x"
        )


def overlap_part(args: argparse.Namespace, report: Report) -> None:
    """Part 3 (issue 9 §2): a TorchAdapter switch between two jobs, sequential (snapshot,
    then restore) against overlapped (both at once within one state's memory), as
    ``bench/torch_overlap.py`` measures it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch_overlap

    device = "cpu" if args.simulate else "cuda"
    r = torch_overlap.measure(args.size_gib, args.tensors, args.reps, device)
    note = f"median of {args.reps} switches each way, {args.tensors} tensors per job"
    report.rows += [
        Row("switch, sequential (out, then in)", r["sequential_s"], 2 * r["state_bytes"], note),
        Row("switch, overlapped (out and in)", r["overlapped_s"], 2 * r["state_bytes"], note),
    ]
    report.environment["switch sequential / overlapped"] = f"{r['speedup']:.2f}x"
    report.check("overlapped switch: both jobs bit-exact", r["bit_exact"])


# --------------------------------------------------------------------------- output


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    if not args.simulate:
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda (torch)"] = torch.version.cuda
    env["cuda-checkpoint"] = shutil.which("cuda-checkpoint") or "not on PATH"
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        env["driver"] = version.decode() if isinstance(version, bytes) else version
        pynvml.nvmlShutdown()
    except Exception as exc:  # the environment table is informative only
        env["driver"] = f"unknown ({type(exc).__name__})"
    return env


def render(report: Report, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(
            {
                "ok": report.ok,
                "environment": report.environment,
                "rows": [
                    {
                        "name": r.name,
                        "seconds": r.seconds,
                        "bytes": r.nbytes,
                        "gbps": r.gbps,
                        "note": r.note,
                    }
                    for r in report.rows
                ],
                "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in report.checks],
            },
            indent=2,
        )
    lines = [f"{k}: {v}" for k, v in report.environment.items()]
    lines += ["", f"{'measurement':<34} {'seconds':>9} {'GiB':>8} {'GB/s':>8}  note"]
    for r in report.rows:
        secs = f"{r.seconds:9.3f}" if r.seconds is not None else f"{'-':>9}"
        gib = f"{r.nbytes / GIB:8.2f}" if r.nbytes is not None else f"{'-':>8}"
        rate = f"{r.gbps:8.2f}" if r.gbps is not None else f"{'-':>8}"
        lines.append(f"{r.name:<34} {secs} {gib} {rate}  {r.note}")
    lines += ["", "checks:"]
    lines += [
        f"  [{'ok' if ok else 'FAIL'}] {n}" + (f" ({d})" if d and not ok else "")
        for n, ok, d in report.checks
    ]
    lines.append("ALL CHECKS PASSED" if report.ok else "SOME CHECKS FAILED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: PyTorch is not installed; it is needed for the GPU job", file=sys.stderr)
        return 2
    if not args.simulate and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on "
            "a GPU machine, or pass --simulate for a CPU dry run of the script",
            file=sys.stderr,
        )
        return 2
    report = Report(environment=environment(args))
    if not args.skip_cuda:
        asyncio.run(cuda_part(args, report))
    if not args.skip_torch:
        torch_part(args, report)
    if not args.skip_overlap:
        overlap_part(args, report)
    print(render(report, as_json=args.json))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
