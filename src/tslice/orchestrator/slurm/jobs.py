"""Which Slurm jobs live, which ended, and which names they act as: pure, fed by ``squeue``.

Job ids: a tslice job id that is a Slurm job id (all digits: ``$SLURM_JOB_ID``, or an
array's ``$SLURM_ARRAY_JOB_ID``, live while any of its tasks runs) lives while Slurm runs
that job (RUNNING, SUSPENDED, CONFIGURING, RESIZING). Once the controller lists it in
any other state (COMPLETING, COMPLETED, CANCELLED, TIMEOUT, NODE_FAIL, FAILED, PREEMPTED,
requeued and PENDING again...), or no longer lists a job it listed running, the job is
*gone*: :meth:`JobBook.update` returns it once, and the discovery evicts it from every
group. A job that ended while no orchestrator watched is still listed (``MinJobAge``,
300 s by default) and goes at the first read.

Names: a job may act as a name (``$TSLICE_JOB_ID=grpo-7``) so that several Slurm jobs
are one tslice job. With Slurm identity on (``identity``) each call's credential names
its Slurm job and user, and :meth:`JobBook.claim` binds the name to that job: a name
belongs to one user while any job bound to it lives, and is gone once all of them
ended. Without identity the orchestrator cannot tell which Slurm job acts as a name;
such a name keeps its place until its holder lease lapses.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

#: States in which a job's processes run.
LIVE_STATES = frozenset({"RUNNING", "SUSPENDED", "CONFIGURING", "RESIZING"})


@dataclasses.dataclass(frozen=True)
class JobRow:
    """One line of ``squeue -h -t all -o '%A|%F|%T|%u'``."""

    job_id: str
    #: The array's job id (the job's own when it is no array task).
    array_id: str
    state: str
    user: str = ""

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


def parse_jobs(text: str) -> list[JobRow]:
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0].isdigit():
            array_id = parts[1] if parts[1].isdigit() else parts[0]
            user = parts[3] if len(parts) > 3 else ""
            rows.append(JobRow(parts[0], array_id, parts[2].split()[0], user))
    return rows


def is_slurm_id(job: str) -> bool:
    """Whether a tslice job id is a Slurm job id (in Slurm mode all-digit ids are)."""
    return job.isdigit()


@dataclasses.dataclass(frozen=True)
class Gone:
    job: str
    reason: str


@dataclasses.dataclass
class _Name:
    user: str
    jobs: set[str]


class JobBook:
    """The controller's jobs as last read, and the names bound to them (thread-safe:
    the verifier reads it on gRPC threads)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._live: set[str] = set()
        #: Ids known to have ended (reported gone), with their state.
        self._ended: dict[str, str] = {}
        self._names: dict[str, _Name] = {}
        #: Names gone, with why (a group that comes back may still list them).
        self._names_ended: dict[str, str] = {}
        self._read = False

    @property
    def read(self) -> bool:
        """Whether the controller was read at least once."""
        return self._read

    def update(self, rows: Iterable[JobRow]) -> list[Gone]:
        """A fresh listing; the jobs and names gone since the last one."""
        rows = list(rows)
        live: set[str] = set()
        listed: dict[str, str] = {}
        for row in rows:
            for job in {row.job_id, row.array_id}:
                if row.live:
                    live.add(job)
                # An array's state: a live task's, else the last listed.
                if row.live or listed.get(job) not in LIVE_STATES:
                    listed[job] = row.state
        with self._guard:
            ended = {j: s for j, s in listed.items() if j not in live}
            ended.update({j: "no longer listed" for j in self._live - live - set(listed)})
            gone = [
                Gone(j, f"Slurm job {j} ended ({s})")
                for j, s in sorted(ended.items(), key=lambda e: int(e[0]))
                if j not in self._ended
            ]
            # An ended job is remembered while listed (a requeued one lives again).
            kept = {j: s for j, s in self._ended.items() if j in listed and j not in live}
            self._ended = {**kept, **ended}
            self._live = live
            self._read = True
            gone.extend(self._names_gone())
        return gone

    def _names_gone(self) -> list[Gone]:
        gone = []
        for name, bound in sorted(self._names.items()):
            if bound.jobs and all(j in self._ended for j in bound.jobs):
                ended = ", ".join(f"{j} ({self._ended[j]})" for j in sorted(bound.jobs, key=int))
                why = f"every Slurm job that acted as {name} ended: {ended}"
                gone.append(Gone(name, why))
                self._names_ended[name] = why
                del self._names[name]
        return gone

    def gone_reason(self, job: str) -> str | None:
        """Why a job id is gone, if it is (an ended Slurm job, a name whose jobs all ended)."""
        with self._guard:
            if job in self._ended:
                return f"Slurm job {job} ended ({self._ended[job]})"
            return self._names_ended.get(job)

    def ended(self, job: str) -> str | None:
        """The state a Slurm job ended in, if it is known to have ended."""
        with self._guard:
            return self._ended.get(job)

    def claim(self, name: str, *, job: str, user: str) -> str | None:
        """Bind name ``name`` to Slurm job ``job`` of ``user``; why not (None: bound)."""
        with self._guard:
            bound = self._names.get(name)
            if bound is not None and bound.user != user:
                if any(j not in self._ended for j in bound.jobs):
                    return (
                        f"job name {name!r} is in use by user {bound.user!r} (Slurm jobs "
                        f"{', '.join(sorted(bound.jobs, key=int))}); choose another name"
                    )
                bound = None
            if bound is None:
                bound = self._names[name] = _Name(user, set())
                self._names_ended.pop(name, None)
            bound.jobs.add(job)
            return None

    def bound(self, name: str) -> tuple[str, frozenset[str]] | None:
        """``(user, Slurm jobs)`` bound to a name (for tests and the logs)."""
        with self._guard:
            found = self._names.get(name)
            return None if found is None else (found.user, frozenset(found.jobs))


_BOOK = JobBook()


def book() -> JobBook:
    """This process's book: the discovery writes it, the identity verifier reads it (an
    orchestrator process runs one Slurm mode)."""
    return _BOOK
