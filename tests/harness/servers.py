"""The one way tests start a real server: ``python -m tslice orchestrator|agent ...`` as a
process, ready once it has written its ready file.

Readiness protocol: the harness passes ``--ready-file``; the server writes
``{"address", "pid"}`` there atomically (tmp + rename) once it accepts calls, in every mode
(local, Kubernetes, Slurm, HA follower). :meth:`Server.wait_ready` polls that file and
the process's exit, so a server that dies at start fails the test at once with its log;
no log line is scraped for readiness, and no sleep stands for it.

The server's output (stdout and stderr) goes to ``log_path`` and is kept for
:meth:`Server.wait_for`, which waits for a later event the server reports in its log
(a leader elected, a watch failed), and for the failure messages.

Standard library only: the job-side suites run this module in venvs without tslice's
server dependencies (``python=`` names the interpreter that has them).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

#: How long a server may take to start (imports, SQLite, a first API-server list).
START_TIMEOUT_S = 60.0
#: A server given SIGTERM with nothing left to finish stops well within this.
STOP_TIMEOUT_S = 15.0
#: How long a server may take to report a log line a test waits for.
WAIT_S = 60.0
#: Between two looks at the ready file (it appears in one rename).
_READY_POLL_S = 0.02


class Server:
    """One ``python -m tslice KIND ARGS`` process, restartable with :meth:`start`.

    ``prefix`` runs it under another command (``ip netns exec NAME``); ``env`` adds to
    the environment; ``python`` is the interpreter (default: this one). ``start=False``
    builds it without starting it.
    """

    def __init__(
        self,
        kind: str,
        args: Sequence[str],
        log_path: pathlib.Path,
        *,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        python: str = "",
        start: bool = True,
    ) -> None:
        self.kind = kind
        self.args = list(args)
        self.log_path = log_path
        self.ready_file = log_path.with_name(f"{log_path.stem}.ready.json")
        self.env = dict(env or {})
        self.prefix = list(prefix)
        self.python = python or sys.executable
        #: ``HOST:PORT`` from the ready file (empty until ready).
        self.address = ""
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = True
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        if start:
            self.start()

    @property
    def proc(self) -> subprocess.Popen[str]:
        assert self._proc is not None, f"{self.kind} was never started"
        return self._proc

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *extra: str) -> None:
        """Start it (again: after it exited or was killed), with ``extra`` flags after its
        own for this start only (the last of a repeated flag wins)."""
        assert not self.running, f"{self.kind} is already running"
        self._join_reader()
        self.ready_file.unlink(missing_ok=True)
        self.address = ""
        command = [
            *self.prefix, self.python, "-m", "tslice", self.kind, *self.args, *extra,
            "--ready-file", str(self.ready_file),
        ]  # fmt: skip
        header = f"--- {' '.join(command)}\n"
        with self.log_path.open("a", encoding="utf-8") as log:
            log.write(header)
        with self._changed:
            self._lines.append(header)
            self._ended = False
        self._proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
        )
        self._reader = threading.Thread(
            target=self._read, args=(self._proc,), name=f"{self.kind}-log", daemon=True
        )
        self._reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with self.log_path.open("a", encoding="utf-8") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                with self._changed:
                    self._lines.append(line)
                    self._changed.notify_all()
        proc.stdout.close()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Its address once its ready file exists; raises with its log if it exits first
        or is not ready within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                self._join_reader()
                raise AssertionError(
                    f"{self.kind} exited with {self.proc.returncode} before it was ready:\n"
                    f"{self.logs()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.kind} was not ready within {timeout_s:g} s:\n{self.logs()}"
                )
            time.sleep(_READY_POLL_S)  # polls a file the server renames into place at once
        self.address = str(json.loads(self.ready_file.read_text())["address"])
        return self.address

    def wait_for(self, pattern: str, *, since: int = 0) -> re.Match[str]:
        """The first log line matching ``pattern`` (from line ``since`` on: see
        :meth:`mark`); raises with the log if the server exits, or has not written it
        within ``WAIT_S``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + WAIT_S
        with self._changed:
            index = since
            while True:
                for line in self._lines[index:]:
                    match = regex.search(line)
                    if match:
                        return match
                index = len(self._lines)
                left = deadline - time.monotonic()
                if self._ended or left <= 0 or not self._changed.wait(left):
                    raise AssertionError(f"no log line matched {pattern!r}:\n{self.logs()}")

    def mark(self) -> int:
        """How many lines it has written: ``wait_for(since=...)`` looks at the later ones."""
        with self._changed:
            return len(self._lines)

    def logs(self, last: int | None = None) -> str:
        """Its output so far, every start (its ``last`` lines only, if given)."""
        with self._changed:
            return "".join(self._lines[-(last or 0) :])

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def freeze(self) -> None:
        """SIGSTOP: it answers nothing until :meth:`thaw`, however long the test takes."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def terminate(self) -> int:
        """SIGTERM and wait: its exit code (the test fails if it does not stop in time)."""
        self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.kind} ignored SIGTERM for {STOP_TIMEOUT_S:g} s:\n{self.logs()}"
            ) from None
        self._join_reader()
        return code

    def kill(self) -> None:
        """SIGKILL (a crash), and wait until it is gone."""
        if self.running:
            self.proc.kill()
            self.proc.wait()
        self._join_reader()

    def stop(self) -> None:
        """Stop it if it runs: SIGTERM, SIGKILL if it takes longer than ``STOP_TIMEOUT_S``."""
        if self.running:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._join_reader()

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def frozen(servers: Iterable[Server]) -> Iterator[None]:
    """``servers`` stopped (SIGSTOP) inside the block: agents frozen from before a switch
    starts answer none of its calls, so the switch is still in flight when the block acts
    (kills a leader, cordons a node), however long that takes."""
    stopped = list(servers)
    for server in stopped:
        server.freeze()
    try:
        yield
    finally:
        for server in stopped:
            server.thaw()
