"""Suite-wide options: GPU tests run only with --with-gpu (kopf's --with-e2e pattern)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--with-gpu", action="store_true", help="also run tests that need a CUDA GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--with-gpu"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run with --with-gpu on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
