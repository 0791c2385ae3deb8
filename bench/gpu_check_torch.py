"""Parts of ``bench/gpu_check.py`` that measure the TorchAdapter in this process.

3. **TorchAdapter** (``torch_part``): offload and restore of a module holding
   ``--size-gib``, bit-exact, against plain PyTorch copies into pinned host buffers
   (``non_blocking=True``) of the same tensors; its host buffers are their exact size.
4. **Frozen weights** (``frozen_part``, issue 20 §4): a frozen base of ``--size-gib``
   with a small trainable part, ``skip_unchanged``: the second snapshot copies only the
   trainable part; its time and effective GB/s (the whole state freed) against a
   plain pinned copy of the same bytes; bit-exact after the cycles.
5. **Overlapped switch** (issue 9 §2, ``bench/torch_overlap.py``): two jobs take turns,
   sequentially and overlapped, both bit-exact.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_check_report import GIB, Report, Row


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _device(args: argparse.Namespace) -> tuple[Any, Callable[[], None]]:
    import torch

    device = torch.device("cpu" if args.simulate else "cuda")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return device, sync


def _pinned_copy_s(tensors: list[Any], reps: int, sync: Callable[[], None]) -> tuple[float, float]:
    """Median (device to host, host to device) seconds of plain pinned copies."""
    import torch

    pin = tensors[0].device.type == "cuda"
    hosts = [torch.empty_like(t, device="cpu", pin_memory=pin) for t in tensors]
    d2h: list[float] = []
    h2d: list[float] = []
    for rep in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        for t, h in zip(tensors, hosts, strict=True):
            h.copy_(t.detach(), non_blocking=pin)
        sync()
        t1 = time.perf_counter()
        for t, h in zip(tensors, hosts, strict=True):
            t.data.copy_(h, non_blocking=pin)
        sync()
        t2 = time.perf_counter()
        if rep:
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
    return _median(d2h), _median(h2d)


def torch_part(args: argparse.Namespace, report: Report) -> None:
    import torch

    from tslice.workload.adapters import torch as torch_adapter
    from tslice.workload.adapters import torch_storage

    device, sync = _device(args)
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
    exact_size = sum(torch_storage.align(per * 4) for _ in range(args.tensors))
    report.check(
        "TorchAdapter: host buffers at their exact size",
        adapter.host_buffer_bytes == exact_size,
        f"{adapter.host_buffer_bytes} bytes for {exact_size}",
    )
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
    base_d2h, base_h2d = _pinned_copy_s(list(model.params), args.reps, sync)
    note = f"median of {args.reps}, {args.tensors} tensors"
    off, res = _median(offloads), _median(restores)
    report.rows += [
        Row("TorchAdapter offload", off, nbytes, note),
        Row("TorchAdapter restore", res, nbytes, note),
        Row("pinned copy device->host", base_d2h, nbytes, "tensor.copy_(non_blocking)"),
        Row("pinned copy host->device", base_h2d, nbytes, "tensor.copy_(non_blocking)"),
    ]
    report.environment["host buffer allocations"] = adapter.stats.host_allocations
    if off and res:
        report.environment["TorchAdapter / pinned copy"] = (
            f"offload {base_d2h / off:.2f}x, restore {base_h2d / res:.2f}x"
        )


def frozen_part(args: argparse.Namespace, report: Report) -> None:
    """A frozen base and a trainable 1 % with ``skip_unchanged``: what a snapshot copies."""
    import torch

    from tslice.workload.adapters import torch as torch_adapter

    device, sync = _device(args)
    per = max(1, int(args.size_gib * GIB) // args.tensors // 4)
    torch.manual_seed(7)
    model = torch.nn.Module()
    model.base = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(per, device=device), requires_grad=False)
        for _ in range(args.tensors)
    )
    model.lora = torch.nn.Parameter(torch.randn(max(1, per // 100), device=device))
    optimizer = torch.optim.SGD([model.lora], lr=0.1)
    adapter = torch_adapter.TorchAdapter(model, optimizer, skip_unchanged=True)
    frozen = per * 4 * args.tensors
    trainable = 2 * model.lora.numel() * 4  # the LoRA part and its gradient
    state = frozen + trainable

    def step() -> None:
        model.lora.grad = torch.ones_like(model.lora)
        optimizer.step()

    step()
    adapter.snapshot(torch_adapter.OFFLOAD)  # the first copies everything
    adapter.restore()
    seconds: list[float] = []
    copied: list[int] = []
    for _ in range(args.reps):
        step()
        expected = [p.detach().to("cpu", copy=True) for p in (*model.base, model.lora)]
        before = adapter.stats.bytes_copied_out
        sync()
        t0 = time.perf_counter()
        adapter.snapshot(torch_adapter.OFFLOAD)
        sync()
        seconds.append(time.perf_counter() - t0)
        copied.append(adapter.stats.bytes_copied_out - before)
        adapter.restore()
        sync()
        now = [p.detach().cpu() for p in (*model.base, model.lora)]
        report.check(
            "frozen weights: bit-exact after a skipped copy",
            all(torch.equal(a, b) for a, b in zip(expected, now, strict=True)),
        )
    report.check(
        "frozen weights: a snapshot copies only the trainable part",
        max(copied) == trainable,
        f"copied {copied} bytes of a {state}-byte state",
    )
    plain_d2h, _ = _pinned_copy_s(list(model.base), args.reps, sync)
    note = f"median of {args.reps}; copies {int(statistics.median(copied))} of {state} bytes"
    report.rows += [
        Row("TorchAdapter snapshot, frozen base", _median(seconds), state, note),
        Row("pinned copy of the frozen base", plain_d2h, frozen, "tensor.copy_(non_blocking)"),
    ]


def overlap_part(args: argparse.Namespace, report: Report) -> None:
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
