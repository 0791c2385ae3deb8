"""Fixtures of the Kubernetes-mode tests: an API-server emulator on loopback, and HA
mode's processes against it."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.kube.emulator import ApiServerEmulator
from tests.kube.ha_stack import HaStack
from tests.kube.stack import Cluster, running


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator() as emulator:
        yield emulator


@pytest.fixture
def stack(api: ApiServerEmulator, tmp_path: pathlib.Path) -> Iterator[HaStack]:
    with running(HaStack, api, tmp_path) as started:
        yield started


@pytest.fixture
def cluster(api: ApiServerEmulator, tmp_path: pathlib.Path) -> Iterator[Cluster]:
    with running(Cluster, api, tmp_path) as started:
        yield started
