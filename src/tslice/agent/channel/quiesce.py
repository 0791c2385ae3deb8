"""Workload hooks around a cuda-backend move: quiesce before the first lock, resume after.

Why: a job whose ranks talk to each other (NCCL communicators, CUDA IPC) cannot be
frozen from the outside. Once one rank is locked, the collectives of the others never
complete (cuda-checkpoint #30, #45), and the driver does not checkpoint IPC memory.
NVIDIA's answer is that the application must quiesce first (NCCL 2.29.7+:
``ncclCommSuspend``/``ncclCommResume``; older: destroy and re-create the communicator).
So a process may announce itself with hooks
(:func:`tslice.workload.process.announce_process` with ``quiesce=``/``resume=``): its
registration connection then stays open, and the cuda backend asks every such process
of the job to quiesce (all at once) before it locks any, and to resume once all are
unlocked again (or the snapshot was rolled back).

Protocol on the kept registration connection (UTF-8 JSON lines), agent first::

    agent    → {"call": "quiesce" | "resume", "id": 7}
    workload → {"id": 7, "ok": true}  or  {"id": 7, "ok": false, "error": "..."}

One call at a time per process (the backend never drives a process from two operations
at once); an answer with another id (a late one) is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


class HookError(Exception):
    """A process's hook failed, did not answer in time, or its connection is gone."""


@dataclasses.dataclass
class _Connection:
    pid: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class ProcessHooks:
    """The hook connections of announced processes, by PID (used on the agent's loop)."""

    def __init__(self) -> None:
        self._by_pid: dict[int, _Connection] = {}
        self._ids = itertools.count(1)

    def attach(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Keep ``pid``'s registration connection for its hooks (replacing an older one)."""
        old = self._by_pid.pop(pid, None)
        if old is not None:
            old.writer.close()
        self._by_pid[pid] = _Connection(pid, reader, writer)

    def has(self, pid: int) -> bool:
        """Whether ``pid`` announced hooks and their connection is still open."""
        conn = self._by_pid.get(pid)
        if conn is None:
            return False
        if conn.writer.is_closing() or conn.reader.at_eof():
            del self._by_pid[pid]
            return False
        return True

    async def quiesce(self, pids: Sequence[int], *, timeout_s: float) -> None:
        """Ask every process of ``pids`` that has hooks to quiesce, all at once; HookError
        naming the processes that could not (the caller resumes the others)."""
        errors = await self._call_all("quiesce", pids, timeout_s)
        if errors:
            raise HookError("; ".join(errors))

    async def resume(self, pids: Sequence[int], *, timeout_s: float) -> None:
        """Let every process of ``pids`` that has hooks go on; failures are logged only
        (its device state is back whatever the hook says)."""
        for error in await self._call_all("resume", pids, timeout_s):
            log.error("a workload's resume hook failed: %s", error)

    async def _call_all(self, call: str, pids: Sequence[int], timeout_s: float) -> list[str]:
        hooked = [pid for pid in pids if self.has(pid)]
        results = await asyncio.gather(*(self._call(pid, call, timeout_s) for pid in hooked))
        return [error for error in results if error]

    async def _call(self, pid: int, call: str, timeout_s: float) -> str:
        """One hook call; '' on success, else what went wrong."""
        conn = self._by_pid[pid]
        request_id = next(self._ids)
        async with conn.lock:
            try:
                conn.writer.write(json.dumps({"call": call, "id": request_id}).encode() + b"\n")
                await conn.writer.drain()
                answer = await asyncio.wait_for(self._answer(conn, request_id), timeout_s)
            except asyncio.TimeoutError:
                return f"pid {pid}'s {call} hook did not answer within {timeout_s:g} s"
            except (OSError, ConnectionError, ValueError) as exc:
                self._drop(pid)
                return f"pid {pid}'s hook connection broke during {call} ({exc})"
        if answer.get("ok") is True:
            return ""
        return f"pid {pid}'s {call} hook failed: {answer.get('error') or 'no reason given'}"

    async def _answer(self, conn: _Connection, request_id: int) -> dict[str, object]:
        while True:
            line = await conn.reader.readline()
            if not line:
                raise ConnectionError("the process closed it")
            message = json.loads(line)
            if isinstance(message, dict) and message.get("id") == request_id:
                return message

    def _drop(self, pid: int) -> None:
        conn = self._by_pid.pop(pid, None)
        if conn is not None:
            conn.writer.close()

    async def close(self) -> None:
        for pid in list(self._by_pid):
            conn = self._by_pid.pop(pid)
            conn.writer.close()
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()
