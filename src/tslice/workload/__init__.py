"""Workload layer: what runs inside a job's process.

``register_workload`` connects the process to its node agent over the workload
channel, so that the agent can tell it to move its device state (``snapshot``) and
bring it back (``restore``) at every time-slice switch. Adapters do the moving:
PyTorch modules and optimizers (``TorchAdapter``), vLLM and SGLang engines, or
plain callbacks.

``TorchAdapter`` and ``announce_process`` are imported on first use, so importing
this package never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tslice.workload.adapters.base import (
    AdapterResult,
    AdapterState,
    Capabilities,
    SuspendMode,
    WorkloadAdapter,
)
from tslice.workload.adapters.callbacks import CallbackAdapter, SnapshottableAdapter
from tslice.workload.adapters.sglang import SglangAdapter
from tslice.workload.adapters.vllm import VllmAdapter
from tslice.workload.channel import WorkloadHandle, register_workload

if TYPE_CHECKING:
    from tslice.workload.adapters.torch import TorchAdapter
    from tslice.workload.process import announce_process

# Name -> module holding it, imported on first attribute access.
_LAZY = {
    "TorchAdapter": "tslice.workload.adapters.torch",
    "announce_process": "tslice.workload.process",
}

__all__ = [
    "AdapterResult",
    "AdapterState",
    "CallbackAdapter",
    "Capabilities",
    "SglangAdapter",
    "SnapshottableAdapter",
    "SuspendMode",
    "TorchAdapter",
    "VllmAdapter",
    "WorkloadAdapter",
    "WorkloadHandle",
    "announce_process",
    "register_workload",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tslice.workload' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            raise ImportError(
                f"tslice.workload.{name} needs PyTorch: pip install 'tslice[torch]'"
            ) from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value
