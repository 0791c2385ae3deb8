"""One job of a chaos run, as its own process: ``python -m tslice.chaos.job_process``.

It loops ``--steps`` times: acquire one or two random groups (two in sorted order, as a
weight sync holds a sampler and a trainer pool), work a random while, yield them in
reverse order. Every acquire and yield is written to ``--records`` (JSON lines, one
flush each) *before* the yield RPC and *after* the acquire returned, so that a SIGKILL
at any moment leaves a record the chaos runner can read: what the job held and for how
long. The job holds with a lease (``--lease``), so its lock goes when it is killed.

Exit status: 0 once every step is done, 1 when an acquire or a yield failed (the
record says why).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

import tslice.client as tsclient
from tslice.common import errors

#: Record kinds, in the order a step writes them.
REQUEST, ACQUIRED, YIELD, STEP, DONE, ERROR = (
    "request",
    "acquired",
    "yield",
    "step",
    "done",
    "error",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tslice.chaos.job_process", description=__doc__)
    p.add_argument("--address", required=True, help="orchestrator host:port")
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--groups", required=True, help="comma-separated group ids to pick from")
    p.add_argument("--steps", type=int, required=True, help="acquire/work/yield cycles")
    p.add_argument("--seed", type=int, required=True, help="seed of this job's choices")
    p.add_argument("--records", required=True, help="JSON-lines file the job appends to")
    p.add_argument("--lease", type=float, default=1.0, help="holder lease, seconds")
    p.add_argument("--multi", type=float, default=0.3, help="share of steps that hold two groups")
    p.add_argument("--work-max", type=float, default=0.05, help="longest hold, seconds")
    p.add_argument("--acquire-timeout", type=float, default=120.0, help="per acquire, seconds")
    return p


class _Records:
    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, kind: str, **fields: Any) -> None:
        self._stream.write(json.dumps({"e": kind, "t": time.time(), **fields}) + "\n")
        self._stream.flush()


def run(args: argparse.Namespace, records: _Records) -> int:
    rng = random.Random(args.seed)
    groups = sorted(g for g in args.groups.split(",") if g)
    # No bound on the first contact: the orchestrator may be down (killed) right then.
    client = tsclient.Client(
        args.address, job_id=args.job, lease_s=args.lease, connect_timeout=None
    )
    with client:
        for step in range(args.steps):
            count = 2 if len(groups) > 1 and rng.random() < args.multi else 1
            chosen = sorted(rng.sample(groups, count))
            held: list[str] = []
            for group in chosen:
                records.write(REQUEST, group=group)
                try:
                    client.acquire(group, timeout=args.acquire_timeout)
                except errors.TsliceError as err:
                    records.write(ERROR, group=group, msg=f"acquire: {err}")
                    return 1
                records.write(ACQUIRED, group=group)
                held.append(group)
            time.sleep(rng.uniform(0, args.work_max))
            for group in reversed(held):
                # Before the RPC: the state may move as soon as the orchestrator reads it.
                lost = client.lost_leases.get(group, "")
                records.write(YIELD, group=group, lost=lost)
                try:
                    client.yield_(group)
                except errors.TsliceError as err:
                    records.write(ERROR, group=group, msg=f"yield: {err}")
                    return 1
            records.write(STEP, n=step + 1)
            time.sleep(rng.uniform(0, args.work_max))
    records.write(DONE)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with open(args.records, "a", encoding="utf-8") as stream:
        return run(args, _Records(stream))


if __name__ == "__main__":
    sys.exit(main())
