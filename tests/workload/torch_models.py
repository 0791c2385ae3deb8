"""A small model with every kind of tensor TorchAdapter must move (mixed dtypes, a
non-contiguous view, tied weights), its training, and a bit-exact comparison; import it
after ``pytest.importorskip("torch")``."""

from __future__ import annotations

import torch


class LoraLinear(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(dim, dim)
        self.lora_a = torch.nn.Parameter(torch.randn(2, dim) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(dim, 2) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


class Mixed(torch.nn.Module):
    """float32 and bfloat16 parameters, an int64 buffer, a non-contiguous buffer
    viewing another one, and tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.block = LoraLinear(8)
        self.narrow = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, one storage
        self.register_buffer("counts", torch.arange(10, dtype=torch.int64) * 7)
        grid = torch.randn(6, 6)
        self.register_buffer("grid", grid)
        self.register_buffer("grid_cols", grid[:, ::2])  # non-contiguous view of `grid`

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.block(self.embed(tokens))
        hidden = hidden + self.narrow(hidden.to(torch.bfloat16)).float()
        return self.head(hidden)


def train_steps(model: Mixed, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 16, (4, 5), generator=generator)
        optimizer.zero_grad()
        model(tokens).square().mean().backward()
        optimizer.step()


def snapshot_of(model: Mixed, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            tensors[f"opt.{index}.{key}"] = value.clone()
    return tensors


def assert_bit_identical(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]
) -> None:
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype, name
        assert got.shape == tensor.shape, name
        # Compare raw bytes so that NaN payloads and -0.0 count too.
        assert torch.equal(_raw_bytes(got), _raw_bytes(tensor)), name


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
