"""Is this node ready for an agent? The checks of ``tslice doctor`` on a node.

Each check says what it found and, when something is wrong, what to do. The GPU checks
(driver, checkpoint API, NVML) block only where the agent's backends need a GPU (``cuda``);
on a node of simulated devices they are informational. Nothing here changes the node.
"""

from __future__ import annotations

import dataclasses
import enum
import grp
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

#: Host memory below which parking a job's state is hopeless, bytes.
MIN_HOST_MEMORY = 1024**3
#: The oldest driver branch with CUDA checkpointing (cuda-checkpoint, the driver API).
MIN_DRIVER_MAJOR = 550
GPU_BACKENDS = frozenset({"cuda"})


class Level(enum.Enum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "FAIL"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str

    @property
    def blocks(self) -> bool:
        return self.level is Level.FAIL


def _missing(needed: bool) -> Level:
    return Level.FAIL if needed else Level.INFO


def driver(needed: bool, proc: Path = Path("/proc")) -> Check:
    """The NVIDIA kernel driver's version (``/proc/driver/nvidia/version``)."""
    try:
        text = (proc / "driver" / "nvidia" / "version").read_text()
    except OSError:
        return Check(
            "NVIDIA driver",
            _missing(needed),
            "not loaded (no /proc/driver/nvidia/version): install the NVIDIA driver "
            f"(>= {MIN_DRIVER_MAJOR}) and load it",
        )
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+)\.(\d+)(?:\.(\d+))?", text)
    if found is None:
        return Check("NVIDIA driver", Level.WARN, f"version not understood: {text.strip()[:80]}")
    version = ".".join(g for g in found.groups() if g)
    if int(found.group(1)) < MIN_DRIVER_MAJOR:
        return Check(
            "NVIDIA driver",
            _missing(needed),
            f"{version}: CUDA checkpointing needs >= {MIN_DRIVER_MAJOR}; upgrade the driver",
        )
    return Check("NVIDIA driver", Level.OK, version)


def checkpoint(needed: bool) -> Check:
    """The CUDA checkpoint API (cuda-bindings >= 12.8) or the ``cuda-checkpoint`` binary."""
    from tslice.agent.backends import cuda_select

    try:
        chosen = cuda_select.select_driver(preference="auto")
    except Exception as err:  # BackendUnavailableError, or a driver that fails to load
        return Check("CUDA checkpoint", _missing(needed), str(err))
    return Check("CUDA checkpoint", Level.OK, f"available (through {chosen.name})")


def nvml(needed: bool) -> tuple[Check, int]:
    """NVML, and the device memory it lists in all (bytes)."""
    from tslice.agent import nvml as nvml_module

    try:
        opened = nvml_module.open_nvml()
    except nvml_module.NvmlUnavailableError as err:
        return Check("NVML", _missing(needed), str(err)), 0
    try:
        count = opened.device_count()
        total = sum(opened.memory(i)[1] for i in range(count))
    finally:
        opened.close()
    return Check("NVML", Level.OK, f"{count} GPU(s), {total / 1024**3:.0f} GiB in all"), total


def register_socket(path: Path) -> Check:
    """The socket where workloads announce themselves: there, a socket, reachable."""
    name = "register socket"
    try:
        st = path.stat()
    except OSError:
        return Check(
            name,
            Level.FAIL,
            f"{path} is missing: is the agent running with this config? (start it, or point "
            "register_socket / unix_socket where it listens)",
        )
    if not stat.S_ISSOCK(st.st_mode):
        return Check(name, Level.FAIL, f"{path} is not a socket: remove it, restart the agent")
    mode = stat.S_IMODE(st.st_mode)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    if mode & 0o002:
        return Check(name, Level.OK, f"{path}, mode {mode:o}: any local user may connect")
    if mode & 0o020:
        return Check(
            name,
            Level.WARN if group == "root" else Level.OK,
            f"{path}, mode {mode:o}, group {group}: job users must be in group {group} "
            "(run the agent with that group, e.g. Group= in its systemd unit)",
        )
    return Check(name, Level.FAIL, f"{path}, mode {mode:o}: only its owner may connect")


def host_memory(gpu_bytes: int, meminfo: Path = Path("/proc/meminfo")) -> Check:
    """Host memory where parked states go: some at all, and ideally the GPUs' worth."""
    try:
        text = meminfo.read_text()
    except OSError as err:
        return Check("host memory", Level.WARN, f"cannot read {meminfo}: {err.strerror}")
    fields: dict[str, str] = dict(re.findall(r"^(\w+):\s+(\d+) kB", text, re.MULTILINE))
    available = int(fields.get("MemAvailable", fields.get("MemFree", "0"))) * 1024
    total = int(fields.get("MemTotal", "0")) * 1024
    detail = f"{available / 1024**3:.1f} GiB available of {total / 1024**3:.1f} GiB"
    if available < MIN_HOST_MEMORY:
        return Check("host memory", Level.FAIL, f"{detail}: too little to park any state")
    if gpu_bytes and available < gpu_bytes:
        return Check(
            "host memory",
            Level.WARN,
            f"{detail}, less than the GPUs' {gpu_bytes / 1024**3:.0f} GiB: not every "
            "job's state can be parked at once (the agent refuses a snapshot that does not fit)",
        )
    return Check("host memory", Level.OK, detail)


def node_checks(
    *,
    backends: Sequence[str],
    register_path: Path,
    is_root: Callable[[], bool] = lambda: os.geteuid() == 0,
) -> list[Check]:
    """Every check of a node whose agent enables ``backends``."""
    needed = bool(GPU_BACKENDS & set(backends))
    checks = [driver(needed), checkpoint(needed)]
    nvml_check, gpu_bytes = nvml(needed)
    checks += [nvml_check, register_socket(register_path), host_memory(gpu_bytes)]
    if needed and not is_root():
        checks.append(
            Check(
                "privileges",
                Level.WARN,
                "not root: the cuda backend checkpoints other users' processes; run the agent "
                "as root (as deploy/systemd/tslice-agent.service does)",
            )
        )
    return checks
