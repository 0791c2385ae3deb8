"""Where everything of a run goes: a list of drawing primitives, in pixels.

The HTML page (SVG) and the PNG draw the same :class:`Figure`, so both show exactly the
same picture. Per run, top to bottom: one lane per pool (a bar per lock window, coloured by
job) with a thin lane under it for the moves of device state (snapshots red, restores
green) and whole switches (a black tick with the switch's duration when there is room);
then one small area chart per GPU with its duty (0-100 %); then the time axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from tslice.timeline import model

LABEL_W = 190
PLOT_W = 1000
WIDTH = LABEL_W + PLOT_W + 30
LANE_H = 28
MOVES_H = 12
GAP = 8
DUTY_H = 26
AXIS_H = 26
TRACK = "#f0f0f0"
TEXT = "#222222"
MUTED = "#666666"


@dataclasses.dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    tip: str = ""
    cls: str = ""


@dataclasses.dataclass(frozen=True)
class Text:
    x: float
    y: float
    text: str
    size: int = 11
    fill: str = TEXT
    bold: bool = False
    #: "start", "middle" or "end".
    anchor: str = "start"


@dataclasses.dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str = MUTED
    width: float = 1.0
    tip: str = ""
    cls: str = ""


@dataclasses.dataclass(frozen=True)
class Area:
    """A filled polygon (a duty curve) over ``points``."""

    points: tuple[tuple[float, float], ...]
    fill: str
    tip: str = ""
    cls: str = ""


Item = Rect | Text | Line | Area


@dataclasses.dataclass(frozen=True)
class Figure:
    title: str
    width: int
    height: int
    items: tuple[Item, ...]
    #: The plot's left edge and scale (the page's time cursor reads them).
    x0: float
    px_per_s: float


def figures(timeline: model.Timeline) -> list[Figure]:
    """One figure per run, all on the same time scale (the time saved shows)."""
    px_per_s = PLOT_W / timeline.longest_s
    colours = model.colours(timeline.jobs)
    return [_figure(run, timeline.pools, colours, px_per_s) for run in timeline.runs]


def _figure(
    run: model.Run, pools: Sequence[model.Pool], colours: dict[str, str], px_per_s: float
) -> Figure:
    items: list[Item] = []

    def x(t: float) -> float:
        return LABEL_W + max(t, 0.0) * px_per_s

    top = 0.0
    span_w = run.duration_s * px_per_s
    used_pools = [p for p in pools if any(w.pool == p.name for w in run.windows)]
    for pool in used_pools:
        items.append(Text(4, top + LANE_H / 2 + 4, pool.name, 13, bold=True))
        if pool.where:
            items.append(Text(4, top + LANE_H / 2 + 17, pool.where, 10, MUTED))
        items.append(Rect(LABEL_W, top, span_w, LANE_H, TRACK, cls="track"))
        for w in run.windows:
            if w.pool != pool.name:
                continue
            left, width = x(w.t0), max((w.t1 - w.t0) * px_per_s, 1.0)
            tip = f"job {w.job} held {pool.name}: {model.duration_text(w.t1 - w.t0)}"
            tip += f" (from {model.duration_text(w.t0)})" + (f"; {w.detail}" if w.detail else "")
            items.append(
                Rect(left, top + 2, width, LANE_H - 4, colours.get(w.job, "#999999"), tip, "win")
            )
            if width > 36:
                items.append(Text(left + 4, top + LANE_H / 2 + 4, w.job, 11, "#ffffff"))
        moves_top = top + LANE_H + 1
        for m in run.moves:
            if m.pool != pool.name:
                continue
            fill = model.SNAPSHOT_COLOUR if m.kind == model.SNAPSHOT else model.RESTORE_COLOUR
            where = f" on {m.node}" if m.node else ""
            tip = f"{m.kind} of job {m.job}{where}: {model.duration_text(m.t1 - m.t0)}"
            items.append(
                Rect(
                    x(m.t0),
                    moves_top,
                    max((m.t1 - m.t0) * px_per_s, 1.5),
                    MOVES_H - 2,
                    fill,
                    tip,
                    m.kind,
                )
            )
        for s in run.switches:
            if s.pool != pool.name:
                continue
            took = model.duration_text(s.t1 - s.t0)
            tip = f"switch of {pool.name}: {s.from_job or '-'} -> {s.to_job} in {took}"
            left = x(s.t0)
            items.append(
                Line(
                    left,
                    top,
                    left,
                    moves_top + MOVES_H - 2,
                    model.SWITCH_COLOUR,
                    1.5,
                    tip,
                    "switch",
                )
            )
            if (s.t1 - s.t0) * px_per_s > 44:
                items.append(Text(left + 3, moves_top + MOVES_H - 3, took, 9, TEXT))
        top = moves_top + MOVES_H + GAP
    for label, points in run.duty:
        items.append(Text(4, top + DUTY_H / 2 + 4, label, 11, MUTED))
        items.append(Rect(LABEL_W, top, span_w, DUTY_H, TRACK, cls="track"))
        if points:
            mean = sum(p[1] for p in points) / len(points)
            area = _step_area(points, run.duration_s, x, top + DUTY_H, DUTY_H)
            tip = f"{label}: duty over time (mean of the samples {mean:.0f} %)"
            items.append(Area(area, model.DUTY_COLOUR, tip, "duty"))
        top += DUTY_H + 4
    top += 4
    items.extend(_axis(top, run.duration_s, px_per_s))
    return Figure(run.name, WIDTH, math.ceil(top + AXIS_H), tuple(items), LABEL_W, px_per_s)


def _step_area(
    points: Sequence[tuple[float, float]],
    end: float,
    x: Callable[[float], float],
    bottom: float,
    height: float,
) -> tuple[tuple[float, float], ...]:
    out: list[tuple[float, float]] = [(x(points[0][0]), bottom)]
    for i, (t, pct) in enumerate(points):
        t_next = points[i + 1][0] if i + 1 < len(points) else end
        y = bottom - min(max(pct, 0.0), 100.0) / 100 * height
        out += [(x(t), y), (x(t_next), y)]
    out.append((x(end), bottom))
    return tuple((round(a, 1), round(b, 1)) for a, b in out)


def _axis(top: float, span_s: float, px_per_s: float) -> list[Item]:
    unit = 60.0 if span_s >= 600 else 1.0
    step = _nice_step(span_s / unit / 8) * unit
    items: list[Item] = [Line(LABEL_W, top, LABEL_W + span_s * px_per_s, top, cls="axis")]
    n = 0
    while n * step <= span_s + 1e-9:
        px = LABEL_W + n * step * px_per_s
        items.append(Line(px, top, px, top + 5, cls="tick"))
        items.append(Text(px, top + 18, _tick(n * step, unit), 10, MUTED, anchor="middle"))
        n += 1
    return items


def _tick(seconds: float, unit: float) -> str:
    if unit == 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if base * mult >= raw:
            return float(base * mult)
    return float(base * 10)
