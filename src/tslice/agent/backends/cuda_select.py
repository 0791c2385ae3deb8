"""Which checkpoint driver a node uses: the cuda-bindings one, the ``cuda-checkpoint``
binary, or the fake (tests). Apart from the drivers' contract (``cuda_driver``), which
every driver imports."""

from __future__ import annotations

import importlib

from tslice.agent.backends import base, cuda_binary, cuda_bindings, cuda_driver, cuda_fake


def select_driver(
    *, preference: str = "auto", binary: str | None = None
) -> cuda_driver.CheckpointDriver:
    """Pick the driver for this node.

    ``auto``: the bindings if ``cuda.bindings`` is importable and exposes the
    checkpoint API, else the ``cuda-checkpoint`` binary if found, else
    :class:`~tslice.agent.backends.base.BackendUnavailableError`. A missing GPU or
    NVIDIA driver is reported as such (it is not hidden by a fallback).
    """
    if preference == "fake":
        return cuda_fake.FakeDriver(auto_add=True)
    if preference == "bindings":
        return cuda_bindings.BindingsDriver()
    if preference == "binary":
        return cuda_binary.BinaryDriver(path=binary)
    if preference != "auto":
        raise base.BackendUnavailableError(
            f"unknown cuda driver {preference!r}; use auto, bindings, binary or fake"
        )
    bindings_problem = _bindings_missing()
    if bindings_problem is None:
        return cuda_bindings.BindingsDriver()
    path = cuda_binary.find_binary(binary)
    if path is not None:
        return cuda_binary.BinaryDriver(path=path)
    raise base.BackendUnavailableError(
        f"CUDA checkpointing is unavailable on this node: {bindings_problem}, and "
        "cuda-checkpoint was not found on PATH or at "
        f"{binary or cuda_binary.FALLBACK_BINARY}; {cuda_driver.INSTALL_HINT}"
    )


def _bindings_missing() -> str | None:
    """Why the bindings cannot be used (None if they can)."""
    try:
        module = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        return "cuda-bindings is not installed"
    except Exception as exc:  # a broken install must not crash driver selection
        return f"cuda-bindings failed to import ({exc})"
    if not hasattr(module, "cuCheckpointProcessLock"):
        return "the installed cuda-bindings predates the checkpoint API (need >= 12.9.1)"
    return cuda_driver.bindings_too_old(cuda_driver.installed_bindings_version())
