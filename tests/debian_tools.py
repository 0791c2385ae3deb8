"""Debian programs the tests start themselves (promtool, chromium, tmux): .ci/run installs
them when absent, so a missing one fails the test in CI and skips it elsewhere."""

from __future__ import annotations

import os
import shutil

import pytest


def binary(name: str, package: str) -> str:
    """The path of ``name`` (from Debian's ``package``)."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs Debian's {package} package")
        pytest.skip(f"{name} not installed (apt-get install {package})")
    return found
