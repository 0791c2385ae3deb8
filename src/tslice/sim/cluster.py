"""LocalCluster: an orchestrator and N simulated agents as real processes on 127.0.0.1.

The shipped test double for everything above the servers (tests, benchmarks,
``tslice up``, the demo). Each server runs as ``python -m tslice orchestrator|agent``
with ``--port 0`` and ``--ready-file``; the cluster learns the ports from the ready
files, then can SIGKILL any process and restart it on the SAME port with the SAME
state directory, so clients reconnect and persistent state is put to the test.

Topology: ``groups=None`` is local mode (the orchestrator creates a group on its first
Acquire, spanning every agent); otherwise ``groups`` maps each group to its nodes and
a topology YAML is written once the agents' addresses are known.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal as _signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import yaml

from tslice.agent.backends import simdevice as device
from tslice.common import errors

ORCHESTRATOR = "orchestrator"
_READY_POLL_S = 0.02
_LOG_TAIL_LINES = 15


class ClusterError(errors.TsliceError):
    """A process of the local cluster failed to start; ``log_tail`` holds its last log lines."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


@dataclasses.dataclass(frozen=True)
class SimAgent:
    """One simulated node: its name and sim-backend settings (None = the agent's default)."""

    name: str
    #: Backend of the node: "sim" (simulated devices) or "noop" (nothing moves; benchmarks).
    backend: str = "sim"
    devices: int | None = None
    capacity_bytes: int | None = None
    bandwidth_bytes_per_s: int | None = None
    #: Restore copy rate (None = the agent's default: the snapshot rate).
    restore_bandwidth_bytes_per_s: int | None = None
    latency_s: float | None = None
    footprint_bytes: int | None = None
    fail_probability: float | None = None
    hang_probability: float | None = None
    extra_latency_s: float | None = None
    #: Further ``tslice agent`` flags, passed as they are.
    extra_args: tuple[str, ...] = ()
    #: Further sim-backend settings (``backend_settings.sim`` of an agent config file the
    #: cluster writes): e.g. ``chunks``, ``overlap``, ``prefetch``, ``suspend_mode``.
    sim_settings: Mapping[str, object] | None = None

    def flags(self) -> list[str]:
        pairs = (
            ("--sim-devices", self.devices),
            ("--sim-capacity", self.capacity_bytes),
            ("--sim-bandwidth", self.bandwidth_bytes_per_s),
            ("--sim-restore-bandwidth", self.restore_bandwidth_bytes_per_s),
            ("--sim-latency", self.latency_s),
            ("--sim-footprint", self.footprint_bytes),
            ("--sim-fail-prob", self.fail_probability),
            ("--sim-hang-prob", self.hang_probability),
            ("--sim-extra-latency", self.extra_latency_s),
        )
        out = ["--backend", self.backend]
        for flag, value in pairs:
            if value is not None:
                out += [flag, str(value)]
        return [*out, *self.extra_args]


@dataclasses.dataclass
class _Process:
    name: str
    state_dir: Path
    ready_file: Path
    log_path: Path
    base_args: list[str]
    port: int = 0
    address: str = ""
    popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class LocalCluster:
    """Start with :meth:`start` (or ``with LocalCluster(...) as cluster:``), stop with :meth:`stop`.

    ``agents`` is a count (nodes ``node-1``..``node-N`` with default sim settings) or
    a list of :class:`SimAgent`. ``base_dir=None`` uses a temporary directory that
    :meth:`stop` deletes; a given directory is kept (state survives for inspection).
    """

    def __init__(
        self,
        *,
        agents: int | Sequence[SimAgent] = 2,
        groups: Mapping[str, Sequence[str]] | None = None,
        base_dir: Path | None = None,
        host: str = "127.0.0.1",
        orchestrator_port: int = 0,
        log_level: str = "warning",
        startup_timeout_s: float = 30.0,
        grace_s: float = 5.0,
        orchestrator_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        insecure: bool = False,
    ) -> None:
        specs = (
            [SimAgent(name=f"node-{i + 1}") for i in range(agents)]
            if isinstance(agents, int)
            else list(agents)
        )
        if not specs:
            raise ValueError("a local cluster needs at least one agent")
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or ORCHESTRATOR in names:
            raise ValueError(f"agent names must be unique and not {ORCHESTRATOR!r}: {names}")
        if groups is not None:
            for group, nodes in groups.items():
                unknown = sorted(set(nodes) - set(names))
                if not nodes or unknown:
                    raise ValueError(
                        f"group {group!r} must name at least one of the agents {names}"
                        + (f"; unknown: {unknown}" if unknown else "")
                    )
        self.agents = specs
        self.groups = {g: tuple(ns) for g, ns in groups.items()} if groups is not None else None
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="tslice-cluster-"))
        self.host = host
        #: Every process serves plaintext on a non-loopback ``host`` anyway (their --insecure).
        self.insecure = insecure
        self.orchestrator_port = orchestrator_port
        self.log_level = log_level
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.orchestrator_args = list(orchestrator_args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._procs: dict[str, _Process] = {}
        self._started = False
        self._stopped = False

    # ---- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> LocalCluster:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def start(self) -> LocalCluster:
        """Start the agents (in parallel), then the orchestrator; return once all serve."""
        if self._started:
            return self
        self._started = True
        self.base_dir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in self.agents:
                proc = self._new_process(spec.name, ["agent", "--node-name", spec.name])
                proc.base_args += spec.flags()
                if spec.sim_settings:
                    path = self.base_dir / f"{spec.name}.agent.yaml"
                    config = {"backend_settings": {"sim": dict(spec.sim_settings)}}
                    path.write_text(yaml.safe_dump(config))
                    proc.base_args += ["--config", str(path)]
                self._spawn(proc)
            for spec in self.agents:
                self._wait_ready(self._procs[spec.name])
            orch = self._new_process(ORCHESTRATOR, ["orchestrator", *self._topology_args()])
            orch.base_args += self.orchestrator_args
            orch.port = self.orchestrator_port
            self._spawn(orch)
            self._wait_ready(orch)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM everything (orchestrator first), SIGKILL what outlives the grace period."""
        if self._stopped:
            return
        self._stopped = True
        order = [p for n, p in self._procs.items() if n == ORCHESTRATOR]
        order += [p for n, p in self._procs.items() if n != ORCHESTRATOR]
        for proc in order:
            if proc.alive():
                assert proc.popen is not None
                proc.popen.send_signal(_signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in order:
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def kill(self, name: str, signal: int = _signal.SIGKILL) -> None:
        """Send ``signal`` to process ``name`` and wait for it to exit."""
        proc = self._proc(name)
        if proc.popen is None or not proc.alive():
            return
        proc.popen.send_signal(signal)
        proc.popen.wait(timeout=max(self.grace_s, 1.0) * 4)

    def restart(self, name: str) -> None:
        """(Re)start process ``name`` on its previous port and state directory."""
        proc = self._proc(name)
        if proc.alive():
            self.kill(name, _signal.SIGTERM)
        self._spawn(proc)
        self._wait_ready(proc)

    # ---- facts -------------------------------------------------------------------------

    @property
    def orchestrator_address(self) -> str:
        return self._proc(ORCHESTRATOR).address

    @property
    def agent_addresses(self) -> dict[str, str]:
        return {s.name: self._procs[s.name].address for s in self.agents if s.name in self._procs}

    @property
    def names(self) -> list[str]:
        return list(self._procs)

    def address(self, name: str) -> str:
        return self._proc(name).address

    def pid(self, name: str) -> int | None:
        return self._proc(name).pid

    def alive(self, name: str) -> bool:
        return self._proc(name).alive()

    def state_dir(self, name: str) -> Path:
        return self._proc(name).state_dir

    def log_path(self, name: str) -> Path:
        return self._proc(name).log_path

    def group_nodes(self) -> dict[str, tuple[str, ...]] | None:
        """Nodes of each group (explicit topology), or ``None`` in local mode."""
        return dict(self.groups) if self.groups is not None else None

    def journal_paths(self) -> list[Path]:
        return [self._procs[s.name].state_dir / device.JOURNAL_FILE for s in self.agents]

    def read_journals(self) -> list[device.Event]:
        """Every simulated-device journal event of every agent, in time order."""
        events = [e for path in self.journal_paths() for e in device.read_journal(path)]
        return sorted(events, key=lambda e: e.t)

    def exited(self) -> dict[str, int]:
        """Processes that have exited on their own, with their exit codes."""
        out: dict[str, int] = {}
        for name, proc in self._procs.items():
            if proc.popen is not None and proc.popen.poll() is not None:
                out[name] = proc.popen.returncode
        return out

    # ---- internals ---------------------------------------------------------------------

    def _proc(self, name: str) -> _Process:
        try:
            return self._procs[name]
        except KeyError:
            raise ValueError(f"no process {name!r} in this cluster ({list(self._procs)})") from None

    def _new_process(self, name: str, args: list[str]) -> _Process:
        state_dir = self.base_dir / name
        state_dir.mkdir(parents=True, exist_ok=True)
        proc = _Process(
            name=name,
            state_dir=state_dir,
            ready_file=self.base_dir / f"{name}.ready.json",
            log_path=self.base_dir / f"{name}.log",
            base_args=[sys.executable, "-m", "tslice", *args],
        )
        self._procs[name] = proc
        return proc

    def _topology_args(self) -> list[str]:
        addresses = {s.name: self._procs[s.name].address for s in self.agents}
        if self.groups is None:
            out: list[str] = []
            for name, address in addresses.items():
                out += ["--local-agent", f"{name}={address}"]
            return out
        topology = {
            "groups": {
                group: {"nodes": [{"name": n, "agent": addresses[n]} for n in nodes]}
                for group, nodes in self.groups.items()
            }
        }
        path = self.base_dir / "topology.yaml"
        path.write_text(yaml.safe_dump(topology, sort_keys=False))
        return ["--topology", str(path)]

    def _spawn(self, proc: _Process) -> None:
        with contextlib.suppress(FileNotFoundError):
            proc.ready_file.unlink()
        args = [
            *proc.base_args,
            "--host",
            self.host,
            "--port",
            str(proc.port),
            "--state-dir",
            str(proc.state_dir),
            "--metrics-port",
            "0",
            "--ready-file",
            str(proc.ready_file),
            "--log-level",
            self.log_level,
            *(["--insecure"] if self.insecure else []),
        ]
        with proc.log_path.open("ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
            log.flush()
            # A new session: Ctrl-C in a terminal reaches the parent only, which stops
            # the children in order instead of having them all die at once.
            proc.popen = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def _wait_ready(self, proc: _Process) -> None:
        # Polling a file is acceptable here only: bounded, and the servers' contract
        # is an atomically renamed ready file.
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if proc.ready_file.exists():
                ready = json.loads(proc.ready_file.read_text())
                proc.address = str(ready["address"])
                proc.port = int(proc.address.rsplit(":", 1)[1])
                return
            if proc.popen is not None and proc.popen.poll() is not None:
                tail = self._tail(proc)
                raise ClusterError(
                    f"{proc.name} exited with code {proc.popen.returncode} before it was ready "
                    f"({_last_line(tail)}; full log: {proc.log_path})",
                    log_tail=tail,
                )
            if time.monotonic() > deadline:
                tail = self._tail(proc)
                raise ClusterError(
                    f"{proc.name} was not ready within {self.startup_timeout_s:g} s "
                    f"({_last_line(tail)}; full log: {proc.log_path})",
                    log_tail=tail,
                )
            time.sleep(_READY_POLL_S)

    @staticmethod
    def _tail(proc: _Process) -> str:
        try:
            lines = proc.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-_LOG_TAIL_LINES:])


def _last_line(tail: str) -> str:
    lines = [line for line in tail.splitlines() if line.strip() and not line.startswith("---")]
    return lines[-1].strip() if lines else "no output"
