"""Interleaved A/B of bench/load.py: A = a tree measured, B = a baseline tree.

    python bench/ab_load.py A_TREE B_TREE PAIRS [bench/load.py options...]

Runs B, A, A, B, B, A ... (ABBA order: a drift of the machine's load weighs on both alike)
with PYTHONPATH at each tree's src/ (this checkout's bench script for both), prints each
run and the medians of the per-pair ratios A/B. Make B with `git worktree add /tmp/b REV`.
"""

import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = ("grants_per_s", "orch_ms", "agents_ms", "clients_ms", "handover_p50", "handover_p99")


def run(tree: str, extra: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "src"))
    cmd = [sys.executable, os.path.join(HERE, "load.py"), "--json", *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    if r["errors"] or r["violations"]:
        raise SystemExit(f"{tree}: errors or violations: {r}")
    return {
        "grants_per_s": r["grants_per_s"],
        "orch_ms": r["orchestrator"]["cpu_ms_per_grant"],
        "agents_ms": r["agents_cpu_ms_per_grant"],
        "clients_ms": r["generators_cpu_ms_per_grant"],
        "handover_p50": r["handover_ms"]["p50"],
        "handover_p99": r["handover_ms"]["p99"],
    }


def main() -> None:
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    tree_a, tree_b, pairs, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    ratios: dict[str, list[float]] = {k: [] for k in KEYS}
    for i in range(pairs):
        if i % 2:
            a, b = run(tree_a, extra), run(tree_b, extra)
        else:
            b, a = run(tree_b, extra), run(tree_a, extra)
        for k in KEYS:
            ratios[k].append(a[k] / b[k] if b[k] else float("nan"))
        print(f"pair {i + 1}: B " + " ".join(f"{k}={b[k]:.2f}" for k in KEYS), flush=True)
        print(f"pair {i + 1}: A " + " ".join(f"{k}={a[k]:.2f}" for k in KEYS), flush=True)
    print("median A/B: " + " ".join(f"{k}={statistics.median(v):.3f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
