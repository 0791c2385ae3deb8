"""The HTML timeline is one self-contained file showing both pools, both jobs and both runs."""

from __future__ import annotations

import re
from pathlib import Path

from tslice.sim import rljob, timeline


def win(run: str, job: str, pool: str, t0: float, t1: float) -> rljob.Window:
    return rljob.Window(
        run=run,
        job=job,
        pool=pool,
        group=pool,
        step=0,
        phase="sample",
        requested=t0,
        acquired=t0,
        yielded=t1,
        waited_ms=5,
        context_restored=True,
        grant_epoch=1,
    )


def document() -> str:
    exclusive = timeline.RunView(
        name="exclusive run",
        start=0.0,
        end=8.0,
        windows=[
            win("x", "A", "sampler", 0, 2),
            win("x", "A", "trainer", 2, 4),
            win("x", "B", "sampler", 4.1, 6),
            win("x", "B", "trainer", 6, 8),
        ],
        ops=[
            timeline.SwitchOp(
                node="node-a", group="sampler", job="A", kind=timeline.SNAPSHOT, start=4.0, end=4.05
            )
        ],
    )
    sliced = timeline.RunView(
        name="time-sliced run",
        start=10.0,
        end=15.0,
        windows=[
            win("t", "A", "sampler", 10, 12),
            win("t", "B", "sampler", 12.1, 14),
            win("t", "A", "trainer", 12, 14),
            win("t", "B", "trainer", 14.1, 15),
        ],
        ops=[
            timeline.SwitchOp(
                node="node-b", group="trainer", job="B", kind=timeline.RESTORE, start=14.0, end=14.1
            )
        ],
    )
    return timeline.render_html(
        title="demo <test>",
        runs=[exclusive, sliced],
        lanes=[
            timeline.Lane("sampler", "sampler", ("node-a",)),
            timeline.Lane("trainer", "trainer", ("node-b",)),
        ],
        jobs=["A", "B"],
        time_scale=100.0,
        summary=[("speedup", "1.60x")],
    )


def test_timeline_is_self_contained(tmp_path: Path) -> None:
    html = document()
    path = timeline.write(tmp_path / "out" / "timeline.html", html)
    assert path.read_text(encoding="utf-8") == html
    assert html.startswith("<!doctype html>")
    lowered = html.lower()
    assert "http://" not in lowered and "https://" not in lowered
    assert not re.search(r"<script[^>]+src=|<link\b|@import|url\(", lowered)


def test_timeline_shows_pools_jobs_runs_and_switches() -> None:
    html = document()
    for text in (
        "sampler",
        "trainer",
        "node-a",
        "node-b",
        "job A",
        "job B",
        "exclusive run",
        "time-sliced run",
        "speedup",
        "1.60x",
    ):
        assert text in html
    assert html.count("<svg") == 2
    # 8 lock windows + one snapshot and one restore bar.
    assert html.count('<g class="win">') == 8
    assert html.count('class="snapshot"') == 1 and html.count('class="restore"') == 1
    # User text is escaped.
    assert "demo &lt;test&gt;" in html and "demo <test>" not in html


def test_both_runs_share_one_time_scale() -> None:
    html = document()
    tracks = [float(w) for w in re.findall(r'class="track" x="\d+" y="\d+" width="([\d.]+)"', html)]
    # Exclusive run lasted 8 s, the time-sliced one 5 s: tracks keep that ratio.
    assert len(tracks) == 4
    assert tracks[0] / tracks[2] == 8 / 5
