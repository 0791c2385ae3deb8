"""TorchAdapter switches that overlap (issue 9 §2): progressive offload and a restore that
lands only in memory already freed, bit for bit, on CPU tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tslice.workload.adapters import torch as torch_adapter  # noqa: E402
from tslice.workload.adapters import torch_overlap  # noqa: E402

MIB = 1024**2


def job(seed: int, parts: int = 4) -> tuple[torch.nn.Module, torch_adapter.TorchAdapter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(parts)))
    adapter = torch_adapter.TorchAdapter(model, chunk_bytes=MIB, free_progressively=True)
    return model, adapter


def values(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def resident(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_overlap_switch_stays_within_the_budget_and_is_bit_exact() -> None:
    out_model, outgoing = job(1)
    in_model, incoming = job(2)
    expected_in, expected_out = values(in_model), values(out_model)
    incoming.snapshot(torch_adapter.OFFLOAD)
    size = resident(out_model)
    # Room for one state and a little: the restore must wait for the snapshot's frees.
    budget = size + size // 8
    times = torch_overlap.overlap_switch(outgoing, incoming, budget_bytes=budget, in_use_bytes=size)
    assert times.peak_bytes <= budget
    assert outgoing.suspended_tags == ["weights"] and incoming.resident_tags == ["weights"]
    assert resident(out_model) == 0
    for got, want in zip(in_model.parameters(), expected_in, strict=True):
        assert torch.equal(got, want)
    # And back again: the first job returns exactly as it left.
    back = torch_overlap.overlap_switch(incoming, outgoing, budget_bytes=budget, in_use_bytes=size)
    assert back.peak_bytes <= budget and resident(out_model) == size
    for got, want in zip(out_model.parameters(), expected_out, strict=True):
        assert torch.equal(got, want)


def test_progressive_offload_reports_every_free_and_a_failure_keeps_the_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, adapter = job(3)
    before = values(model)
    freed: list[int] = []
    adapter.snapshot(torch_adapter.OFFLOAD, freed_bytes=freed.append)
    assert sum(freed) == sum(b.nbytes for b in adapter._parked["weights"].blocks)
    assert len(freed) == len(list(model.parameters()))
    adapter.restore()
    calls = {"n": 0}
    to_host = adapter._copier.to_host

    def failing(blocks: object, buffer: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("copy failed")
        to_host(blocks, buffer)  # type: ignore[arg-type]

    monkeypatch.setattr(adapter._copier, "to_host", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        adapter.snapshot(torch_adapter.OFFLOAD)
    # The two storages freed before the failure were copied back: nothing changed.
    assert adapter.resident_tags == ["weights"]
    for got, want in zip(model.parameters(), before, strict=True):
        assert torch.equal(got, want)
