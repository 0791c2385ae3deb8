"""TorchAdapter on CPU tensors: bit-exact round trips, freed storage, reused host buffers."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from tests.workload.torch_models import (  # noqa: E402
    Mixed,
    assert_bit_identical,
    snapshot_of,
    train_steps,
)
from tslice.workload.adapters import base  # noqa: E402
from tslice.workload.adapters import torch as torch_adapter  # noqa: E402

OFFLOAD = torch_adapter.OFFLOAD
DISCARD = torch_adapter.DISCARD


@pytest.fixture
def trained() -> tuple[Mixed, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Mixed()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, steps=3, seed=1)
    return model, optimizer


def all_tensors(model: Mixed, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_offload_frees_every_storage_and_restores_bit_exact(trained) -> None:
    model, optimizer = trained
    before = snapshot_of(model, optimizer)
    params = list(model.parameters())
    layouts = {
        id(t): (t.dtype, t.shape, t.stride(), t.requires_grad)
        for t in all_tensors(model, optimizer)
    }
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    assert adapter.tags == ["weights", "lora", "optimizer"]

    out = adapter.snapshot(OFFLOAD)

    assert out.device_bytes > 0 and out.host_bytes == out.device_bytes
    assert all(t.untyped_storage().nbytes() == 0 for t in all_tensors(model, optimizer))
    assert adapter.suspended_tags == ["weights", "lora", "optimizer"]
    assert adapter.resident_tags == []

    back = adapter.restore()

    assert back.device_bytes == out.device_bytes and back.host_bytes == 0
    assert adapter.resident_tags == ["weights", "lora", "optimizer"]
    assert_bit_identical(before, snapshot_of(model, optimizer))
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert model.head.weight is model.embed.weight
    grid, cols = model.get_buffer("grid"), model.get_buffer("grid_cols")
    assert cols.untyped_storage().data_ptr() == grid.untyped_storage().data_ptr()
    assert not cols.is_contiguous()
    for tensor in all_tensors(model, optimizer):
        assert (tensor.dtype, tensor.shape, tensor.stride(), tensor.requires_grad) == layouts[
            id(tensor)
        ]


def test_training_after_a_cycle_matches_training_without_one(trained) -> None:
    model, optimizer = trained
    # One deepcopy of both keeps the twin optimizer pointing at the twin's parameters.
    twin, twin_optimizer = copy.deepcopy((model, optimizer))
    adapter = torch_adapter.TorchAdapter(model, optimizer)

    for cycle in range(3):
        adapter.snapshot(OFFLOAD)
        adapter.restore()
        train_steps(model, optimizer, steps=2, seed=10 + cycle)
        train_steps(twin, twin_optimizer, steps=2, seed=10 + cycle)

    assert_bit_identical(snapshot_of(twin, twin_optimizer), snapshot_of(model, optimizer))


def test_host_buffers_are_reused_across_cycles(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    adapter.snapshot(OFFLOAD)
    first = {tag: adapter._buffers.get(tag).data_ptr() for tag in adapter.tags}
    reserved = adapter.host_buffer_bytes
    adapter.restore()

    for _ in range(2):
        adapter.snapshot(OFFLOAD)
        assert {tag: adapter._buffers.get(tag).data_ptr() for tag in adapter.tags} == first
        assert adapter.host_buffer_bytes == reserved
        adapter.restore()


def test_host_buffer_grows_when_a_tag_grows() -> None:
    cache = {"k": torch.arange(100, dtype=torch.float32)}
    adapter = torch_adapter.TorchAdapter()
    adapter.add_tensors("kv_cache", cache)
    adapter.snapshot(OFFLOAD)
    adapter.restore()
    small = adapter.host_buffer_bytes

    adapter.add_tensors("kv_cache", {"v": torch.arange(5000, dtype=torch.float32)})
    adapter.snapshot(OFFLOAD)
    adapter.restore()

    assert adapter.host_buffer_bytes > small
    assert torch.equal(cache["k"], torch.arange(100, dtype=torch.float32))


def test_lora_alone_moves_and_weights_stay(trained) -> None:
    model, optimizer = trained
    lora = {"a": model.block.lora_a.detach().clone(), "b": model.block.lora_b.detach().clone()}
    adapter = torch_adapter.TorchAdapter(model, optimizer)

    out = adapter.snapshot(OFFLOAD, ["lora"])

    assert model.block.lora_a.untyped_storage().nbytes() == 0
    assert model.block.lora_b.untyped_storage().nbytes() == 0
    assert model.block.base.weight.untyped_storage().nbytes() > 0
    lora_bytes = sum(p.numel() * p.element_size() for p in (lora["a"], lora["b"]))
    assert out.device_bytes == 2 * lora_bytes  # parameters and their gradients
    assert adapter.suspended_tags == ["lora"]

    adapter.restore(["lora"])

    assert torch.equal(model.block.lora_a, lora["a"]) and torch.equal(model.block.lora_b, lora["b"])


def test_lora_patterns_are_configurable(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer, lora_patterns=("narrow.",))
    adapter.snapshot(OFFLOAD, ["lora"])
    assert model.narrow.weight.untyped_storage().nbytes() == 0
    assert model.block.lora_a.untyped_storage().nbytes() > 0
    adapter.restore()


def test_discard_frees_without_copying_and_restores_zeros(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)

    out = adapter.snapshot(DISCARD, ["weights"])

    assert out.device_bytes > 0 and out.host_bytes == 0
    assert adapter.host_buffer_bytes == 0
    assert model.embed.weight.untyped_storage().nbytes() == 0
    assert adapter.discarded_tags == ["weights"]

    back = adapter.restore(["weights"])

    assert back.device_bytes == out.device_bytes
    assert torch.count_nonzero(model.embed.weight) == 0
    assert model.embed.weight.shape == (16, 8)
    assert adapter.discarded_tags == ["weights"]  # until the application re-syncs
    adapter.mark_resynced("weights")
    assert adapter.discarded_tags == []


def test_discard_really_returns_memory_to_the_system() -> None:
    size = 96 * 1024 * 1024  # above glibc's mmap threshold: freeing unmaps at once
    big = torch.ones(size, dtype=torch.uint8)
    adapter = torch_adapter.TorchAdapter()
    adapter.add_tensors("kv_cache", {"big": big})
    before = _rss_bytes()

    adapter.snapshot(DISCARD)

    assert before - _rss_bytes() > 0.9 * size
    adapter.restore()
    assert big.numel() == size


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_custom_tags_round_trip_non_contiguous_tensors() -> None:
    base = torch.randn(8, 8, dtype=torch.float64)
    k_cache = base.T  # non-contiguous
    v_cache = torch.randn(3, 4, 5).permute(2, 0, 1)
    expected = {"k": k_cache.clone(), "v": v_cache.clone()}
    adapter = torch_adapter.TorchAdapter()
    adapter.add_tensors("kv_cache", {"k": k_cache, "v": v_cache})
    assert adapter.tags == ["kv_cache"]

    adapter.snapshot(OFFLOAD, ["kv_cache"])
    adapter.restore(["kv_cache"])

    assert torch.equal(k_cache, expected["k"]) and torch.equal(v_cache, expected["v"])
    assert k_cache.stride() == expected["k"].T.contiguous().T.stride()
    assert base.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()


def test_moves_are_idempotent_and_counted(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    assert adapter.restore().device_bytes == 0

    first = adapter.snapshot(OFFLOAD, ["weights"])
    again = adapter.snapshot(OFFLOAD, ["weights"])

    assert again.device_bytes == 0 and again.host_bytes == first.host_bytes
    assert adapter.restore(["weights"]).device_bytes == first.device_bytes
    assert adapter.restore(["weights"]).device_bytes == 0
    assert adapter.stats == torch_adapter.TorchAdapterStats(
        snapshots=2,
        bytes_out=first.device_bytes,
        restores=3,
        bytes_in=first.device_bytes,
        bytes_copied_out=first.device_bytes,
        host_allocations=1,
    )


def test_staged_restore_brings_back_only_the_asked_tags(trained) -> None:
    model, optimizer = trained
    before = snapshot_of(model, optimizer)
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    adapter.snapshot(OFFLOAD)

    staged = adapter.restore(["weights"])

    assert adapter.resident_tags == ["weights"]
    assert staged.host_bytes > 0  # lora and optimizer still saved
    assert next(iter(optimizer.state.values()))["exp_avg"].untyped_storage().nbytes() == 0
    adapter.restore()
    assert_bit_identical(before, snapshot_of(model, optimizer))


def test_unknown_tag_is_refused_and_nothing_moves(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    with pytest.raises(ValueError, match=r"unknown tag\(s\) 'kv_cache'.*weights, lora, optimizer"):
        adapter.snapshot(OFFLOAD, ["weights", "kv_cache"])
    assert model.embed.weight.untyped_storage().nbytes() > 0
    assert adapter.suspended_tags == []


def test_memory_torch_cannot_free_is_refused_before_anything_moves() -> None:
    np = pytest.importorskip("numpy")
    fine = torch.randn(10)
    foreign = torch.from_numpy(np.zeros(10, dtype=np.float32))
    adapter = torch_adapter.TorchAdapter()
    adapter.add_tensors("scratch", {"fine": fine, "foreign": foreign})

    with pytest.raises(ValueError, match="scratch/foreign uses memory that torch cannot free"):
        adapter.snapshot(OFFLOAD)

    assert fine.untyped_storage().nbytes() == 40
    assert adapter.suspended_tags == []


def test_storage_shared_with_a_resident_tag_is_refused() -> None:
    base = torch.randn(10)
    adapter = torch_adapter.TorchAdapter()
    adapter.add_tensors("a", {"head": base[:5]})
    adapter.add_tensors("b", {"tail": base[5:]})

    with pytest.raises(ValueError, match="a/head shares memory with b/tail; move tag 'b' together"):
        adapter.snapshot(OFFLOAD, ["a"])
    assert base.untyped_storage().nbytes() == 40

    expected = base.clone()
    adapter.snapshot(OFFLOAD, ["a", "b"])
    adapter.restore()
    assert torch.equal(base, expected)


def test_custom_tag_names_and_values_are_checked() -> None:
    adapter = torch_adapter.TorchAdapter()
    with pytest.raises(ValueError, match="custom tag 'weights' is not allowed"):
        adapter.add_tensors("weights", {"x": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"kv/x is a list, not a torch\.Tensor"):
        adapter.add_tensors("kv", {"x": [1, 2]})  # type: ignore[dict-item]
    adapter.add_tensors("kv", {"x": torch.zeros(4)})
    adapter.snapshot(OFFLOAD)
    with pytest.raises(RuntimeError, match="tag 'kv' is suspended"):
        adapter.add_tensors("kv", {"y": torch.zeros(1)})


def test_stray_use_of_a_suspended_tensor_fails_loudly(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    adapter.snapshot(OFFLOAD)
    assert model.embed.weight.shape == (0,)
    with pytest.raises(RuntimeError):
        model(torch.zeros(1, 2, dtype=torch.int64))
    adapter.restore()
    model(torch.zeros(1, 2, dtype=torch.int64))


def test_small_chunks_give_the_same_bytes(trained) -> None:
    model, optimizer = trained
    before = snapshot_of(model, optimizer)
    adapter = torch_adapter.TorchAdapter(model, optimizer, chunk_bytes=7)
    adapter.snapshot(OFFLOAD)
    adapter.restore()
    assert_bit_identical(before, snapshot_of(model, optimizer))


def test_release_host_buffers_frees_only_resident_tags(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    adapter.snapshot(OFFLOAD)
    adapter.restore(["weights"])
    adapter.release_host_buffers()
    assert adapter.host_buffer_bytes > 0  # lora and optimizer still saved there
    adapter.restore()
    adapter.release_host_buffers()
    assert adapter.host_buffer_bytes == 0


def test_declares_modes_and_tags_and_reports_residency(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    assert isinstance(adapter, base.WorkloadAdapter)
    caps = adapter.capabilities()
    assert caps.supported_modes == (OFFLOAD, DISCARD) and caps.default_mode == OFFLOAD
    assert caps.tags == ("weights", "lora", "optimizer")
    assert adapter.state() == base.AdapterState(
        suspended=False, resident_tags=("weights", "lora", "optimizer")
    )

    adapter.snapshot("offload", ["optimizer"])  # mode names are accepted too

    assert adapter.state() == base.AdapterState(suspended=True, resident_tags=("weights", "lora"))
    with pytest.raises(ValueError, match="unknown suspend mode 'hibernate'"):
        adapter.snapshot("hibernate", ["weights"])
    assert adapter.state().resident_tags == ("weights", "lora")


def test_a_model_without_lora_parameters_declares_no_lora_tag() -> None:
    adapter = torch_adapter.TorchAdapter(torch.nn.Linear(2, 2))
    assert adapter.capabilities().tags == ("weights",)


def test_host_buffers_can_be_reserved_before_the_first_switch(trained) -> None:
    model, optimizer = trained
    adapter = torch_adapter.TorchAdapter(model, optimizer)

    reserved = adapter.reserve_host_buffers()

    assert reserved == adapter.host_buffer_bytes > 0
    pointers = {tag: adapter._buffers.get(tag).data_ptr() for tag in adapter.tags}
    assert model.embed.weight.untyped_storage().nbytes() > 0  # nothing moved
    adapter.snapshot(OFFLOAD)
    assert {tag: adapter._buffers.get(tag).data_ptr() for tag in adapter.tags} == pointers
    assert adapter.host_buffer_bytes == reserved
