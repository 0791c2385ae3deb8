"""TorchAdapter offload/restore throughput against a plain copy of the same bytes.

Both are measured in the same run on this machine: a model holding ``--size-gib``
of float32 parameters in ``--tensors`` tensors is offloaded and restored through
TorchAdapter, and the same number of bytes is copied with one ``dst.copy_(src)``
into a preallocated buffer. Each figure is the median of ``--reps`` cycles after
one warm-up cycle (the warm-up is the one that allocates the host buffers).

An offload also frees the tensors' memory and a restore allocates it again; on
CPU that memory comes back from the kernel as fresh, zero-filled pages, which a
copy into a preallocated buffer never pays for. So restore is also compared
with a plain copy into freshly allocated memory (``fresh``). PyTorch's
``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for big CPU tensors, on by
default here, ``--no-thp`` to turn off) makes both much cheaper.

A last figure is the offload of a state not written since its restore, with
``skip_unchanged`` (issue 20 §4): it is freed, not copied (the figure is the state's
bytes over the snapshot's time).

    python bench/offload.py [--size-gib 1] [--tensors 16] [--reps 5] [--device cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

GIB = 1024**3
MIB = 1024**2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="bytes to move (GiB)")
    parser.add_argument("--tensors", type=int, default=16, help="number of parameter tensors")
    parser.add_argument("--reps", type=int, default=5, help="measured cycles (after a warm-up)")
    parser.add_argument("--chunk-mib", type=int, default=64, help="TorchAdapter copy chunk (MiB)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--no-thp", action="store_true", help="leave THP_MEM_ALLOC_ENABLE unset")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.no_thp:
        # Read by PyTorch's CPU allocator, so it must be set before torch loads.
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import torch

    from tslice.workload.adapters import torch as torch_adapter

    torch.manual_seed(0)
    device = torch.device(args.device)
    synchronize: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    )
    per_tensor = int(args.size_gib * GIB) // args.tensors // 4
    total = per_tensor * 4 * args.tensors

    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(
        torch.nn.Parameter(torch.full((per_tensor,), float(i), device=device))
        for i in range(args.tensors)
    )
    adapter = torch_adapter.TorchAdapter(model, chunk_bytes=args.chunk_mib * MIB)
    pinned = device.type == "cuda"
    src = torch.ones(total, dtype=torch.uint8, device=device)
    host = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)

    def timed(action: Callable[[], object]) -> float:
        synchronize()
        start = time.perf_counter()
        action()
        synchronize()
        return time.perf_counter() - start

    def fresh_copy() -> None:
        torch.empty(total, dtype=torch.uint8, device=device).copy_(host)

    samples: dict[str, list[float]] = {
        "plain_out": [],
        "plain_in": [],
        "fresh_in": [],
        "offload": [],
        "restore": [],
    }
    first_offload = 0.0
    for rep in range(args.reps + 1):
        plain_out = timed(lambda: host.copy_(src, non_blocking=pinned))
        plain_in = timed(lambda: src.copy_(host, non_blocking=pinned))
        fresh_in = timed(fresh_copy)
        offload = timed(lambda: adapter.snapshot(torch_adapter.OFFLOAD))
        restore = timed(adapter.restore)
        if rep == 0:
            first_offload = offload
            continue
        for key, value in zip(
            samples, (plain_out, plain_in, fresh_in, offload, restore), strict=True
        ):
            samples[key].append(value)

    # skip_unchanged (issue 20 §4): a state not written since its restore is freed, not
    # copied again; the figure is the state's bytes over the snapshot's time.
    frozen = torch_adapter.TorchAdapter(
        model, chunk_bytes=args.chunk_mib * MIB, skip_unchanged=True
    )
    frozen.snapshot(torch_adapter.OFFLOAD)
    frozen.restore()
    copied_before = frozen.stats.bytes_copied_out
    samples["offload_unchanged"] = []
    for _ in range(args.reps):
        samples["offload_unchanged"].append(timed(lambda: frozen.snapshot(torch_adapter.OFFLOAD)))
        frozen.restore()
    unchanged_copied = frozen.stats.bytes_copied_out - copied_before

    intact = all(bool(p.eq(float(i)).all()) for i, p in enumerate(model.params))
    gbps = {key: total / statistics.median(values) / 1e9 for key, values in samples.items()}
    result: dict[str, Any] = {
        "device": str(device),
        "bytes": total,
        "tensors": args.tensors,
        "reps": args.reps,
        "chunk_mib": args.chunk_mib,
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
        "torch_threads": torch.get_num_threads(),
        "plain_copy_out_gbps": round(gbps["plain_out"], 2),
        "plain_copy_in_gbps": round(gbps["plain_in"], 2),
        "plain_copy_fresh_in_gbps": round(gbps["fresh_in"], 2),
        "offload_gbps": round(gbps["offload"], 2),
        "restore_gbps": round(gbps["restore"], 2),
        "first_offload_gbps": round(total / first_offload / 1e9, 2),
        "offload_unchanged_gbps": round(gbps["offload_unchanged"], 2),
        "offload_unchanged_copied_bytes": unchanged_copied,
        "offload_ratio": round(gbps["offload"] / gbps["plain_out"], 3),
        "restore_ratio": round(gbps["restore"] / gbps["plain_in"], 3),
        "restore_ratio_vs_fresh": round(gbps["restore"] / gbps["fresh_in"], 3),
        "bit_exact": intact,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(_render(result))
    return 0 if intact else 1


def _render(r: dict[str, Any]) -> str:
    gib = r["bytes"] / GIB
    return "\n".join(
        [
            f"TorchAdapter offload bench: {gib:.2f} GiB in {r['tensors']} tensors on {r['device']}"
            f" (median of {r['reps']}, chunk {r['chunk_mib']} MiB,"
            f" THP {'on' if r['thp'] else 'off'}, {r['torch_threads']} torch threads)",
            f"  plain copy out (preallocated)    {r['plain_copy_out_gbps']:7.2f} GB/s",
            f"  TorchAdapter offload             {r['offload_gbps']:7.2f} GB/s"
            f"   ratio {r['offload_ratio']:.2f}",
            f"  plain copy in (preallocated)     {r['plain_copy_in_gbps']:7.2f} GB/s",
            f"  plain copy in (fresh memory)     {r['plain_copy_fresh_in_gbps']:7.2f} GB/s",
            f"  TorchAdapter restore             {r['restore_gbps']:7.2f} GB/s"
            f"   ratio {r['restore_ratio']:.2f} (vs fresh {r['restore_ratio_vs_fresh']:.2f})",
            f"  first offload (allocates buffer) {r['first_offload_gbps']:7.2f} GB/s",
            f"  offload, unchanged since restore {r['offload_unchanged_gbps']:7.2f} GB/s"
            f"   (skip_unchanged: {r['offload_unchanged_copied_bytes']} bytes copied)",
            f"  restored bit for bit: {'yes' if r['bit_exact'] else 'NO'}",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
