"""TorchAdapter switch: sequential (snapshot, then restore) against overlapped (issue 9 §2).

Two jobs of ``--size-gib`` each (float32 parameters in ``--tensors`` tensors) take turns
on one device. A *sequential* switch offloads the outgoing job, then restores the
incoming one; an *overlapped* switch (:func:`tslice.workload.adapters.torch_overlap.overlap_switch`)
runs both at once, the outgoing one freeing each storage as soon as it is on the host
(``free_progressively``) and the incoming one allocating each storage only once that
fits within the device budget (one job's state plus one tensor: never two states
resident). On CUDA the two directions use separate copy streams (and copy engines);
on CPU both are memory copies on the host's cores. Median of ``--reps`` switches after
one warm-up switch each way (the warm-up allocates the host buffers); every switch is
checked bit for bit.

    python bench/torch_overlap.py [--size-gib 1] [--tensors 16] [--reps 5] [--device cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

GIB = 1024**3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state of one job (GiB)")
    parser.add_argument("--tensors", type=int, default=16, help="parameter tensors per job")
    parser.add_argument("--reps", type=int, default=5, help="measured switches per mechanism")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def measure(size_gib: float, tensors: int, reps: int, device: str) -> dict[str, Any]:
    """Sequential and overlapped switch times (s), GB/s of one state, and the checks."""
    import torch

    from tslice.workload.adapters import torch as torch_adapter
    from tslice.workload.adapters import torch_overlap

    per_tensor = max(int(size_gib * GIB) // 4 // tensors, 1)

    def job(seed: int) -> tuple[torch.nn.ParameterList, torch_adapter.TorchAdapter]:
        torch.manual_seed(seed)
        params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(per_tensor, device=device)) for _ in range(tensors)
        )
        return params, torch_adapter.TorchAdapter(params, free_progressively=True)

    def sums(params: torch.nn.ParameterList) -> list[float]:
        return [float(p.detach().double().sum()) for p in params]

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    (a_params, a), (b_params, b) = job(1), job(2)
    expected = {id(a): sums(a_params), id(b): sums(b_params)}
    b.snapshot(torch_adapter.OFFLOAD)
    state = per_tensor * 4 * tensors
    budget = state + per_tensor * 4

    def sequential(out: torch_adapter.TorchAdapter, into: torch_adapter.TorchAdapter) -> float:
        sync()
        began = time.perf_counter()
        out.snapshot(torch_adapter.OFFLOAD)
        into.restore()
        sync()
        return time.perf_counter() - began

    def overlapped(out: torch_adapter.TorchAdapter, into: torch_adapter.TorchAdapter) -> float:
        sync()
        began = time.perf_counter()
        times = torch_overlap.overlap_switch(out, into, budget_bytes=budget, in_use_bytes=state)
        sync()
        if times.peak_bytes > budget:
            raise AssertionError(f"overlap held {times.peak_bytes} bytes, budget {budget}")
        return time.perf_counter() - began

    exact = True
    pair = [(a, b, b_params), (b, a, a_params)]

    def run(switch: Callable[..., float]) -> list[float]:
        nonlocal exact
        seen: list[float] = []
        for i in range(2 + 2 * reps):  # warm-up both ways, then reps each way
            out, into, params = pair[i % 2]
            took = switch(out, into)
            exact = exact and sums(params) == expected[id(into)]
            if i >= 2:
                seen.append(took)
        return seen

    seq, ovl = run(sequential), run(overlapped)
    gb = state / 1e9
    return {
        "device": device,
        "state_bytes": state,
        "tensors": tensors,
        "reps": reps,
        "sequential_s": round(statistics.median(seq), 4),
        "overlapped_s": round(statistics.median(ovl), 4),
        "speedup": round(statistics.median(seq) / statistics.median(ovl), 3),
        "sequential_gb_per_s": round(2 * gb / statistics.median(seq), 2),
        "overlapped_gb_per_s": round(2 * gb / statistics.median(ovl), 2),
        "budget_bytes": budget,
        "bit_exact": exact,
    }


def text(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"TorchAdapter switch on {r['device']}: two jobs of {r['state_bytes'] / 2**30:.2f} GiB"
            f" ({r['tensors']} tensors), median of {r['reps']} switches each way",
            f"  sequential (snapshot, then restore): {r['sequential_s'] * 1000:8.1f} ms"
            f"  ({r['sequential_gb_per_s']:.2f} GB/s moved)",
            f"  overlapped (both at once, budget one state + one tensor): "
            f"{r['overlapped_s'] * 1000:8.1f} ms  ({r['overlapped_gb_per_s']:.2f} GB/s moved)",
            f"  sequential / overlapped: {r['speedup']:.2f}x; restored bit for bit: "
            f"{'yes' if r['bit_exact'] else 'NO'}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args.size_gib, args.tensors, args.reps, args.device)
    print(json.dumps(result) if args.json else text(result))
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
