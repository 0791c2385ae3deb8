"""What the tests' Slurm jobs run: ``python tests/slurm/job.py MODE GROUP OUT [ROUNDS HOLD_S]``.

Configured as a user's job would be: ``tslice.Client()`` with nothing given (the
orchestrator's address and the credential from the TaskProlog, the job id from
``$SLURM_JOB_ID`` or ``$TSLICE_JOB_ID``). Modes:

- ``turns``: ROUNDS times acquire GROUP, hold it HOLD_S, yield; every window is appended
  to OUT as a JSON line (job, group, requested, acquired, yielded);
- ``hold``: acquire GROUP and keep it until killed (OUT gets the acquired window);
- ``impersonate``: acquire and yield GROUP as another job, ``$OTHER_JOB``; each outcome
  goes to OUT.

``$BARRIER=DIR:N`` makes the job wait until N jobs have started before its first call.
"""

from __future__ import annotations

import json
import os
import sys
import time

import tslice
from tslice.common import errors


def _append(out: str, record: dict[str, object]) -> None:
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def turns(client: tslice.Client, group: str, out: str, rounds: int, hold_s: float) -> None:
    for _ in range(rounds):
        requested = time.time()
        client.acquire(group, timeout=120)
        acquired = time.time()
        time.sleep(hold_s)
        yielded = time.time()
        client.yield_(group)
        _append(
            out,
            {
                "job": client.config.job_id,
                "group": group,
                "requested": requested,
                "acquired": acquired,
                "yielded": yielded,
            },
        )


def hold(client: tslice.Client, group: str, out: str) -> None:
    requested = time.time()
    client.acquire(group, timeout=120)
    _append(out, {"job": client.config.job_id, "group": group, "requested": requested,
                  "acquired": time.time()})  # fmt: skip
    while True:
        time.sleep(60)


def impersonate(client: tslice.Client, group: str, out: str) -> None:
    other = os.environ["OTHER_JOB"]
    for name, call in (
        ("acquire", lambda: client.acquire(group, job_id=other, timeout=10)),
        ("yield", lambda: client.yield_(group, job_id=other)),
    ):
        try:
            call()
            outcome = "allowed"
        except errors.TsliceError as err:
            outcome = f"{type(err).__name__}: {err}"
        _append(out, {"call": name, "as": other, "outcome": outcome})


def barrier() -> None:
    """With ``$BARRIER=DIR:N``: wait until N jobs have reached it (each writes a file)."""
    spec = os.environ.get("BARRIER")
    if not spec:
        return
    directory, count = spec.rsplit(":", 1)
    open(os.path.join(directory, f"ready-{os.environ['SLURM_JOB_ID']}"), "w").close()
    while sum(n.startswith("ready-") for n in os.listdir(directory)) < int(count):
        time.sleep(0.05)


def main(argv: list[str]) -> None:
    mode, group, out = argv[:3]
    client = tslice.Client()
    barrier()
    try:
        if mode == "turns":
            turns(client, group, out, int(argv[3]), float(argv[4]))
        elif mode == "hold":
            hold(client, group, out)
        elif mode == "impersonate":
            impersonate(client, group, out)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        client.close()


if __name__ == "__main__":
    main(sys.argv[1:])
