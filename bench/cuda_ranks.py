"""The cuda backend on a multi-GPU job: N processes moved together against one process.

A job of ``--processes`` processes, each holding ``--gib`` GiB on its own GPU, is
snapshotted and restored through :class:`tslice.agent.backends.cuda.CudaBackend` over
the FakeDriver, whose checkpoint and restore take ``bytes / --link-gbps`` per process
(each process over its own GPU's link, as on a real node). The same job is moved with
``parallel_processes`` = 0 (all at once, the default) and 1 (one process per phase at a
time: what the backend did before, one process after another), and a job of one process
is the baseline. Real processes (``sleep``) stand for the ranks, since the backend
checks ``/proc``. Each figure is the median of ``--reps`` cycles.

Target (issue 20 §1): N processes moved in at most 1.2x the time of one.

    python bench/cuda_ranks.py [--processes 8] [--gib 2] [--link-gbps 25] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from tslice.agent.backends import base, cuda, cuda_fake, cuda_settings
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

GIB = 1024**3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=8, help="processes of the job")
    parser.add_argument("--gib", type=float, default=2.0, help="device GiB per process")
    parser.add_argument("--link-gbps", type=float, default=25.0, help="GB/s of each link")
    parser.add_argument("--reps", type=int, default=5, help="measured cycles")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


async def _cycle(pids: list[int], args: argparse.Namespace, parallel: int) -> tuple[float, float]:
    """(snapshot seconds, restore seconds) of one job of ``pids``."""
    driver = cuda_fake.FakeDriver(copy_bytes_per_s=args.link_gbps * 1e9)
    for pid in pids:
        driver.add_process(pid, device_bytes=int(args.gib * GIB))
    backend = cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(measure_bytes=False, parallel_processes=parallel),
        driver=driver,
        registry=registration.ProcessRegistry(),
    )
    config = pb.BackendConfig(
        cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=pids))
    )
    began = time.perf_counter()
    saved = await backend.snapshot(base.JobContext("bench", "g", config), pb.SUSPEND_MODE_OFFLOAD)
    snapshot_s = time.perf_counter() - began
    began = time.perf_counter()
    await backend.restore(base.JobContext("bench", "g", state=saved.state))
    return snapshot_s, time.perf_counter() - began


async def measure(args: argparse.Namespace, pids: list[int]) -> dict[str, Any]:
    cases = {
        "one process": (pids[:1], 0),
        f"{args.processes} processes, together": (pids, 0),
        f"{args.processes} processes, one at a time": (pids, 1),
    }
    rows = []
    for name, (chosen, parallel) in cases.items():
        runs = [await _cycle(chosen, args, parallel) for _ in range(args.reps)]
        snap = statistics.median(r[0] for r in runs)
        rest = statistics.median(r[1] for r in runs)
        moved = len(chosen) * args.gib * GIB
        rows.append(
            {
                "case": name,
                "processes": len(chosen),
                "snapshot_s": snap,
                "restore_s": rest,
                "snapshot_gbps": moved / snap / 1e9,
                "restore_gbps": moved / rest / 1e9,
            }
        )
    one, together, serial = rows
    return {
        "processes": args.processes,
        "gib_per_process": args.gib,
        "link_gbps": args.link_gbps,
        "reps": args.reps,
        "rows": rows,
        "together_vs_one": {
            "snapshot": together["snapshot_s"] / one["snapshot_s"],
            "restore": together["restore_s"] / one["restore_s"],
        },
        "one_at_a_time_vs_one": {
            "snapshot": serial["snapshot_s"] / one["snapshot_s"],
            "restore": serial["restore_s"] / one["restore_s"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    children = [subprocess.Popen(["sleep", "600"]) for _ in range(args.processes)]
    try:
        report = asyncio.run(measure(args, [c.pid for c in children]))
    finally:
        for child in children:
            child.kill()
            child.wait()
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{args.processes} processes x {args.gib:g} GiB, each link {args.link_gbps:g} GB/s, "
        f"median of {args.reps}"
    )
    print(f"{'case':<32} {'snapshot':>10} {'restore':>10} {'GB/s out':>9} {'GB/s in':>9}")
    for row in report["rows"]:
        snap_ms, rest_ms = row["snapshot_s"] * 1000, row["restore_s"] * 1000
        print(
            f"{row['case']:<32} {snap_ms:>8.0f}ms {rest_ms:>8.0f}ms"
            f" {row['snapshot_gbps']:>9.1f} {row['restore_gbps']:>9.1f}"
        )
    ratio = report["together_vs_one"]
    serial = report["one_at_a_time_vs_one"]
    print(
        f"together / one: snapshot {ratio['snapshot']:.2f}x, restore {ratio['restore']:.2f}x "
        f"(target <= 1.2x); one at a time / one: {serial['snapshot']:.2f}x, "
        f"{serial['restore']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
