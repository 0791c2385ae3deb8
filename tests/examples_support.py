"""What the tests that drive an ``examples/`` script share: loading it as a module, and
reading back the tensors its jobs saved. torch is imported on use: the job-side venvs that
collect these tests may have none (their tests skip first)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def tensors(state: object, prefix: str = "") -> dict[str, Any]:
    """Every tensor of a nested state (model and optimizer state_dicts), by path."""
    import torch

    found: dict[str, Any] = {}
    if isinstance(state, torch.Tensor):
        found[prefix] = state
    elif isinstance(state, dict):
        for key, value in state.items():
            found.update(tensors(value, f"{prefix}/{key}"))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            found.update(tensors(value, f"{prefix}/{index}"))
    return found
