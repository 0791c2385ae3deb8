"""The CUDA driver checkpoint API behind one small async interface.

The cuda backend needs five per-process primitives (get_state, lock with a
timeout, checkpoint, restore with an optional GPU remap, unlock). NVIDIA exposes
them two ways, and this module hides which one a node has:

* ``cuda_bindings.BindingsDriver`` calls ``cuda.bindings.driver.cuCheckpointProcess*``
  (package ``cuda-bindings``, extra ``tslice[gpu]``). Driver calls block, so each
  one runs in a worker thread.
* ``cuda_binary.BinaryDriver`` runs NVIDIA's ``cuda-checkpoint`` tool, one ``--pid``
  per call, as an asyncio subprocess whose output ends up in the error text.
* ``cuda_fake.FakeDriver`` is the shipped test double: per-PID states that follow the
  driver's state machine, injectable failures, lock timeouts and hangs.

Every method is a coroutine without its own deadline: the caller bounds it with
``asyncio.wait_for``. Cancelling a ``BinaryDriver`` call kills the tool; a
``BindingsDriver`` call cannot be interrupted (the thread finishes on its
own), which the backend accounts for by treating a deadline as "state unknown".

This module is the contract (states, errors, the abstract driver) and the choice of
driver; each driver lives in its own module, imported only when it is chosen, so
nothing is imported from ``cuda`` or ``pynvml`` at module import time.
"""

from __future__ import annotations

import abc
import enum
import importlib
import re
from collections.abc import Mapping
from typing import ClassVar

#: CUDA 12.8 = driver r570: the first with the checkpoint API and lock timeouts.
MIN_DRIVER_VERSION = 12080
#: CUDA 13.0 = driver r580: the first that restores onto other GPUs (``gpuPairs``).
MIN_DEVICE_MAP_DRIVER_VERSION = 13000
#: The first cuda-bindings whose driver calls release the GIL (12.9.1, and 13.0.0 on):
#: with an older one a checkpoint freezes the agent's event loop for its whole length.
MIN_BINDINGS_VERSION = (12, 9, 1)
INSTALL_HINT = "install tslice[gpu] (cuda-bindings) or put NVIDIA's cuda-checkpoint on PATH"
_MAX_OUTPUT_CHARS = 2000
_UUID_RE = re.compile(
    r"^(?:GPU-)?([0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12})$",
    re.IGNORECASE,
)


class ProcessState(enum.Enum):
    """CUDA checkpoint state of one process (``CUprocessState``)."""

    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


class DriverError(Exception):
    """A checkpoint call failed for one process; ``code`` is the driver's error name."""

    def __init__(self, message: str, *, pid: int, op: str, code: str = "") -> None:
        super().__init__(message)
        self.pid = pid
        self.op = op
        self.code = code


class LockTimeoutError(DriverError):
    """The lock did not take within its timeout; the process is still RUNNING (the
    caller confirms that by reading the state: :meth:`ProcessSteps.save`)."""


#: What ``cuCheckpointProcessLock`` returns when its ``timeoutMs`` ran out: the driver
#: documents ``CUDA_ERROR_NOT_READY``; ``CUDA_ERROR_TIMEOUT`` is taken the same way.
LOCK_TIMEOUT_CODES = frozenset({"CUDA_ERROR_NOT_READY", "CUDA_ERROR_TIMEOUT"})


class ProcessNotSupportedError(DriverError):
    """The driver refuses to checkpoint this one process (``CUDA_ERROR_NOT_SUPPORTED`` from
    a per-process call): it uses something the driver cannot save. Nothing about the
    node's driver: other processes may checkpoint fine, and retrying will not help."""


class NoCudaContextError(DriverError):
    """The process has no CUDA context (it never initialised CUDA, or not yet): the
    driver has nothing to checkpoint in it."""


#: Why a per-process ``CUDA_ERROR_NOT_SUPPORTED`` happens, for the message.
NOT_SUPPORTED_WHY = (
    "the process uses something the driver cannot checkpoint: CUDA IPC memory "
    "(cudaIpc*/cuMemExportToShareableHandle, used by NCCL's P2P transport and by "
    "multi-process engines), UVM/managed memory on a driver that cannot save it, or a "
    "vGPU; the other processes are not concerned. Move this job with the app-channel "
    "backend (its own adapter copies the memory), or run it without those features"
)

GpuPairs = Mapping[str, str]


def normalize_gpu_uuid(value: str) -> str:
    """Return ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` or raise ValueError."""
    match = _UUID_RE.match(value.strip())
    if not match:
        raise ValueError(
            f"{value!r} is not a GPU UUID; use the form nvidia-smi -L prints "
            "(GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
        )
    hexdigits = match.group(1).replace("-", "").lower()
    parts = (hexdigits[:8], hexdigits[8:12], hexdigits[12:16], hexdigits[16:20], hexdigits[20:])
    return "GPU-" + "-".join(parts)


class CheckpointDriver(abc.ABC):
    """Per-process checkpoint primitives. Calls for one PID must not overlap."""

    #: Short name reported in logs and persisted with the job ("bindings", "binary", "fake").
    name: ClassVar[str]

    @abc.abstractmethod
    async def get_state(self, pid: int) -> ProcessState:
        """Read the process's checkpoint state. Raises DriverError."""

    @abc.abstractmethod
    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        """RUNNING → LOCKED. Raises LockTimeoutError if it did not take in time."""

    @abc.abstractmethod
    async def checkpoint(self, pid: int) -> None:
        """LOCKED → CHECKPOINTED (device memory copied to host, GPU released)."""

    @abc.abstractmethod
    async def restore(self, pid: int, *, gpu_pairs: GpuPairs | None = None) -> None:
        """CHECKPOINTED → LOCKED, optionally onto other GPUs (old UUID → new UUID)."""

    @abc.abstractmethod
    async def unlock(self, pid: int) -> None:
        """LOCKED → RUNNING."""

    async def device_count(self) -> int | None:
        """GPUs the driver sees, or None if this driver cannot tell."""
        return None

    def calls_in_flight(self) -> dict[int, str]:
        """PID → operation of driver calls that have not returned yet, including calls
        whose caller gave up (a deadline): a PID listed here must not be called into."""
        return {}

    async def check_device_map(self) -> None:  # noqa: B027 - optional hook
        """Raise BackendUnavailableError (saying why) if restores cannot take a GPU map
        on this node. Default: they can."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release driver resources."""


def installed_bindings_version() -> str | None:
    """``cuda.bindings.__version__``, or None if it cannot be read."""
    try:
        version = importlib.import_module("cuda.bindings").__version__
    except Exception:  # absent, broken, or no version: not ours to fail on here
        return None
    return str(version)


def bindings_too_old(version: str | None) -> str | None:
    """Why cuda-bindings ``version`` must not be used (None if it may, or is unknown)."""
    if version is None:
        return None
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:3])
    if numbers and numbers < MIN_BINDINGS_VERSION:
        return (
            f"cuda-bindings {version} holds the GIL during driver calls, so a checkpoint "
            "would freeze the agent; install cuda-bindings >= 12.9.1 (pip install -U "
            "'tslice[gpu]')"
        )
    return None
