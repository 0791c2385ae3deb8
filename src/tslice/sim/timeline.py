"""Self-contained HTML timeline of simulated runs: lock windows per pool and the switches.

One SVG per run (same horizontal scale, so the time saved is visible), one lane per
pool with a bar per lock window coloured by job, and under it a thin lane with the
snapshot and restore operations the agents reported. Hovering shows the details.
The file carries its CSS and SVG inline and references nothing outside itself, so it
opens offline and can be attached to an issue.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence
from pathlib import Path

from tslice.sim import rljob

SNAPSHOT = "snapshot"
RESTORE = "restore"

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7")
_LABEL_W = 180
_PLOT_W = 1000
_LANE_H = 30
_OPS_H = 12
_GAP = 10
_AXIS_H = 28


@dataclasses.dataclass(frozen=True)
class SwitchOp:
    """A snapshot or restore of ``job`` on ``node`` for ``group``, over [start, end]."""

    node: str
    group: str
    job: str
    kind: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Lane:
    """A pool as drawn: its name, the orchestrator group and the node(s) behind it
    (group "": a pool each job has to itself, never switched)."""

    pool: str
    group: str
    nodes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RunView:
    name: str
    start: float
    end: float
    windows: Sequence[rljob.Window]
    ops: Sequence[SwitchOp]


def render_html(
    *,
    title: str,
    runs: Sequence[RunView],
    lanes: Sequence[Lane],
    jobs: Sequence[str],
    time_scale: float,
    summary: Sequence[tuple[str, str]] = (),
) -> str:
    """The whole HTML document as a string."""
    colours = {job: _PALETTE[i % len(_PALETTE)] for i, job in enumerate(jobs)}
    longest = max((r.end - r.start for r in runs), default=1.0) or 1.0
    px_per_s = _PLOT_W / longest
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
    ]
    if summary:
        parts.append('<table class="summary">')
        parts.extend(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in summary)
        parts.append("</table>")
    parts.append(_legend(colours))
    for run in runs:
        parts.append(f"<h2>{_e(run.name)}</h2>")
        parts.append(_run_svg(run, lanes, colours, px_per_s, time_scale))
    parts.append(
        '<p class="note">Times on the axis are trace time (the recorded run\'s clock); '
        f"the demo ran {time_scale:g}x faster. Bars are lock windows as the jobs saw them "
        "(acquire returned &rarr; yield called); the thin lane under each pool shows "
        "the snapshot and restore operations reported by the agents.</p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)


def write(path: Path, document: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document, encoding="utf-8")
    return path


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _legend(colours: dict[str, str]) -> str:
    items = [
        f'<span class="key"><span class="swatch" style="background:{c}"></span>job {_e(j)}</span>'
        for j, c in colours.items()
    ]
    items.append('<span class="key"><span class="swatch snapshot"></span>snapshot</span>')
    items.append('<span class="key"><span class="swatch restore"></span>restore</span>')
    return f'<div class="legend">{"".join(items)}</div>'


def _run_svg(
    run: RunView,
    lanes: Sequence[Lane],
    colours: dict[str, str],
    px_per_s: float,
    time_scale: float,
) -> str:
    lane_block = _LANE_H + _OPS_H + _GAP
    height = len(lanes) * lane_block + _AXIS_H
    width = _LABEL_W + _PLOT_W + 20
    out = [
        f'<svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(run.name)}">'
    ]

    def x(t: float) -> float:
        return _LABEL_W + (t - run.start) * px_per_s

    for i, lane in enumerate(lanes):
        top = i * lane_block
        nodes = ", ".join(lane.nodes)
        out.append(
            f'<text class="lane" x="4" y="{top + _LANE_H / 2 + 4}">{_e(lane.pool)}'
            f'<tspan class="node"> ({_e(nodes)})</tspan></text>'
        )
        track_w = (run.end - run.start) * px_per_s
        out.append(
            f'<rect class="track" x="{_LABEL_W}" y="{top}" width="{track_w:.1f}" '
            f'height="{_LANE_H}"></rect>'
        )
        for w in run.windows:
            if w.pool != lane.pool or w.acquired is None:
                continue
            end = w.yielded if w.yielded is not None else run.end
            held = end - w.acquired
            tip = (
                f"job {w.job} - {lane.pool}, step {w.step} ({w.phase})\n"
                f"held {_trace(held * time_scale)} trace / {held:.2f} s demo\n"
                f"waited {_trace(w.waited_ms / 1000 * time_scale)} trace; "
                f"restored: {'yes' if w.context_restored else 'no'}; epoch {w.grant_epoch}"
            )
            left, span = x(w.acquired), max(held * px_per_s, 1.0)
            out.append(
                f'<g class="win"><rect x="{left:.1f}" y="{top + 2}" width="{span:.1f}" '
                f'height="{_LANE_H - 4}" rx="3" fill="{colours.get(w.job, "#999")}">'
                f"<title>{_e(tip)}</title></rect>"
            )
            if span > 40:
                out.append(
                    f'<text class="bar" x="{left + 4:.1f}" y="{top + _LANE_H / 2 + 4}">'
                    f"{_e(w.job)} s{w.step}</text>"
                )
            out.append("</g>")
        ops_top = top + _LANE_H + 1
        for op in run.ops:
            if op.group != lane.group:
                continue
            dur = op.end - op.start
            tip = (
                f"{op.kind} of job {op.job} on {op.node}: "
                f"{_trace(dur * time_scale)} trace / {dur * 1000:.0f} ms demo"
            )
            out.append(
                f'<rect class="{_e(op.kind)}" x="{x(op.start):.1f}" y="{ops_top}" '
                f'width="{max(dur * px_per_s, 1.5):.1f}" height="{_OPS_H - 2}">'
                f"<title>{_e(tip)}</title></rect>"
            )
    out.append(_axis(len(lanes) * lane_block, run.end - run.start, px_per_s, time_scale))
    out.append("</svg>")
    return "\n".join(out)


def _axis(top: float, span_s: float, px_per_s: float, time_scale: float) -> str:
    trace_span = span_s * time_scale
    # Round ticks in the unit the labels use: minutes for long runs, seconds otherwise.
    unit = 60.0 if trace_span >= 600 else 1.0
    step = _nice_step(trace_span / unit / 8) * unit
    out = [f'<line class="axis" x1="{_LABEL_W}" y1="{top}" x2="{_LABEL_W + _PLOT_W}" y2="{top}"/>']
    n = 0
    while n * step <= trace_span + 1e-9:
        px = _LABEL_W + n * step / time_scale * px_per_s
        out.append(f'<line class="tick" x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{top + 5}"/>')
        out.append(f'<text class="tick" x="{px:.1f}" y="{top + 18}">{_trace(n * step)}</text>')
        n += 1
    return "\n".join(out)


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if base * mult >= raw:
            return float(base * mult)
    return float(base * 10)


def _trace(seconds: float) -> str:
    if seconds >= 120:
        return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


_CSS = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin: 18px 0 6px; }
table.summary { border-collapse: collapse; margin-bottom: 12px; }
table.summary th { text-align: left; padding: 2px 12px 2px 0; font-weight: 600; }
table.summary td { padding: 2px 0; font-variant-numeric: tabular-nums; }
.legend { margin: 8px 0; } .key { margin-right: 16px; white-space: nowrap; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -1px; border-radius: 2px; }
.swatch.snapshot, rect.snapshot { background: #c0392b; fill: #c0392b; }
.swatch.restore, rect.restore { background: #27ae60; fill: #27ae60; }
svg { display: block; overflow: visible; }
rect.track { fill: #f3f3f3; }
g.win rect:hover, rect.snapshot:hover, rect.restore:hover { stroke: #000; stroke-width: 1.5; }
text.lane { font-weight: 600; font-size: 13px; } tspan.node { font-weight: 400; fill: #666; }
text.bar { fill: #fff; font-size: 11px; pointer-events: none; }
line.axis, line.tick { stroke: #888; }
text.tick { font-size: 11px; fill: #555; text-anchor: middle; }
p.note { color: #666; max-width: 1100px; }
"""
