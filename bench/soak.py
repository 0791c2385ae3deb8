"""Soak: the long form of the chaos suite (issue 10 §4).

A real orchestrator and three simulated agents, the agents' sim backends failing 5 % of
copies and hanging 5 % (a hang ends at the agent's 0.5 s operation deadline), serve job
processes that take one or two random groups at a time with a 3 s holder lease. For
``--minutes`` the run SIGKILLs, at random moments (every 2-6 s), the orchestrator, an
agent, both at once (restarted on their ports and state) or a job that holds a group;
job slots start fresh jobs all along, and half of the killed jobs come back under their
own id. Then the device journals of every agent are checked against what the jobs saw
(see :mod:`tslice.chaos.runner`). It prints kills survived, switches, faults injected,
violations (must be 0) and jobs lost (must be 0), and exits 1 otherwise.

    python bench/soak.py [--minutes 3] [--json] [--seed S] [--slots 4] [--mode both]
                         [--keep DIR] [--log-level info]

``--promises``: instead, the long form of the grant-promise run (issue 21 §1; see
:mod:`tslice.chaos.promises`): leaseless jobs of two processes each take single groups and
sets, with deadlines and cancels, while an administrator evicts and drains and the
orchestrator is SIGKILLed every 4-8 s; it prints the grants answered, how each ended, the
calls and their outcomes, and violations (must be 0), and exits 1 otherwise.

    python bench/soak.py --promises [--minutes 3] [--seed S] [--json]

``--mode topology``: groups g1 = node-1+node-2, g2 = node-2+node-3, g3 = node-3 (g1 and
g2 share node-2, g2 and g3 node-3); ``--mode local``: local mode, every group spans every
node, so all three share the devices (device claims, deferred residents giving way);
``--mode both`` (the default) runs the first half of the minutes in each. The seed is
printed: ``--seed S`` draws the same kills, jobs and faults again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

from tslice.chaos import promises, runner

MODES = {"topology": (False,), "local": (True,), "both": (False, True)}
MODES_NAME = {False: "topology", True: "local"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="how long jobs run and get killed")
    p.add_argument("--seed", type=int, default=None, help="seed (default: a random one)")
    p.add_argument("--slots", type=int, default=4, help="jobs running at once")
    p.add_argument("--steps", type=int, default=10, help="acquire/work/yield cycles per job")
    p.add_argument("--mode", choices=sorted(MODES), default="both", help="which topology")
    p.add_argument("--keep", type=Path, default=None, help="keep state, logs, records here")
    p.add_argument("--log-level", default="warning", help="of the servers (their logs: --keep)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument(
        "--promises", action="store_true", help="run the grant-promise run instead (issue 21)"
    )
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    if args.promises:
        return _promises(args, seed)
    modes = MODES[args.mode]
    results: list[runner.ChaosResult] = []
    for local in modes:
        name = "local" if local else "topology"
        if not args.json:
            print(
                f"soak ({name}): seed {seed}, {args.minutes / len(modes):g} min, "
                f"{args.slots} jobs at once",
                flush=True,
            )
        config = runner.ChaosConfig(
            seed=seed,
            duration_s=args.minutes * 60 / len(modes),
            slots=args.slots,
            steps=args.steps,
            kill_gap_s=(2.0, 6.0),
            local_mode=local,
            base_dir=args.keep / name if args.keep is not None else None,
            log_level=args.log_level,
        )
        result = asyncio.run(runner.run_chaos(config))
        results.append(result)
        if not args.json:
            print(result.summary(), flush=True)
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps(_totals(results, [MODES_NAME[m] for m in modes]), indent=2))
    elif len(results) > 1:
        total = _totals(results, [])
        print(
            f"total: {'ok' if ok else 'FAILED'}; kills survived {total['kills_survived']}, "
            f"switches {total['switches']}, faults injected {total['faults_injected']}, "
            f"violations {total['violations']}, jobs lost {total['jobs_lost']}"
        )
    return 0 if ok else 1


def _promises(args: argparse.Namespace, seed: int) -> int:
    logging.getLogger("tslice.client").setLevel(logging.ERROR)  # (retries during kills)
    if not args.json:
        print(f"grant promises: seed {seed}, {args.minutes:g} min", flush=True)
    config = promises.PromiseConfig(
        seed=seed,
        duration_s=args.minutes * 60,
        base_dir=args.keep,
        log_level=args.log_level,
    )
    result = asyncio.run(promises.run_promises(config))
    print(json.dumps(result.to_json(), indent=2) if args.json else result.summary())
    return 0 if result.ok else 1


def _totals(results: list[runner.ChaosResult], names: list[str]) -> dict[str, Any]:
    docs = [r.to_json() for r in results]
    out: dict[str, Any] = {"ok": all(r.ok for r in results), "seed": results[0].seed}
    for key in ("kills_survived", "switches", "faults_injected", "violations", "jobs_lost"):
        out[key] = sum(d[key] for d in docs)
    if names:
        out["runs"] = dict(zip(names, docs, strict=True))
    return out


if __name__ == "__main__":
    sys.exit(main())
