"""Suite-wide options and fixtures: GPU tests run only with --with-gpu (kopf's --with-e2e
pattern); ``short_tmp``, a short directory for Unix sockets."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--with-gpu", action="store_true", help="also run tests that need a CUDA GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slow_modules_first(items)
    if config.getoption("--with-gpu"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run with --with-gpu on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _slow_modules_first(items: list[pytest.Item]) -> None:
    """Run the modules with a test marked slow (clusters of real processes, torch and
    transformers jobs: 20-40 s each) first, each module's tests in their order: on
    pytest-xdist their long tests then start while short modules fill the other workers,
    instead of one of them ending the run alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: the rest keeps its order


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path (``/tmp/ts-XXXXXXXX``), removed after the test.

    For Unix sockets: their paths are limited to 107 bytes, and ``tmp_path`` is
    ``/tmp/pytest-of-USER/pytest-N/[popen-gwK/]<test name>0``, too long once a server adds
    its own directories (pytest-xdist adds the ``popen-gwK`` part).
    """
    directory = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
