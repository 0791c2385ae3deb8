"""TorchAdapter moves less (issue 20 §4): what did not change since the last restore is not
copied again (``skip_unchanged``), and host buffers are allocated once at their exact size.

The model is a frozen base (as in LoRA fine-tuning or a reference policy) with a small
trainable part; the bytes each snapshot copies are counted (``TorchAdapterStats``).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from tests.workload.torch_models import assert_bit_identical  # noqa: E402
from tslice.workload.adapters import torch as torch_adapter  # noqa: E402
from tslice.workload.adapters import torch_storage  # noqa: E402

OFFLOAD = torch_adapter.OFFLOAD


class FrozenBase(torch.nn.Module):
    """A 256x256 frozen base and a rank-2 LoRA pair on top."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(256, 256)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(2, 256) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(256, 2) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def make() -> tuple[FrozenBase, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = FrozenBase()
    optimizer = torch.optim.AdamW([model.lora_a, model.lora_b], lr=1e-2)
    return model, optimizer


def train(model: FrozenBase, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer.zero_grad(set_to_none=False)
    model(torch.randn(8, 256, generator=generator)).square().mean().backward()
    optimizer.step()


def state_of(model: FrozenBase, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            tensors[f"opt.{index}.{key}"] = value.clone()
    return tensors


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def copied(adapter: torch_adapter.TorchAdapter, before: int) -> int:
    return adapter.stats.bytes_copied_out - before


def test_a_second_snapshot_copies_only_the_trainable_part_and_ten_cycles_stay_exact() -> None:
    model, optimizer = make()
    twin, twin_optimizer = copy.deepcopy((model, optimizer))
    adapter = torch_adapter.TorchAdapter(model, optimizer, skip_unchanged=True)
    train(model, optimizer, seed=0)
    train(twin, twin_optimizer, seed=0)
    frozen = nbytes(model.base.weight, model.base.bias)
    trainable = nbytes(model.lora_a, model.lora_b, model.lora_a.grad, model.lora_b.grad)
    trainable += nbytes(*(v for s in optimizer.state.values() for v in s.values()))

    adapter.snapshot(OFFLOAD)
    assert adapter.stats.bytes_copied_out == frozen + trainable  # the first copies it all
    adapter.restore()
    for cycle in range(10):
        train(model, optimizer, seed=1 + cycle)
        train(twin, twin_optimizer, seed=1 + cycle)
        before = adapter.stats.bytes_copied_out
        result = adapter.snapshot(OFFLOAD)
        # Only the trainable part (LoRA weights, their gradients, AdamW's state) moved;
        # the frozen base was freed, not copied.
        assert copied(adapter, before) == trainable, cycle
        assert result.device_bytes == frozen + trainable
        adapter.restore()
    assert adapter.stats.bytes_skipped_out == 10 * frozen
    assert_bit_identical(state_of(twin, twin_optimizer), state_of(model, optimizer))


def test_an_in_place_update_of_a_frozen_tensor_is_copied() -> None:
    model, optimizer = make()
    adapter = torch_adapter.TorchAdapter(model, optimizer, skip_unchanged=True)
    adapter.snapshot(OFFLOAD)
    adapter.restore()
    with torch.no_grad():
        model.base.weight.mul_(2)  # its version counter changes
    expected = model.base.weight.clone()
    weight = nbytes(model.base.weight)
    before = adapter.stats.bytes_copied_out
    adapter.snapshot(OFFLOAD)
    assert copied(adapter, before) == weight
    adapter.restore()
    assert torch.equal(model.base.weight, expected)


def test_a_write_through_data_needs_mark_changed() -> None:
    model, optimizer = make()
    adapter = torch_adapter.TorchAdapter(model, optimizer, skip_unchanged=True)
    adapter.snapshot(OFFLOAD)
    adapter.restore()
    old = model.base.bias.clone()
    model.base.bias.data.fill_(7.0)  # .data bypasses the version counter
    adapter.snapshot(OFFLOAD)
    adapter.restore()
    # Unseen: the host copy from before came back. This is why skip_unchanged is off by
    # default, and what mark_changed is for.
    assert torch.equal(model.base.bias, old)
    model.base.bias.data.fill_(7.0)
    adapter.mark_changed("weights")
    adapter.snapshot(OFFLOAD)
    adapter.restore()
    assert torch.equal(model.base.bias, torch.full_like(old, 7.0))


def test_without_skip_unchanged_every_snapshot_copies_everything() -> None:
    model, optimizer = make()
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    adapter.snapshot(OFFLOAD)
    first = adapter.stats.bytes_copied_out
    adapter.restore()
    adapter.snapshot(OFFLOAD)
    assert adapter.stats.bytes_copied_out == 2 * first
    assert adapter.stats.bytes_skipped_out == 0


def test_skip_with_progressive_freeing_is_exact_too() -> None:
    model, optimizer = make()
    adapter = torch_adapter.TorchAdapter(
        model, optimizer, skip_unchanged=True, free_progressively=True
    )
    train(model, optimizer, seed=0)
    adapter.snapshot(OFFLOAD)
    adapter.restore()
    train(model, optimizer, seed=1)
    expected = state_of(model, optimizer)
    frozen = nbytes(model.base.weight, model.base.bias)
    before = adapter.stats.bytes_copied_out
    adapter.snapshot(OFFLOAD)
    assert adapter.stats.bytes_skipped_out == frozen
    assert copied(adapter, before) == adapter.stats.bytes_out // 2 - frozen
    adapter.restore()
    assert_bit_identical(expected, state_of(model, optimizer))


def test_host_buffers_are_allocated_once_at_their_exact_size() -> None:
    model, optimizer = make()
    train(model, optimizer, seed=0)
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    for _ in range(10):
        adapter.snapshot(OFFLOAD)
        adapter.restore()
    # One buffer per tag, allocated at the first snapshot and reused by the other nine.
    assert adapter.stats.host_allocations == len(adapter.tags)
    # Exact: each storage in its slot (256-byte aligned), no power-of-two rounding.
    exact = 0
    for tensors in (
        [model.base.weight, model.base.bias],
        [model.lora_a, model.lora_a.grad, model.lora_b, model.lora_b.grad],
        [v for s in optimizer.state.values() for v in s.values()],
    ):
        exact += sum(torch_storage.align(t.untyped_storage().nbytes()) for t in tensors)
    assert adapter.host_buffer_bytes == exact
