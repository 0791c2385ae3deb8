"""In-process adapters: the code that moves a workload's device state when the agent says so.

``base.WorkloadAdapter`` is the contract; ``callbacks``, ``vllm`` and ``sglang`` hold the
adapters for user callbacks, vLLM and SGLang engines. ``TorchAdapter`` (PyTorch modules
and optimizers) lives in ``tslice.workload.adapters.torch`` and is imported only on
demand, so torch stays optional.
"""

from __future__ import annotations

import sys
from typing import Any

from tslice.workload.adapters import base, callbacks, sglang, vllm


def resolve_adapter(
    *,
    workload: object | None = None,
    on_snapshot: callbacks.SnapshotCallback | None = None,
    on_restore: callbacks.RestoreCallback | None = None,
) -> base.WorkloadAdapter:
    """Pick the adapter for what ``register_workload`` was given.

    In order: explicit callbacks; a ``WorkloadAdapter``; a PyTorch module, optimizer or
    ``(module, optimizer)`` pair (TorchAdapter, imported only then); an engine with
    ``sleep``/``wake_up`` (vLLM); one with ``release_memory_occupation`` (SGLang); any
    object with ``snapshot``/``restore`` methods.
    """
    if on_snapshot is not None or on_restore is not None:
        if workload is not None:
            raise ValueError("pass either workload= or on_snapshot=/on_restore=, not both")
        if on_snapshot is None or on_restore is None:
            missing = "on_restore" if on_restore is None else "on_snapshot"
            raise ValueError(f"{missing} is required when callbacks are used (give both)")
        return callbacks.CallbackAdapter(on_snapshot=on_snapshot, on_restore=on_restore)
    if workload is None:
        raise ValueError(
            "nothing to register: pass workload= (a module, engine or WorkloadAdapter) "
            "or on_snapshot= and on_restore= callbacks"
        )
    if isinstance(workload, base.WorkloadAdapter):
        return workload
    torch_adapter = _torch_adapter(workload)
    if torch_adapter is not None:
        return torch_adapter
    if vllm.looks_like_vllm(workload):
        return vllm.VllmAdapter(workload)
    if sglang.looks_like_sglang(workload):
        return sglang.SglangAdapter(workload)
    if callable(getattr(workload, "snapshot", None)) and callable(
        getattr(workload, "restore", None)
    ):
        return callbacks.SnapshottableAdapter(workload)
    raise TypeError(
        f"cannot drive a {type(workload).__name__}: expected a torch.nn.Module or optimizer, "
        "a vLLM engine (sleep/wake_up), an SGLang engine (release/resume_memory_occupation), "
        "an object with snapshot()/restore(), or a tslice.workload.WorkloadAdapter"
    )


def _torch_adapter(workload: object) -> base.WorkloadAdapter | None:
    # A torch object can only exist if torch is already imported: never import it here.
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    module_cls, optimizer_cls = torch.nn.Module, torch.optim.Optimizer
    module: object | None = None
    optimizer: object | None = None
    if isinstance(workload, module_cls):
        module = workload
    elif isinstance(workload, optimizer_cls):
        optimizer = workload
    elif (
        isinstance(workload, tuple)
        and len(workload) == 2
        and isinstance(workload[0], module_cls)
        and isinstance(workload[1], optimizer_cls)
    ):
        module, optimizer = workload
    else:
        return None
    from tslice.workload.adapters import torch as torch_adapters

    return torch_adapters.TorchAdapter(module, optimizer)  # type: ignore[arg-type,unused-ignore]
