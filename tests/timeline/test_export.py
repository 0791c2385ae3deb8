"""Orchestrator events in the recorded-run format: windows, moves, switches, steps, duty."""

from __future__ import annotations

from typing import Any

from tslice.timeline import export, recorded

T0 = 1_700_000_000.0


def ev(t: float, kind: str, group: str, job: str = "", **more: Any) -> dict[str, Any]:
    return {"time": T0 + t, "kind": kind, "group_id": group, "job_id": job, **more}


EVENTS = [
    ev(0.0, "QUEUED", "g", "a"),
    ev(0.0, "GRANTED", "g", "a", duration_ms=0),
    ev(1.0, "GRANTED", "g", "a", detail="already held"),  # the same window
    ev(2.0, "YIELDED", "g", "a"),
    ev(2.0, "SWITCH_STARTED", "g", "b", from_job="a"),
    ev(2.3, "SNAPSHOT_DONE", "g", "a", node="n1", duration_ms=300),
    ev(2.5, "RESTORE_DONE", "g", "b", node="n1", duration_ms=200),
    ev(2.5, "SWITCH_DONE", "g", "b", from_job="a", duration_ms=500),
    ev(2.5, "GRANTED", "g", "b", duration_ms=1500, detail="restored"),
    ev(3.0, "GRANTED", "h", "a", duration_ms=0),
    ev(4.0, "CANCELLED", "g", "b", detail="evicted from group 'g' by an administrator: x"),
    ev(5.0, "SWITCH_FAILED", "h", "b", detail="refused: no room"),
]


def test_windows_moves_switches_and_steps() -> None:
    doc = export.document(EVENTS, time_scale=10, end=T0 + 6)
    run = doc["timeslice"]
    assert run["duration_s"] == 60.0
    assert run["windows"]["g"] == [
        {"t0": 0.0, "t1": 20.0, "job": "a"},
        {"t0": 25.0, "t1": 40.0, "job": "b"},
    ]
    assert run["windows"]["h"] == [{"t0": 30.0, "t1": 60.0, "job": "a"}]  # open at the end
    acquired = [e for e in run["events"] if e["kind"] == "acquired"]
    assert [(e["job"], e["pool"], e["step"]) for e in acquired] == [
        ("a", "g", 0),
        ("b", "g", 0),
        ("a", "h", 0),  # a's steps count on g, its first group
    ]
    assert acquired[1]["wait_ms"] == 15000 and acquired[1]["restore_ms"] == 5000
    done = {e["kind"]: e for e in run["events"] if e["kind"].endswith("_done")}
    assert done["ckpt_done"]["ms"] == 3000 and done["ckpt_done"]["node"] == "n1"
    assert done["restore_done"]["t"] == 25.0
    assert run["switches"] == [
        {"pool": "g", "from": "a", "to": "b", "t0": 20.0, "t1": 25.0, "ms": 5000.0}
    ]
    assert run["failures"] == [{"pool": "h", "t": 50.0, "to": "b", "detail": "refused: no room"}]
    assert doc["pool_map"] == {"0": "g", "1": "h"}
    assert doc["meta"]["nodes"] == {"g": ["n1"]}
    summary = doc["summary"]
    assert summary["swaps"] == 1 and summary["held_s"] == {"a": 50.0, "b": 15.0}


def test_duty_is_the_share_of_time_held() -> None:
    doc = export.document(EVENTS, end=T0 + 6)
    duty_h = doc["timeslice"]["duty_gpus"]["1"]
    assert len(duty_h) == export.DUTY_POINTS
    assert duty_h[0][1] == 0 and duty_h[-1][1] == 100
    held = sum(p[1] for p in duty_h) / 100 * (6 / export.DUTY_POINTS)
    assert abs(held - 3.0) < 0.05


def test_the_groups_order_is_kept_and_the_timeline_reads_the_document() -> None:
    doc = export.document(EVENTS, groups=["h", "g"])
    assert doc["pool_map"] == {"0": "h", "1": "g"}
    drawn = recorded.timeline(doc, title="t")
    assert [p.name for p in drawn.pools] == ["h", "g"]
    (run,) = drawn.runs
    assert len(run.windows) == 3 and len(run.switches) == 1 and len(run.moves) == 2
    assert [label for label, _ in run.duty] == ["GPU 0 (h)", "GPU 1 (g)"]
    assert ("switches", "1") in drawn.summary
