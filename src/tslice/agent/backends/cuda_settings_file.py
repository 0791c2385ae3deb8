"""The file boundary of the ``cuda`` backend's settings (pydantic)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import pydantic

from tslice.agent.backends import cuda_driver, sections


class _SettingsModel(pydantic.BaseModel):
    """File/env boundary for :class:`CudaSettings`."""

    model_config = pydantic.ConfigDict(extra="forbid")

    driver: Literal["auto", "bindings", "binary", "fake"] = "auto"
    binary: str | None = None
    lock_timeout_ms: int = pydantic.Field(10_000, gt=0, le=2**31 - 1)
    operation_timeout_s: float = pydantic.Field(300.0, gt=0)
    rollback_timeout_s: float = pydantic.Field(120.0, gt=0)
    device_map: dict[str, str] = pydantic.Field(default_factory=dict)
    parallel_processes: int = pydantic.Field(0, ge=0)
    state_timeout_s: float = pydantic.Field(30.0, gt=0)
    nccl_guard: bool = True
    hook_timeout_s: float = pydantic.Field(60.0, gt=0)
    proc_root: str = "/proc"
    measure_bytes: bool = True
    released_tolerance_bytes: int = pydantic.Field(16 * 2**20, ge=0)
    repair_on_recover: bool = True

    @pydantic.field_validator("device_map")
    @classmethod
    def _uuids(cls, value: dict[str, str]) -> dict[str, str]:
        mapped = {
            cuda_driver.normalize_gpu_uuid(k): cuda_driver.normalize_gpu_uuid(v)
            for k, v in value.items()
        }
        if set(mapped.values()) != set(mapped):
            raise ValueError(
                "device_map must be a permutation of the node's GPUs: every GPU it maps "
                "from is mapped to, once (the driver restores only with every checkpointed "
                "GPU in the map)"
            )
        return mapped


def validate(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings, validated and normalised; ConfigError names the field and the fix."""
    return sections.validate(_SettingsModel, settings, backend="cuda").model_dump()
