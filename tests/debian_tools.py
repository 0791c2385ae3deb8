"""Debian programs the tests start themselves (promtool, chromium, tmux): `make test`
installs them when absent (scripts/test_tools.sh), so a missing one fails the test."""

from __future__ import annotations

import shutil

import pytest


def binary(name: str, package: str) -> str:
    """The path of ``name`` (from Debian's ``package``); fails the test if it is absent."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is missing: `make test` installs Debian's {package} package "
            "(scripts/test_tools.sh), or apt-get install {package}"
        )
    return found
