"""Fixtures of the Kubernetes-mode tests: an API-server emulator on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kube.emulator import ApiServerEmulator


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator() as emulator:
        yield emulator
