"""Hand-over latency of two checkouts, interleaved: ``handoff.py`` of A, then B, A, B ...

Each run is a whole ``bench/handoff.py --json`` of one checkout (its own orchestrator
and agent processes, started with that checkout's ``src`` first on PYTHONPATH), so the
machine's drift affects both sides alike; the per-pair ratio of the hand-over ratios
is what to read.

    python bench/ab_handoff.py --before /path/to/old/checkout [--pairs 4] [--rounds 300]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent.parent


def run(checkout: pathlib.Path, rounds: int) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": f"{checkout / 'src'}{os.pathsep}{checkout}"}
    out = subprocess.run(
        [sys.executable, str(checkout / "bench" / "handoff.py"), "--rounds", str(rounds), "--json"],
        env=env,
        cwd=checkout,
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    ).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def _ratio(result: dict[str, object]) -> float:
    return float(str(result["ratio_median"]))


def _line(result: dict[str, object]) -> str:
    hand = result["handoff"]
    assert isinstance(hand, dict)
    return f"{hand['median_ms']:.2f} ms ({_ratio(result):.2f}x the bare round trip)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=pathlib.Path, required=True, help="the other checkout")
    parser.add_argument("--after", type=pathlib.Path, default=HERE, help="default: this one")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    rows = []
    for i in range(args.pairs):
        before = run(args.before, args.rounds)
        after = run(args.after, args.rounds)
        rows.append((before, after))
        print(f"pair {i + 1}: before {_line(before)}  after {_line(after)}", flush=True)
    per_pair = [_ratio(a) / _ratio(b) for b, a in rows]
    print(
        f"after/before hand-over ratio, per pair: {', '.join(f'{r:.2f}' for r in per_pair)}; "
        f"median {statistics.median(per_pair):.2f}"
    )


if __name__ == "__main__":
    main()
