"""Builders for ``BackendConfig`` messages (llm-d's helper names), validated before
anything is sent, plus ``sim_config``/``noop_config`` for tslice's own backends."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
# The agent uses the name as one directory name: one safe path segment, no dots.
_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9_-]+")

_APPS = {"vllm": pb.APP_VLLM, "sglang": pb.APP_SGLANG}
_MODES = {"offload": pb.SUSPEND_MODE_OFFLOAD, "discard": pb.SUSPEND_MODE_DISCARD}


@dataclasses.dataclass(frozen=True)
class MemoryRegion:
    """A device-memory range of one process (``memory_regions`` backend)."""

    pid: int
    address: int
    size_bytes: int

    def __post_init__(self) -> None:
        for name in ("pid", "address", "size_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"memory region {name} must be an int, got {type(value).__name__}")
        if not 0 < self.pid <= _INT32_MAX:
            raise ValueError(f"memory region pid must be in 1..{_INT32_MAX}, got {self.pid}")
        if not 0 <= self.address <= _UINT64_MAX:
            raise ValueError(f"memory region address must fit in uint64, got {self.address}")
        if not 0 < self.size_bytes <= _UINT64_MAX:
            raise ValueError(
                "memory region size_bytes must be positive and fit in uint64, "
                f"got {self.size_bytes}"
            )

    @classmethod
    def from_spec(cls, spec: str) -> MemoryRegion:
        """Parse ``"pid:address:size"`` (each decimal or ``0x`` hex)."""
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"memory region {spec!r} must look like 'pid:0xADDRESS:size'")
        try:
            pid, address, size = (int(part, 0) for part in parts)
        except ValueError as err:
            raise ValueError(f"memory region {spec!r}: {err}") from err
        return cls(pid=pid, address=address, size_bytes=size)


def _pids(pids: Sequence[int]) -> pb.ProcessTarget:
    if not pids:
        raise ValueError("at least one PID is required")
    for pid in pids:
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= _INT32_MAX:
            raise ValueError(f"PIDs must be positive integers, got {pid!r}")
    return pb.ProcessTarget(pids=list(pids))


def _mode(mode: str | int | None) -> int:
    if mode is None:
        return pb.SUSPEND_MODE_UNSPECIFIED
    if isinstance(mode, str):
        try:
            return _MODES[mode.lower()]
        except KeyError:
            raise ValueError(
                f"unknown suspend mode {mode!r}; use one of {sorted(_MODES)}"
            ) from None
    pb.SuspendMode.Name(mode)  # ValueError if unknown
    return mode


def _tags(tags: Sequence[str] | None) -> list[str]:
    if isinstance(tags, str):
        raise ValueError("tags must be a list of strings, not one string")
    values = list(tags or ())
    if any(not isinstance(tag, str) or not tag for tag in values):
        raise ValueError(f"tags must be non-empty strings, got {values!r}")
    return values


def cuda_config(pids: Sequence[int] | None = None) -> pb.BackendConfig:
    """The cuda backend; without ``pids`` the agent finds the job's processes itself."""
    cuda = pb.CudaBackendConfig()
    if pids is not None:
        cuda.explicit_target.CopyFrom(_pids(pids))
    return pb.BackendConfig(cuda=cuda)


def direct_memory_config(pids: Sequence[int] | None = None) -> pb.BackendConfig:
    """The direct-memory backend (behind a feature gate on the agent)."""
    direct = pb.DirectMemoryBackendConfig()
    if pids is not None:
        direct.explicit_target.CopyFrom(_pids(pids))
    return pb.BackendConfig(direct_memory=direct)


def app_endpoint_config(
    app: str | int,
    endpoints: Sequence[str],
    mode: str | int | None = None,
    tags: Sequence[str] | None = None,
) -> pb.BackendConfig:
    """An engine's HTTP API: ``app`` is "vllm" or "sglang", ``endpoints`` its base URLs."""
    if isinstance(app, str):
        try:
            app_value: int = _APPS[app.lower()]
        except KeyError:
            raise ValueError(f"unknown app {app!r}; use one of {sorted(_APPS)}") from None
    else:
        pb.App.Name(app)  # ValueError if unknown
        app_value = app
    if app_value == pb.APP_UNSPECIFIED:
        raise ValueError(f"app must be one of {sorted(_APPS)}")
    if isinstance(endpoints, str):
        raise ValueError("endpoints must be a list of URLs, not one string")
    urls = list(endpoints)
    if not urls or any(not isinstance(url, str) or not url for url in urls):
        raise ValueError("at least one non-empty endpoint URL is required")
    return pb.BackendConfig(
        app_endpoint=pb.AppEndpointConfig(
            app=app_value,  # type: ignore[arg-type]
            endpoints=urls,
            mode=_mode(mode),  # type: ignore[arg-type]
            tags=_tags(tags),
        )
    )


def vllm_config(
    endpoints: Sequence[str], mode: str | int | None = None, tags: Sequence[str] | None = None
) -> pb.BackendConfig:
    return app_endpoint_config("vllm", endpoints, mode=mode, tags=tags)


def sglang_config(
    endpoints: Sequence[str], mode: str | int | None = None, tags: Sequence[str] | None = None
) -> pb.BackendConfig:
    return app_endpoint_config("sglang", endpoints, mode=mode, tags=tags)


def app_channel_config(
    mode: str | int | None = None, tags: Sequence[str] | None = None
) -> pb.BackendConfig:
    """The workload channel of the job (see ``register_workload``)."""
    return pb.BackendConfig(
        app_channel=pb.AppChannelConfig(mode=_mode(mode), tags=_tags(tags))  # type: ignore[arg-type]
    )


def memory_regions_config(
    regions: Sequence[MemoryRegion | tuple[int, int, int] | str], snapshot_name: str = ""
) -> pb.BackendConfig:
    """Selected device-memory regions (behind a feature gate on the agent)."""
    if snapshot_name and not _SNAPSHOT_NAME.fullmatch(snapshot_name):
        raise ValueError(
            f"snapshot_name {snapshot_name!r} may only contain letters, digits, '-' and '_'"
        )
    if not regions:
        raise ValueError("at least one memory region is required")
    parsed: list[MemoryRegion] = []
    for region in regions:
        if isinstance(region, MemoryRegion):
            parsed.append(region)
        elif isinstance(region, str):
            parsed.append(MemoryRegion.from_spec(region))
        elif isinstance(region, tuple) and len(region) == 3:
            parsed.append(MemoryRegion(pid=region[0], address=region[1], size_bytes=region[2]))
        else:
            raise TypeError(
                "a memory region is a MemoryRegion, a (pid, address, size_bytes) tuple or a "
                f"'pid:address:size' string, got {region!r}"
            )
    return pb.BackendConfig(
        memory_regions=pb.MemoryRegionsBackendConfig(
            regions=[
                pb.MemoryRegion(pid=r.pid, address=r.address, size_bytes=r.size_bytes)
                for r in parsed
            ],
            snapshot_name=snapshot_name,
        )
    )


def sim_config(footprint_bytes: int = 0) -> pb.BackendConfig:
    """tslice: the simulated-accelerator backend (0 = the agent's default footprint)."""
    if footprint_bytes < 0:
        raise ValueError(f"footprint_bytes must be >= 0, got {footprint_bytes}")
    return pb.BackendConfig(sim=pb.SimBackendConfig(footprint_bytes=footprint_bytes))


def noop_config() -> pb.BackendConfig:
    """tslice: the no-op backend."""
    return pb.BackendConfig(noop=pb.NoopBackendConfig())
