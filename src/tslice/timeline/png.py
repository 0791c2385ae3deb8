"""A timeline as a PNG (Pillow, from the server extra; imported when used): the same
figures as the HTML page (:mod:`tslice.timeline.layout`), under a title, the summary and
the legend."""

from __future__ import annotations

import io
import pathlib
from typing import Any

from tslice.common import errors
from tslice.timeline import layout, model

#: Debian's fonts-dejavu-core; Pillow's own font where it is missing.
_SYSTEM_FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
_MARGIN = 16
_ROW = 16


def _pillow() -> Any:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as err:
        raise errors.ConfigError(
            "a PNG timeline needs Pillow: pip install 'tslice[server]' (or pip install "
            "pillow); the HTML timeline needs nothing"
        ) from err
    return Image, ImageDraw, ImageFont


def render(timeline: model.Timeline) -> bytes:
    """The PNG file's bytes."""
    image_mod, draw_mod, font_mod = _pillow()
    fonts: dict[int, Any] = {}

    def font(size: int) -> Any:
        if size not in fonts:
            try:  # wider coverage (x, arrows) where the system has it
                fonts[size] = font_mod.truetype(_SYSTEM_FONT, size)
            except OSError:
                fonts[size] = font_mod.load_default(size=size)
        return fonts[size]

    figures = layout.figures(timeline)
    # Two columns of the summary where its values are short, else one.
    columns = 2 if all(len(v) <= 40 for _, v in timeline.summary) else 1
    summary_rows = (len(timeline.summary) + columns - 1) // columns
    header = 34 + summary_rows * _ROW + 8 + _ROW + 8
    height = header + sum(f.height + 30 for f in figures) + 2 * _MARGIN + _ROW
    width = layout.WIDTH + 2 * _MARGIN
    image = image_mod.new("RGB", (width, height), "#ffffff")
    draw = draw_mod.Draw(image)
    draw.text((_MARGIN, _MARGIN), timeline.title, fill=layout.TEXT, font=font(18))
    y = _MARGIN + 34
    half = layout.WIDTH // 2
    for i, (key, value) in enumerate(timeline.summary):
        col, row = i % columns, i // columns
        x = _MARGIN + col * half
        draw.text((x, y + row * _ROW), f"{key}:", fill=layout.TEXT, font=font(12))
        draw.text((x + 190, y + row * _ROW), value, fill=layout.MUTED, font=font(12))
    y += summary_rows * _ROW + 8
    x = _MARGIN
    legend = [(f"job {j}", c) for j, c in model.colours(timeline.jobs).items()]
    legend += [
        ("snapshot", model.SNAPSHOT_COLOUR),
        ("restore", model.RESTORE_COLOUR),
        ("switch", model.SWITCH_COLOUR),
        ("duty", model.DUTY_COLOUR),
    ]
    for name, colour in legend:
        draw.rectangle((x, y + 2, x + 11, y + 13), fill=colour)
        draw.text((x + 16, y + 1), name, fill=layout.TEXT, font=font(12))
        x += 16 + int(draw.textlength(name, font=font(12))) + 18
    y += _ROW + 8
    for run, figure in zip(timeline.runs, figures, strict=True):
        title = f"{run.name}  ({model.duration_text(run.duration_s)})"
        draw.text((_MARGIN, y), title, fill=layout.TEXT, font=font(15))
        y += 26
        _draw(draw, figure, _MARGIN, y, font)
        y += figure.height + 4
    draw.text((_MARGIN, y), f"time axis: {timeline.clock}", fill=layout.MUTED, font=font(11))
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def _draw(draw: Any, figure: layout.Figure, dx: float, dy: float, font: Any) -> None:
    for item in figure.items:
        if isinstance(item, layout.Rect):
            if item.w <= 0 or item.h <= 0:
                continue
            draw.rectangle(
                (dx + item.x, dy + item.y, dx + item.x + item.w - 1, dy + item.y + item.h - 1),
                fill=item.fill,
            )
        elif isinstance(item, layout.Text):
            anchor = {"start": "ls", "middle": "ms", "end": "rs"}[item.anchor]
            draw.text(
                (dx + item.x, dy + item.y),
                item.text,
                fill=item.fill,
                font=font(item.size),
                anchor=anchor,
            )
        elif isinstance(item, layout.Line):
            draw.line(
                (dx + item.x1, dy + item.y1, dx + item.x2, dy + item.y2),
                fill=item.stroke,
                width=max(1, round(item.width)),
            )
        else:
            draw.polygon([(dx + a, dy + b) for a, b in item.points], fill=item.fill)


def write(path: pathlib.Path, timeline: model.Timeline) -> pathlib.Path:
    data = render(timeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
