"""Soak, Kubernetes HA mode: the long form of tests/kube/test_ha_chaos.py (issue 22).

Two orchestrator replicas (``--kubernetes --ha``) and three simulated agents, real
processes, against the API-server emulator of tests/kube (no kube-apiserver can be
installed here); job processes (a pod each) take one or two random groups at a time
with a 3 s holder lease, following the leader. For ``--minutes``, every 2-5 s (drawn
from the seed) the run SIGKILLs or SIGSTOPs (longer than the Lease) the leader or a
follower, deletes the Lease or a group's state ConfigMap, or SIGKILLs a holder. Then the
device journals are checked against what the jobs saw. It prints the disruptions
survived, switches, violations (must be 0) and jobs lost (must be 0), and exits 1
otherwise.

    python bench/soak_kubernetes.py [--minutes 3] [--seed S] [--slots 4] [--json]
                                    [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

# The API-server emulator and the HA chaos run are test code (tests/kube).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kube import ha_chaos
from tests.kube.emulator import ApiServerEmulator
from tslice.chaos import runner


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="how long jobs run and get hit")
    p.add_argument("--seed", type=int, default=None, help="seed (default: a random one)")
    p.add_argument("--slots", type=int, default=4, help="jobs running at once")
    p.add_argument("--steps", type=int, default=10, help="acquire/work/yield cycles per job")
    p.add_argument("--keep", type=Path, default=None, help="keep logs and records here")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    if not args.json:
        print(f"soak (kubernetes HA): seed {seed}, {args.minutes:g} min, {args.slots} jobs at once")
    config = runner.ChaosConfig(
        seed=seed,
        duration_s=args.minutes * 60,
        slots=args.slots,
        steps=args.steps,
        kill_gap_s=(2.0, 5.0),
        fail_probability=0.0,
        hang_probability=0.0,
    )
    with tempfile.TemporaryDirectory(prefix="tslice-soak-kube-") as scratch:
        base = args.keep if args.keep is not None else Path(scratch)
        with ApiServerEmulator() as api:
            result = asyncio.run(ha_chaos.run(config, api, base / "run"))
    print(json.dumps(result.to_json(), indent=2) if args.json else result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
