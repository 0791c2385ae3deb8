"""Headless Debian chromium for tests: a page's DOM after its scripts ran, and a screenshot.

Chromium is Debian's `chromium` package (.ci/run installs it when absent); without it
these tests fail in CI and skip elsewhere. Every run has a fresh profile and nothing that
reaches out (no sync, no component updates, no background networking).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

from tests import debian_tools

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def _run(page: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="tslice-chromium-") as profile:
        return subprocess.run(
            [
                debian_tools.binary("chromium", "chromium"),
                *FLAGS,
                f"--user-data-dir={profile}",
                *args,
                page.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


def dom(page: pathlib.Path) -> str:
    """The page's DOM once loaded and its scripts ran."""
    done = _run(page, "--dump-dom", "--virtual-time-budget=2000")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(page: pathlib.Path, out: pathlib.Path, *, width: int, height: int) -> pathlib.Path:
    done = _run(page, f"--screenshot={out}", f"--window-size={width},{height}")
    assert done.returncode == 0 and out.is_file(), done.stderr[-2000:]
    return out


def keep(shot: pathlib.Path, name: str) -> None:
    """Copy a screenshot to $TSLICE_SCREENSHOTS (docs/img: the docs show what tests made)."""
    where = os.environ.get("TSLICE_SCREENSHOTS")
    if where:
        pathlib.Path(where).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, pathlib.Path(where) / name)
