"""Settings of the ``cuda`` backend: the frozen values it uses (the file boundary, with
pydantic, is :mod:`tslice.agent.backends.cuda_settings_file`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal


@dataclasses.dataclass(frozen=True)
class CudaSettings:
    """Settings of the cuda backend (agent config section ``backends.cuda``)."""

    #: Which checkpoint driver: ``auto`` (cuda-bindings, else the cuda-checkpoint
    #: binary), ``bindings``, ``binary``, or ``fake`` (in-memory, for demos and tests).
    driver: Literal["auto", "bindings", "binary", "fake"] = "auto"
    #: Path of ``cuda-checkpoint``; default: PATH, then /usr/local/bin.
    binary: str | None = None
    #: How long a lock may wait for the process's in-flight CUDA calls, ms. Default
    #: 10 000. On timeout the process keeps running and the snapshot is retried.
    lock_timeout_ms: int = 10_000
    #: Deadline of one snapshot or restore of a job (all its processes), seconds.
    #: Default 300, below the agent's own operation deadline so a rollback fits.
    operation_timeout_s: float = 300.0
    #: Budget for rolling a failed snapshot back, seconds. Default 120.
    rollback_timeout_s: float = 120.0
    #: GPU remap applied at every restore, old UUID → new UUID (driver >= 580 and a
    #: cuda-bindings with ``gpuPairs``, checked at start). A permutation of the node's
    #: GPUs: the driver wants every checkpointed GPU in the map. Applied at *every*
    #: restore, so a map other than the identity moves the jobs at every cycle: it is for
    #: restoring states saved before the node's GPUs were renumbered or swapped, once.
    #: A map the driver refuses is dropped (the job lands where it was). Default: none.
    device_map: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Processes of a job moved at once per phase (lock, checkpoint, restore, unlock);
    #: 0 = all of them (one per GPU link). Default 0.
    parallel_processes: int = 0
    #: Longest wait for one state read, seconds (it can hang: cuda-checkpoint #30).
    #: Default 30; the operation then fails, changing nothing.
    state_timeout_s: float = 30.0
    #: Refuse (nothing changed) a snapshot of a job whose processes hold NCCL
    #: communicators with peers on this node (they map ``/dev/shm/nccl-*``) unless every
    #: process of the job announced quiesce hooks: locking one rank makes the others'
    #: collectives hang (cuda-checkpoint #30, #45). Default true.
    nccl_guard: bool = True
    #: How long a workload's quiesce or resume hook may take, seconds. Default 60.
    hook_timeout_s: float = 60.0
    #: Where process information lives (tests point this at a fixture tree).
    proc_root: str = "/proc"
    #: Measure bytes moved with NVML, and check that a snapshot freed the processes'
    #: memory. Default true; without NVML bytes read 0 and the release is not verified.
    measure_bytes: bool = True
    #: Device bytes a checkpointed process may still show in NVML; more makes the
    #: snapshot fatal (the job FAULTED, never SAVED with its memory held). Default
    #: 16 MiB (a checkpointed process normally shows none: it leaves NVML's list).
    released_tolerance_bytes: int = 16 * 2**20
    #: On recover(): unlock processes left LOCKED and checkpoint the resident rest of a
    #: half-checkpointed job, so the job ends SAVED or RUNNING instead of FAULTED. Both
    #: actions only keep or free device memory, never load it. Default true.
    repair_on_recover: bool = True


def parse_settings(settings: Mapping[str, Any]) -> CudaSettings:
    """Validate a settings mapping; ConfigError names the field and the fix.

    (pydantic is imported here, on use: the backend itself runs without it, as on a GPU
    machine that carries only tslice, see bench/gpu_check.py.)
    """
    from tslice.agent.backends import cuda_settings_file

    return CudaSettings(**cuda_settings_file.validate(settings))
