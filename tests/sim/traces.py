"""Recorded runs of other shapes, laid out from known phases (for derivation and demo tests)."""

from __future__ import annotations

from typing import Any

Lane = list[tuple[tuple[str, ...], float]]


def constructed(
    jobs: dict[str, tuple[float, list[Lane]]],
    *,
    steps: int,
    mode: str | None,
    shared: tuple[str, ...],
) -> dict[str, Any]:
    """A recorded run laid out from each job's lanes (phases: pools held, seconds), no waits.

    Every job starts at its offset; a lane's phases follow each other, step after step;
    a pool held by consecutive phases is one window. Switch costs only for ``shared``.
    """
    windows: dict[str, list[dict[str, Any]]] = {}
    events: list[dict[str, Any]] = []
    for job, (offset, lanes) in jobs.items():
        for lane in lanes:
            t, open_at = offset, dict[str, float]()
            for step in range(steps):
                for pools, seconds in lane:
                    for pool in [p for p in open_at if p not in pools]:
                        windows.setdefault(pool, []).append(
                            {"t0": open_at.pop(pool), "t1": t, "job": job}
                        )
                    for pool in pools:
                        if pool not in open_at:
                            open_at[pool] = t
                            events.append(
                                {"t": t, "kind": "acquired", "job": job, "pool": pool}
                                | {"wait_ms": 0, "restore_ms": 0, "step": step}
                            )
                    t += seconds
            for pool, t0 in open_at.items():
                windows.setdefault(pool, []).append({"t0": t0, "t1": t, "job": job})
    for pool in shared:
        for kind, ms in (("ckpt_done", 4000), ("restore_done", 1500)):
            events.append({"t": 0, "kind": kind, "job": "A", "pool": pool, "ms": ms})
    out: dict[str, Any] = {"timeslice": {"windows": windows, "events": events}}
    if mode is not None:
        out["meta"] = {"mode": mode}
    return out


def three_pools_one_private(steps: int = 5) -> dict[str, Any]:
    """gen and learn are shared (one job at a time), judge is each job's own (a reward
    model on a GPU per job: the jobs' windows there overlap); no baseline, no summary."""
    step: Lane = [(("learn",), 60), (("gen", "learn"), 10), (("gen",), 60), (("judge",), 210)]
    raw = constructed(
        {"A": (0.0, [step]), "B": (170.0, [step])}, steps=steps, mode=None, shared=("gen", "learn")
    )
    raw["pool_map"] = {"0": "gen", "1": "learn", "2": "judge", "3": "judge"}
    return raw
