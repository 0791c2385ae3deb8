"""Soak: the long form of the chaos suite (issue 10 §4).

A real orchestrator and three simulated agents (groups g1 = node-1+node-2, g2 =
node-2+node-3, g3 = node-3), the agents' sim backends failing 5 % of copies and hanging
5 % (a hang ends at the agent's operation deadline), serve job processes that take one
or two random groups at a time with a holder lease. For ``--minutes`` the run SIGKILLs,
at random moments, the orchestrator, an agent (both restarted on their port and state)
or a job that holds a group; job slots start fresh jobs all along. Then the device
journals of every agent are checked against what the jobs saw (see
:mod:`tslice.sim.chaos`). It prints kills survived, switches, faults injected,
violations (must be 0) and jobs lost (must be 0), and exits 1 otherwise.

    python bench/soak.py [--minutes 3] [--json] [--seed S] [--slots 4] [--local] [--keep DIR]

``--local`` runs local mode instead: every group spans every node, so all three share
the devices (device claims, deferred residents giving way).

The seed is printed: ``--seed S`` draws the same kills, jobs and faults again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

from tslice.sim import chaos


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="how long jobs run and get killed")
    p.add_argument("--seed", type=int, default=None, help="seed (default: a random one)")
    p.add_argument("--slots", type=int, default=4, help="jobs running at once")
    p.add_argument("--steps", type=int, default=10, help="acquire/work/yield cycles per job")
    p.add_argument("--local", action="store_true", help="local mode: every group on every node")
    p.add_argument("--keep", type=Path, default=None, help="keep state, logs, records here")
    p.add_argument("--log-level", default="warning", help="of the servers (their logs: --keep)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    if not args.json:
        mode = "local mode" if args.local else "topology g1=node-1+2, g2=node-2+3, g3=node-3"
        print(
            f"soak: seed {seed}, {args.minutes:g} min, {args.slots} jobs at once, {mode}",
            flush=True,
        )
    config = chaos.ChaosConfig(
        seed=seed,
        duration_s=args.minutes * 60,
        slots=args.slots,
        steps=args.steps,
        kill_gap_s=(2.0, 6.0),
        local_mode=args.local,
        base_dir=args.keep,
        log_level=args.log_level,
    )
    result = asyncio.run(chaos.run_chaos(config))
    print(json.dumps(result.to_json(), indent=2) if args.json else result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
