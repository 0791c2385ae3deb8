"""TorchAdapter on a CUDA device: memory really leaves the GPU, pinned buffers, bit-exact."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tslice.workload.adapters import torch as torch_adapter  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1024 * 1024


@pytest.fixture
def cuda_job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values()]
    return tensors


def test_offload_hands_memory_back_and_restores_bit_exact(cuda_job) -> None:
    model, optimizer = cuda_job
    before = _state(model, optimizer)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    adapter = torch_adapter.TorchAdapter(model, optimizer, chunk_bytes=4 * MIB)

    out = adapter.snapshot(torch_adapter.OFFLOAD)

    assert out.device_bytes > 40 * MIB
    assert torch.cuda.memory_allocated() <= allocated - out.device_bytes
    assert torch.cuda.memory_reserved() < reserved  # returned to the driver, not just cached
    assert all(adapter._buffers.get(tag).is_pinned() for tag in adapter.tags)

    adapter.restore()

    after = _state(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(p.is_cuda for p in model.parameters())


def test_pinned_buffers_are_reused_and_training_continues(cuda_job) -> None:
    model, optimizer = cuda_job
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    adapter.snapshot(torch_adapter.OFFLOAD)
    pointers = {tag: adapter._buffers.get(tag).data_ptr() for tag in adapter.tags}
    adapter.restore()

    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        optimizer.step()
        adapter.snapshot(torch_adapter.OFFLOAD)
        assert {tag: adapter._buffers.get(tag).data_ptr() for tag in adapter.tags} == pointers
        adapter.restore()
