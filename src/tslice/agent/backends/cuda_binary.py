"""The checkpoint driver through NVIDIA's ``cuda-checkpoint`` tool.

One call per process and step, as an asyncio subprocess whose output ends up in the
error text; cancelling a call kills the tool.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

from tslice.agent.backends import base, cuda_driver

#: Where the reference image ships the tool when it is not on PATH.
FALLBACK_BINARY = "/usr/local/bin/cuda-checkpoint"
#: Words of a failed lock's output that say its timeout ran out.
_LOCK_TIMEOUT_WORDS = ("not ready", "not_ready", "timeout", "timed out")
#: Words of a failed call's output that say the driver refuses this process.
_NOT_SUPPORTED_WORDS = ("not supported", "not_supported")
#: Words of a failed --get-state's output that say the process has no CUDA context.
_NO_CONTEXT_WORDS = (
    "not initialized",
    "not_initialized",
    "invalid value",
    "invalid_value",
    "invalid argument",
    "could not find cuda process",
)


def find_binary(explicit: str | None = None) -> str | None:
    """Path of ``cuda-checkpoint``: the explicit path, PATH, then the fallback location."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("cuda-checkpoint")
    if found:
        return found
    return FALLBACK_BINARY if os.access(FALLBACK_BINARY, os.X_OK) else None


class BinaryDriver(cuda_driver.CheckpointDriver):
    """NVIDIA's ``cuda-checkpoint`` tool, one process per call, one ``--pid`` per call.

    The reference agent passed every PID to a single invocation, which the tool
    does not document; here each PID gets its own call so each step is checked.
    """

    name = "binary"

    def __init__(self, *, path: str | None = None) -> None:
        found = find_binary(path)
        if found is None:
            where = path or f"PATH or {FALLBACK_BINARY}"
            raise base.BackendUnavailableError(
                f"cuda-checkpoint was not found ({where}); {cuda_driver.INSTALL_HINT}"
            )
        self.path = found

    async def _run(self, op: str, pid: int, *args: str, lock_timeout_ms: int = 0) -> str:
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.path,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise base.BackendUnavailableError(f"cannot run {self.path}: {exc}") from exc
        try:
            out_bytes, _ = await proc.communicate()
        except asyncio.CancelledError:
            # The caller's deadline passed: do not leave the tool running on its own.
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        output = out_bytes.decode(errors="replace").strip()
        if proc.returncode != 0:
            shown = output[-cuda_driver._MAX_OUTPUT_CHARS :] or "(no output)"
            message = (
                f"{op} of pid {pid} failed: cuda-checkpoint {' '.join(args)} "
                f"exited with {proc.returncode}: {shown}"
            )
            lowered = output.lower()
            # The tool's wording is not specified: a failed lock that names the
            # driver's timeout code (CUDA_ERROR_NOT_READY, "device not ready"), mentions
            # a timeout, or took the whole timeout, is a timeout.
            timed_out = op == "lock" and (
                any(word in lowered for word in _LOCK_TIMEOUT_WORDS)
                or (time.monotonic() - started) * 1000 >= lock_timeout_ms > 0
            )
            error_cls: type[cuda_driver.DriverError] = cuda_driver.DriverError
            if timed_out:
                error_cls = cuda_driver.LockTimeoutError
            elif any(word in lowered for word in _NOT_SUPPORTED_WORDS):
                error_cls = cuda_driver.ProcessNotSupportedError
                message += f"; {cuda_driver.NOT_SUPPORTED_WHY}"
            elif op == "get_state" and any(word in lowered for word in _NO_CONTEXT_WORDS):
                error_cls = cuda_driver.NoCudaContextError
            raise error_cls(message, pid=pid, op=op, code=f"exit {proc.returncode}")
        return output

    async def get_state(self, pid: int) -> cuda_driver.ProcessState:
        output = await self._run("get_state", pid, "--get-state", "--pid", str(pid))
        words = output.lower().split()
        for state in cuda_driver.ProcessState:
            if state.value in words:
                return state
        raise cuda_driver.DriverError(
            f"cuda-checkpoint --get-state --pid {pid} printed {output!r}, "
            "which is not a known state",
            pid=pid,
            op="get_state",
            code="UNKNOWN_STATE",
        )

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        await self._run(
            "lock",
            pid,
            "--action",
            "lock",
            "--pid",
            str(pid),
            "--timeout",
            str(timeout_ms),
            lock_timeout_ms=timeout_ms,
        )

    async def checkpoint(self, pid: int) -> None:
        await self._run("checkpoint", pid, "--action", "checkpoint", "--pid", str(pid))

    async def restore(self, pid: int, *, gpu_pairs: cuda_driver.GpuPairs | None = None) -> None:
        args = ["--action", "restore", "--pid", str(pid)]
        if gpu_pairs:
            # r580+: every GPU visible to the process must be listed.
            mapping = ",".join(
                f"{cuda_driver.normalize_gpu_uuid(o)}={cuda_driver.normalize_gpu_uuid(n)}"
                for o, n in gpu_pairs.items()
            )
            args += ["--device-map", mapping]
        await self._run("restore", pid, *args)

    async def unlock(self, pid: int) -> None:
        await self._run("unlock", pid, "--action", "unlock", "--pid", str(pid))

    async def check_tool(self) -> None:
        """Raise BackendUnavailableError if the tool predates ``--action`` (driver < 570)."""
        out = await self._help()
        if b"--action" not in out:
            raise base.BackendUnavailableError(
                f"{self.path} has no --action (lock/checkpoint/restore/unlock): it is older "
                "than r570; install the cuda-checkpoint that matches driver >= 570"
            )

    async def check_device_map(self) -> None:
        """The tool restores onto other GPUs only from r580 (``--device-map``)."""
        out = await self._help()
        if b"--device-map" not in out:
            raise base.BackendUnavailableError(
                f"device_map is configured, but {self.path} has no --device-map: restoring "
                "onto other GPUs needs the cuda-checkpoint of driver >= 580"
            )

    async def _help(self) -> bytes:
        try:
            proc = await asyncio.create_subprocess_exec(
                self.path,
                "--help",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=10)
        except (OSError, asyncio.TimeoutError) as exc:
            raise base.BackendUnavailableError(f"cannot run {self.path} --help: {exc}") from exc
        return out
