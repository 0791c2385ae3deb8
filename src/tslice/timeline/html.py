"""A timeline as one self-contained HTML page: inline CSS, SVG and a small script, nothing
fetched, so it opens offline and can be attached to an issue.

Hovering a bar shows what it is (SVG titles); the script adds a time cursor over each run
and marks the page ready (``<body data-ready="yes">``), recording any script error in
``data-errors``, which the tests read from a headless browser.
"""

from __future__ import annotations

import html
import pathlib

from tslice.timeline import layout, model


def render(timeline: model.Timeline) -> str:
    """The whole page as a string."""
    colours = model.colours(timeline.jobs)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(timeline.title)}</title>",
        f"<style>{_CSS}</style>",
        f"<script>{_ERRORS}</script></head><body>",
        f"<h1>{_e(timeline.title)}</h1>",
    ]
    if timeline.summary:
        parts.append('<div class="summary">')
        parts += [f"<b>{_e(k)}</b><span>{_e(v)}</span>" for k, v in timeline.summary]
        parts.append("</div>")
    parts.append(_legend(colours))
    for run, figure in zip(timeline.runs, layout.figures(timeline), strict=True):
        switches = len(run.switches) or sum(m.kind == model.SNAPSHOT for m in run.moves)
        parts.append(
            f'<h2>{_e(run.name)} <span class="sub">{model.duration_text(run.duration_s)}'
            + (f", {switches} switches" if switches else "")
            + "</span></h2>"
        )
        parts.append(svg(figure))
    parts.append(
        f'<p class="note">Time axis: {_e(timeline.clock)}. Bars are lock windows (grant to '
        "yield); the thin lane under each pool shows the snapshots and restores the agents "
        "reported, and a black tick each whole switch (with its duration where it fits). "
        "Duty: the GPU's busy share as recorded; in tslice's own history, the share of "
        "time some job held the GPU's group.</p>"
    )
    parts.append(f"<script>{_CURSOR}</script></body></html>")
    return "\n".join(parts)


def svg(figure: layout.Figure) -> str:
    out = [
        f'<svg class="run" width="{figure.width}" height="{figure.height}" '
        f'viewBox="0 0 {figure.width} {figure.height}" role="img" '
        f'aria-label="{_e(figure.title)}" data-x0="{figure.x0}" '
        f'data-px-per-s="{figure.px_per_s:.6g}">'
    ]
    for item in figure.items:
        out.append(_item(item))
    out.append("</svg>")
    return "\n".join(out)


def _item(item: layout.Item) -> str:
    said: str = getattr(item, "tip", "")
    tip = f"<title>{_e(said)}</title>" if said else ""
    if isinstance(item, layout.Rect):
        cls = f' class="{item.cls}"' if item.cls else ""
        return (
            f'<rect{cls} x="{item.x:.1f}" y="{item.y:.1f}" width="{item.w:.1f}" '
            f'height="{item.h:.1f}" fill="{item.fill}">{tip}</rect>'
        )
    if isinstance(item, layout.Text):
        weight = ' font-weight="600"' if item.bold else ""
        return (
            f'<text x="{item.x:.1f}" y="{item.y:.1f}" font-size="{item.size}" '
            f'fill="{item.fill}" text-anchor="{item.anchor}"{weight}>{_e(item.text)}</text>'
        )
    if isinstance(item, layout.Line):
        cls = f' class="{item.cls}"' if item.cls else ""
        return (
            f'<line{cls} x1="{item.x1:.1f}" y1="{item.y1:.1f}" x2="{item.x2:.1f}" '
            f'y2="{item.y2:.1f}" stroke="{item.stroke}" stroke-width="{item.width:g}">'
            f"{tip}</line>"
        )
    points = " ".join(f"{a:.1f},{b:.1f}" for a, b in item.points)
    cls = f' class="{item.cls}"' if item.cls else ""
    return f'<polygon{cls} points="{points}" fill="{item.fill}">{tip}</polygon>'


def write(path: pathlib.Path, document: str) -> pathlib.Path:
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
    for name, colour in (
        ("snapshot", model.SNAPSHOT_COLOUR),
        ("restore", model.RESTORE_COLOUR),
        ("switch", model.SWITCH_COLOUR),
        ("duty", model.DUTY_COLOUR),
    ):
        items.append(
            f'<span class="key"><span class="swatch" style="background:{colour}"></span>'
            f"{name}</span>"
        )
    return f'<div class="legend">{"".join(items)}</div>'


_ERRORS = """
document.documentElement.dataset.errors = "";
window.addEventListener("error", function (e) {
  document.documentElement.dataset.errors += (e.message || "error") + ";";
});
"""

_CURSOR = """
(function () {
  function label(s) {
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(2) + " h";
  }
  document.querySelectorAll("svg.run").forEach(function (svg) {
    var ns = svg.namespaceURI;
    var x0 = parseFloat(svg.dataset.x0), pps = parseFloat(svg.dataset.pxPerS);
    var line = document.createElementNS(ns, "line"), text = document.createElementNS(ns, "text");
    line.setAttribute("class", "cursor"); text.setAttribute("class", "cursor");
    line.setAttribute("y1", 0); line.setAttribute("y2", svg.getAttribute("height"));
    line.style.display = text.style.display = "none";
    svg.appendChild(line); svg.appendChild(text);
    svg.addEventListener("mousemove", function (e) {
      var box = svg.getBoundingClientRect(), x = e.clientX - box.left;
      var show = x >= x0;
      line.style.display = text.style.display = show ? "" : "none";
      if (!show) return;
      line.setAttribute("x1", x); line.setAttribute("x2", x);
      text.setAttribute("x", x + 4); text.setAttribute("y", 10);
      text.textContent = label((x - x0) / pps);
    });
    svg.addEventListener("mouseleave", function () {
      line.style.display = text.style.display = "none";
    });
  });
  document.body.dataset.ready = "yes";
})();
"""

_CSS = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin: 18px 0 6px; }
h2 .sub { font-weight: 400; color: #666; font-size: 13px; }
div.summary { display: grid; grid-template-columns: repeat(2, max-content minmax(0, 28em));
  gap: 2px 14px; margin-bottom: 12px; }
div.summary span { font-variant-numeric: tabular-nums; }
.legend { margin: 8px 0; } .key { margin-right: 16px; white-space: nowrap; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -1px; border-radius: 2px; }
svg { display: block; overflow: visible; font-family: system-ui, sans-serif; }
rect.win:hover, rect.snapshot:hover, rect.restore:hover { stroke: #000; stroke-width: 1.5; }
line.cursor { stroke: #000; stroke-dasharray: 3 3; pointer-events: none; }
text.cursor { font-size: 11px; pointer-events: none; }
p.note { color: #666; max-width: 1100px; }
"""
