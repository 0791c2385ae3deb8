"""Stand-ins for NVIDIA's checkpoint tools, shared by the cuda backend's tests: a
``cuda-checkpoint`` look-alike (a real executable whose per-PID states live in a JSON
file) and the shape of ``cuda.bindings.driver`` that BindingsDriver uses."""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tslice.agent import nvml
from tslice.agent.backends import base, cuda, cuda_driver, cuda_fake, cuda_settings
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

GiB = 2**30
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-00000000-0000-0000-0000-000000000001"
S = cuda_driver.ProcessState

FAKE_TOOL = textwrap.dedent("""\
    import fcntl, json, os, sys, time
    path = os.environ["FAKE_CC_STATE"]
    # The backend runs one tool per process at once: one at a time on the state file.
    lock = open(path + ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    with open(path) as f:
        data = json.load(f)
    args = sys.argv[1:]
    data.setdefault("calls", []).append(args)

    def finish(code, text=""):
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)
        if text:
            print(text)
        sys.exit(code)

    if args == ["--help"]:
        finish(0, data.get("help", "--action lock | checkpoint | restore | unlock --pid <pid>"))
    pid = args[args.index("--pid") + 1]
    state = data["states"].get(pid)
    if state is None:
        finish(1, f"Could not find CUDA process {pid}")
    if args[0] == "--get-state":
        finish(0, state)
    action = args[args.index("--action") + 1]
    fault = data.get("faults", {}).pop(action, None)
    if fault == "hang":
        data["hung_pid"] = os.getpid()
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)
        fcntl.flock(lock, fcntl.LOCK_UN)
        time.sleep(120)
    if fault == "timeout":
        finish(1, "Error: lock operation timed out")
    if fault == "not-ready":
        finish(1, "Error locking process: CUDA_ERROR_NOT_READY (device not ready)")
    if fault:
        finish(2, fault)
    want, new = {"lock": ("running", "locked"), "checkpoint": ("locked", "checkpointed"),
                 "restore": ("checkpointed", "locked"), "unlock": ("locked", "running")}[action]
    if state != want:
        finish(1, f"process {pid} is {state}, cannot {action}")
    data["states"][pid] = new
    finish(0)
""")


class FakeTool:
    """A cuda-checkpoint look-alike whose per-PID states live in a JSON file."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "cuda-checkpoint"
        self.path.write_text(f"#!{sys.executable}\n{FAKE_TOOL}")
        self.path.chmod(0o755)
        self.state_file = directory / "state.json"
        self.write({"states": {}})

    def read(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.state_file.read_text())
        return data

    def write(self, data: dict[str, Any]) -> None:
        self.state_file.write_text(json.dumps(data))

    def set(self, *, states: dict[int, str] | None = None, **extra: Any) -> None:
        data = self.read()
        if states is not None:
            data["states"] = {str(k): v for k, v in states.items()}
        data.update(extra)
        self.write(data)

    def states(self) -> dict[int, str]:
        return {int(k): v for k, v in self.read()["states"].items()}


class CuResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_TIMEOUT = 909


class CuProcessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


class FakeCudaModule:
    """The shape of ``cuda.bindings.driver`` that BindingsDriver uses."""

    CUresult = CuResult
    CUprocessState = CuProcessState

    class CUcheckpointLockArgs:
        timeoutMs = 0

    class CUcheckpointRestoreArgs:
        gpuPairs: list[Any] | None = None
        gpuPairsCount = 0

    class CUcheckpointGpuPair:
        oldUuid: Any = None
        newUuid: Any = None

    class CUuuid:
        def __init__(self, address: int) -> None:
            self.raw = ctypes.string_at(address, 16)

    def __init__(self, *, init: CuResult = CuResult.CUDA_SUCCESS, version: int = 12080) -> None:
        self.init = init
        self.version = version
        self.state = CuProcessState.CU_PROCESS_STATE_RUNNING
        self.errors: dict[str, CuResult] = {}
        self.seen: dict[str, Any] = {}

    def cuInit(self, flags: int) -> tuple[CuResult]:
        return (self.init,)

    def cuDriverGetVersion(self) -> tuple[CuResult, int]:
        return CuResult.CUDA_SUCCESS, self.version

    def cuDeviceGetCount(self) -> tuple[CuResult, int]:
        return CuResult.CUDA_SUCCESS, 8

    def cuGetErrorString(self, err: CuResult) -> tuple[CuResult, bytes]:
        return CuResult.CUDA_SUCCESS, f"description of {err.name}".encode()

    def _result(self, op: str) -> CuResult:
        return self.errors.pop(op, CuResult.CUDA_SUCCESS)

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[CuResult, CuProcessState]:
        return self._result("get_state"), self.state

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[CuResult]:
        self.seen["lock_timeout"] = args.timeoutMs
        return (self._result("lock"),)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[CuResult]:
        return (self._result("checkpoint"),)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[CuResult]:
        if args is not None:
            self.seen["pairs"] = [(p.oldUuid.raw, p.newUuid.raw) for p in args.gpuPairs]
            self.seen["count"] = args.gpuPairsCount
        return (self._result("restore"),)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[CuResult]:
        return (self._result("unlock"),)


# --------------------------------------------------------------------------- a node


def exited_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@dataclasses.dataclass
class Node:
    """One simulated GPU node: the driver and NVML outlive any backend (agent) instance."""

    pids: list[int]
    nvml: nvml.FakeNvml = dataclasses.field(
        default_factory=lambda: nvml.FakeNvml(
            [nvml.FakeGpu(GPU0, 80 * GiB), nvml.FakeGpu(GPU1, 80 * GiB)]
        )
    )
    driver: cuda_fake.FakeDriver = dataclasses.field(init=False)
    registry: registration.ProcessRegistry = dataclasses.field(
        default_factory=registration.ProcessRegistry
    )

    def __post_init__(self) -> None:
        self.driver = cuda_fake.FakeDriver(nvml=self.nvml)
        for i, pid in enumerate(self.pids):
            self.driver.add_process(pid)
            self.nvml.gpus[0].compute[pid] = (i + 1) * GiB

    def backend(self, **settings: Any) -> cuda.CudaBackend:
        return cuda.CudaBackend(
            settings=cuda_settings.CudaSettings(**settings),
            driver=self.driver,
            nvml=self.nvml,
            registry=self.registry,
        )

    def states(self) -> list[S]:
        return [self.driver.states[p] for p in self.pids]

    def ops(self, *, skip: tuple[str, ...] = ("get_state",)) -> list[tuple[str, int]]:
        return [c for c in self.driver.calls if c[0] not in skip]


def job(
    pids: list[int] | None = None, *, state: dict[str, Any] | None = None, job_id: str = "rl-a"
) -> base.JobContext:
    config = None
    if pids is not None:
        config = pb.BackendConfig(
            cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=pids))
        )
    # The agent persists OpResult.state as JSON: round-trip it the same way.
    persisted = json.loads(json.dumps(state or {}))
    return base.JobContext(job_id=job_id, group="pool", config=config, state=persisted)
