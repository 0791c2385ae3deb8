"""A real one-host Slurm cluster for the tests: munged, slurmctld and one slurmd per node
(``slurmd -N``), each node with two character-device "GPUs" in its GRES, every file and
port its own (several may run at once on one machine), the Prolog, Epilog and TaskProlog
of ``deploy/slurm/`` installed as a site would (../shared/reference/slurm-single-node.md
has the settings and the traps).

Started and stopped as the tests start servers: the daemons are this process's children,
stopped by pid (running jobs are cancelled first: their slurmstepd outlive the daemons).
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
#: How long the daemons may take to come up, a job to reach a state, seconds.
WAIT_S = 60.0
#: Job states after which a job's processes are gone.
ENDED = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}
)


def missing() -> list[str]:
    """The Slurm and munge programs not installed here (`.ci/run` installs them)."""
    return [d for d in DAEMONS if _which(d) is None]


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """Nodes ``nodes`` (each 2 GPUs, 4 shards) in partition ``gpu`` (OverSubscribe=FORCE:4)."""

    def __init__(self, root: pathlib.Path, nodes: Sequence[str] = ("gpu-a", "gpu-b")) -> None:
        self.root = root
        self.nodes = tuple(nodes)
        self.conf = root / "slurm.conf"
        self.scripts = root / "tslice-slurm"
        self.run_dir = root / "jobs"
        self.key_file = root / "job.key"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen[bytes]] = []
        self._munge = root / "munge"

    # ---- set-up -------------------------------------------------------------------------

    def _write(self, *, job_env: dict[str, str]) -> None:
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "log", "dev", "out"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "out").chmod(0o1777)
        node_lines, gres_lines = [], ["Name=shard Count=4"]
        for node in self.nodes:
            for i in (0, 1):
                dev = self.root / "dev" / f"{node}-nvidia{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # like /dev/null
            node_lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                "CPUs=2 Gres=gpu:2,shard:4 Feature=sim State=UNKNOWN"
            )
            gres_lines.insert(
                0, f"NodeName={node} Name=gpu File={self.root}/dev/{node}-nvidia[0-1]"
            )
        r = self.root
        settings = f"""\
ClusterName=tslicetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self._munge}/socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/slurmd-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
MailProg=/bin/true
ReturnToService=2
KillWait=2
GresTypes=gpu,shard
"""
        # The lines a site adds, as shipped, with the scripts where this cluster has them.
        shipped = (DEPLOY / "slurm.conf.tslice").read_text()
        shipped = shipped.replace("/etc/tslice/slurm", str(self.scripts))
        partition = (
            f"PartitionName=gpu Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=FORCE:4"
        )
        self.conf.write_text("\n".join([settings, shipped, *node_lines, partition, ""]))
        (self.root / "gres.conf").write_text("\n".join([*gres_lines, ""]))
        self.scripts.mkdir(exist_ok=True)
        for script in ("prolog.sh", "epilog.sh", "task-prolog.sh"):
            shutil.copy2(DEPLOY / script, self.scripts / script)
        self.key_file.write_text(os.urandom(32).hex() + "\n")
        self.key_file.chmod(0o600)
        tslice = pathlib.Path(sys.executable).parent / "tslice"  # the venv's
        lines = [
            f"TSLICE={tslice}",
            f"TSLICE_SLURM_KEY_FILE={self.key_file}",
            f"TSLICE_SLURM_RUN_DIR={self.run_dir}",
            *(f"JOB_{k}={v}" for k, v in job_env.items()),
        ]
        (self.scripts / "tslice-slurm.env").write_text("\n".join([*lines, ""]))

    def start(self, *, job_env: dict[str, str] | None = None) -> None:
        """Write the configuration, start the daemons, wait until every node is idle."""
        self._write(job_env=job_env or {})
        self._munge.mkdir(exist_ok=True)
        shutil.chown(self._munge, "munge", "munge")
        self._munge.chmod(0o755)
        m = self._munge
        self._spawn(
            "munge-log",
            ["runuser", "-u", "munge", "--", _which("munged") or "munged", "-F",
             f"--socket={m}/socket", f"--pid-file={m}/pid", f"--seed-file={m}/seed",
             f"--log-file={m}/log"],
        )  # fmt: skip
        self._wait((m / "socket").exists, "munged to create its socket")
        self._spawn(
            "slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)]
        )
        for node in self.nodes:
            self._spawn(
                f"slurmd-{node}",
                [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf)],
            )
        self._wait(self._all_idle, "every node to be idle")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = (self.root / "log" / f"{name}.out").open("wb")
        self._daemons.append(
            subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        )
        out.close()

    def _all_idle(self) -> bool:
        states = self.node_states()
        return len(states) == len(self.nodes) and all(
            s.split("+")[0] in ("IDLE", "MIXED", "ALLOCATED") for s in states.values()
        )

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready():
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise AssertionError(
                        f"{daemon.args} exited ({daemon.returncode}):\n{self.logs()}"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {WAIT_S:g} s for {what}:\n{self.logs()}")
            time.sleep(0.1)  # the daemons have no event to wait on: their state is polled

    def stop(self) -> None:
        """Cancel every job, wait until none is left, stop the daemons."""
        if any(d.poll() is None for d in self._daemons):
            self.command("scancel", "--full", "--user", "root", check=False)
            deadline = time.monotonic() + 30
            while self.command("squeue", "--noheader", check=False).strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()

    # ---- using it -----------------------------------------------------------------------

    def command(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(
            [_which(argv[0]) or argv[0], *argv[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
        return done.stdout

    def sbatch(
        self, command: Sequence[str], *options: str, env: dict[str, str] | None = None
    ) -> str:
        """Submit ``command`` (run with the job's environment); its job id."""
        export = ",".join(["ALL", *(f"{k}={v}" for k, v in (env or {}).items())])
        wrapped = shlex.join(command)
        out = self.command(
            "sbatch", "--parsable", f"--export={export}", "-o", f"{self.root}/out/%j.out",
            *options, "--wrap", wrapped,
        )  # fmt: skip
        return out.strip().split(";")[0]

    def job_states(self, jobs: Iterable[str] = ()) -> dict[str, str]:
        """Job id -> state, ended jobs included (the array tasks under their own ids)."""
        wanted = list(jobs)
        argv = ["squeue", "--noheader", "--states=all", "--format=%A|%T"]
        if wanted:
            argv.append(f"--jobs={','.join(wanted)}")
        out = self.command(*argv, check=False)
        return dict(line.split("|", 1) for line in out.split() if "|" in line)

    def wait_state(self, job: str, states: Iterable[str]) -> str:
        """The job's state once it is one of ``states``."""
        wanted = frozenset(states)
        found: dict[str, str] = {}

        def reached() -> bool:
            found.update(self.job_states([job]))
            return found.get(job) in wanted

        self._wait(reached, f"job {job} to be {'/'.join(sorted(wanted))}")
        return found[job]

    def node_states(self) -> dict[str, str]:
        out = self.command("scontrol", "show", "node", "--oneliner", check=False)
        states = {}
        for line in out.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if "NodeName" in fields:
                states[fields["NodeName"]] = fields.get("State", "")
        return states

    def output(self, job: str) -> str:
        path = self.root / "out" / f"{job}.out"
        return path.read_text() if path.exists() else ""

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")[-4000:]
            parts.append(f"----- {path.name} -----\n{text}")
        return "\n".join(parts)
