"""GPU check: the cuda backend and the TorchAdapter on a real GPU, in one run (< 8 min on an H100).

Parts (each reports its own failure; the table always prints):

1. ``cuda``: one PyTorch process of ``--size-gib`` through the ``cuda`` backend: NVML saw
   its memory held before and released after each snapshot (and the backend verified it),
   data bit-exact, a second restore a no-op, an agent restart reads it back SAVED, and a
   host budget smaller than its state refuses it before anything is frozen.
2. ``ranks``: ``--ranks`` processes of one job on the one GPU, checkpointed all at once
   and one at a time.
3. ``torch``: TorchAdapter offload/restore GB/s against plain pinned copies; exact-size
   host buffers.
4. ``frozen``: a frozen base with ``skip_unchanged``: a snapshot copies only the trainable
   part; its time against a plain pinned copy of the frozen bytes.
5. ``overlap``: a sequential against an overlapped TorchAdapter switch of two jobs.

(Parts 1-2: ``bench/gpu_check_cuda.py``; 3-5: ``bench/gpu_check_torch.py``.) It prints one
table (or one JSON object with ``--json``) and exits 0 if every check passed, 1 if one
failed, 2 if there is no GPU. ``--simulate`` runs the same flow on CPU tensors with the
FakeDriver and FakeNvml, to check the script anywhere (``make test`` runs it).

    PYTHONPATH=src python3 bench/gpu_check.py [--size-gib 8] [--tensors 32] [--reps 3]
        [--ranks 3] [--only cuda,ranks,...] [--json]

What the GPU machine needs: the NVIDIA driver >= 580 (570 without device maps), PyTorch
with CUDA, cuda-bindings >= 12.9.1 (or cuda-checkpoint on PATH), nvidia-ml-py, grpcio,
protobuf and typing_extensions: all on the lent H100/H200 image. The agent pieces the
check uses import no pydantic, httpx, PyYAML or other server dependency (checked here
with them blocked), so nothing else must travel with the working tree. Where a package
is missing there, carry it as a wheel. Here, in the repository's root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
        --implementation cp --platform manylinux_2_17_x86_64 -d .whl NAME==VERSION

(one command; pure-Python wheels need only the first three options); then the device
command carries ``.whl`` and starts with

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH

A part whose import fails says which package it lacks, and the rest still run.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_report import Report, render

PARTS = ("cuda", "ranks", "torch", "frozen", "overlap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=8.0, help="device bytes per part (GiB)")
    parser.add_argument("--tensors", type=int, default=32, help="tensors holding them")
    parser.add_argument("--reps", type=int, default=3, help="measured cycles per part")
    parser.add_argument("--ranks", type=int, default=3, help="processes of the ranks part")
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts ({', '.join(PARTS)})"
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="CPU tensors, the FakeDriver and FakeNvml: checks the script, measures nothing",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose among {', '.join(PARTS)}")
    return args


def environment(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        env["torch"] = torch.__version__
        if not args.simulate:
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cuda (torch)"] = torch.version.cuda
    except Exception as exc:  # the environment table is informative only
        env["torch"] = f"unknown ({type(exc).__name__})"
    env["cuda-checkpoint"] = shutil.which("cuda-checkpoint") or "not on PATH"
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        env["driver"] = version.decode() if isinstance(version, bytes) else version
        pynvml.nvmlShutdown()
    except Exception as exc:
        env["driver"] = f"unknown ({type(exc).__name__})"
    return env


def run_part(name: str, part: Callable[[], Any], report: Report) -> None:
    """One part; its failure (an import, a backend error) is its own check, not the run's."""
    try:
        part()
    except ImportError as exc:
        report.check(
            f"{name}: ran",
            False,
            f"{exc}: carry the missing package as a wheel (see this script's docstring)",
        )
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        report.check(f"{name}: ran", False, f"{type(exc).__name__}: {exc}")


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
    chosen = args.only.split(",")

    def cuda_parts(name: str) -> Callable[[], Any]:
        def run() -> None:
            import gpu_check_cuda

            asyncio.run(getattr(gpu_check_cuda, f"{name}_part")(args, report))

        return run

    def torch_parts(name: str) -> Callable[[], Any]:
        def run() -> None:
            import gpu_check_torch

            getattr(gpu_check_torch, f"{name}_part")(args, report)

        return run

    try:
        for name in PARTS:
            if name in chosen:
                runner = cuda_parts if name in ("cuda", "ranks") else torch_parts
                run_part(name, runner(name), report)
    finally:
        print(render(report, as_json=args.json), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
