"""The spill tier (issue 20 §2): a TorchAdapter given ``spill_dir`` and ``host_budget_bytes``
keeps its host buffers within the budget and parks what does not fit in files on local
disk, restored bit for bit; results report only the host memory held, ``stats`` the
bytes spilled and the time (GB/s)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.workload.torch_models import (  # noqa: E402
    Mixed,
    assert_bit_identical,
    snapshot_of,
    train_steps,
)
from tslice.workload.adapters import torch as torch_adapter  # noqa: E402

OFFLOAD = torch_adapter.OFFLOAD


@pytest.fixture
def trained() -> tuple[Mixed, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Mixed()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, steps=3, seed=1)
    return model, optimizer


def _sizes(model: Mixed, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    probe = torch_adapter.TorchAdapter(model, optimizer)
    probe.reserve_host_buffers()
    return {tag: probe._buffers.size_of(tag) for tag in probe.tags}


def test_what_does_not_fit_the_host_budget_is_spilled_and_restored_bit_for_bit(
    trained: tuple[Mixed, torch.optim.Optimizer], tmp_path: Path
) -> None:
    model, optimizer = trained
    sizes = _sizes(model, optimizer)
    expected = snapshot_of(model, optimizer)
    # Room for the weights only: lora and optimizer go to disk.
    adapter = torch_adapter.TorchAdapter(
        model, optimizer, spill_dir=tmp_path, host_budget_bytes=sizes["weights"]
    )
    result = adapter.snapshot(OFFLOAD)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(name.endswith(".spill") for name in files)
    assert adapter.host_buffer_bytes == sizes["weights"] <= adapter._host_budget  # type: ignore[operator]
    spilled = adapter.stats.bytes_spilled
    assert 0 < spilled < sizes["lora"] + sizes["optimizer"] + 1
    assert result.host_bytes + spilled == result.device_bytes  # held in memory + on disk
    assert adapter.stats.spill_write_s > 0
    adapter.restore()
    assert list(tmp_path.iterdir()) == []  # the files go once restored
    assert adapter.stats.bytes_unspilled == spilled
    assert adapter.stats.spill_read_s > 0
    assert_bit_identical(expected, snapshot_of(model, optimizer))


def test_ten_cycles_through_the_disk_stay_exact(
    trained: tuple[Mixed, torch.optim.Optimizer], tmp_path: Path
) -> None:
    model, optimizer = trained
    twin, twin_optimizer = copy.deepcopy((model, optimizer))
    adapter = torch_adapter.TorchAdapter(
        model, optimizer, spill_dir=tmp_path / "spill", host_budget_bytes=0
    )
    for cycle in range(10):
        result = adapter.snapshot(OFFLOAD)
        assert result.host_bytes == 0  # nothing held in host memory
        assert adapter.host_buffer_bytes == 0
        adapter.restore()
        train_steps(model, optimizer, steps=1, seed=20 + cycle)
        train_steps(twin, twin_optimizer, steps=1, seed=20 + cycle)
    assert_bit_identical(snapshot_of(twin, twin_optimizer), snapshot_of(model, optimizer))


def test_spill_dir_and_budget_go_together(trained: tuple[Mixed, torch.optim.Optimizer]) -> None:
    model, optimizer = trained
    with pytest.raises(ValueError, match="together"):
        torch_adapter.TorchAdapter(model, optimizer, host_budget_bytes=10)
