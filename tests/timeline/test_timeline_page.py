"""The timeline page in a real browser: headless chromium opens it offline, its script runs
without an error, and the screenshot shows the lanes, in the pixels."""

from __future__ import annotations

import json
import pathlib
import re

from PIL import Image

from tests.timeline import chromium
from tslice.phases import trace
from tslice.timeline import html, model, png, recorded

TRACE = trace.default_trace_path()


def _bands(image: Image.Image, colour: str, *, min_pixels: int = 40) -> list[tuple[int, int]]:
    """Row ranges where ``colour`` covers at least ``min_pixels`` pixels of a row."""
    rgb = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    pixels = image.convert("RGB").load()
    width, height = image.size
    rows = [
        y
        for y in range(height)
        if sum(1 for x in range(0, width, 2) if _near(pixels[x, y], rgb)) * 2 >= min_pixels
    ]
    bands: list[tuple[int, int]] = []
    for y in rows:
        if bands and y == bands[-1][1] + 1:
            bands[-1] = (bands[-1][0], y)
        else:
            bands.append((y, y))
    return bands


def _near(pixel: tuple[int, ...], rgb: tuple[int, ...]) -> bool:
    return all(abs(a - b) <= 6 for a, b in zip(pixel, rgb, strict=False))


def _verl() -> model.Timeline:
    return recorded.timeline(json.loads(TRACE.read_text()))


def test_the_page_is_self_contained(tmp_path: pathlib.Path) -> None:
    page = html.render(_verl())
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "@import" not in page and "url(" not in page


def test_chromium_runs_the_page_without_script_errors_and_draws_the_lanes(
    tmp_path: pathlib.Path,
) -> None:
    drawn = _verl()
    page = html.write(tmp_path / "timeline.html", html.render(drawn))
    dom = chromium.dom(page)
    assert 'data-ready="yes"' in dom, "the page's script did not finish"
    assert 'data-errors=""' in dom, re.findall(r'data-errors="([^"]*)"', dom)
    shot = chromium.screenshot(page, tmp_path / "shot.png", width=1300, height=1000)
    chromium.keep(shot, "timeline-recorded-trace.png")
    image = Image.open(shot)
    jobs = model.colours(drawn.jobs)
    # The time-sliced run: one lane per pool, each with windows of both jobs.
    lanes_a = _bands(image, jobs["A"])
    lanes_b = _bands(image, jobs["B"])
    assert len(lanes_a) == 2 and len(lanes_b) == 2, (lanes_a, lanes_b)
    for (a0, a1), (b0, b1) in zip(lanes_a, lanes_b, strict=True):
        assert abs(a0 - b0) <= 2 and abs(a1 - b1) <= 2, "both jobs share each lane"
        assert 18 <= a1 - a0 <= 30, "a lane is as tall as drawn"
    # Duty: a band per GPU of each run (baseline and time-sliced), under the lanes.
    duty = _bands(image, model.DUTY_COLOUR, min_pixels=20)
    assert len(duty) == 4, duty
    assert duty[2][0] > lanes_a[-1][1], "the time-sliced run's duty is under its lanes"
    # Snapshots (red) under each lane.
    moves = _bands(image, model.SNAPSHOT_COLOUR, min_pixels=4)
    assert any(lanes_a[0][1] < y0 < lanes_a[1][0] for y0, _ in moves)


def test_the_png_shows_the_same_lanes(tmp_path: pathlib.Path) -> None:
    drawn = _verl()
    path = png.write(tmp_path / "timeline.png", drawn)
    image = Image.open(path)
    assert image.format == "PNG" and image.size[0] > 1000
    jobs = model.colours(drawn.jobs)
    assert len(_bands(image, jobs["A"])) == 2 and len(_bands(image, jobs["B"])) == 2
    assert len(_bands(image, model.DUTY_COLOUR, min_pixels=20)) == 4
