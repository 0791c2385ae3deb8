"""A server's heap is frozen now and then, so full collections scan only what is new, and
thawed now and then, so cycles that died frozen are freed (tslice/server/gc_pauses.py)."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Iterator

import pytest

from tslice.server import gc_pauses


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def heap() -> Iterator[None]:
    gc.collect()
    yield
    gc.unfreeze()


def test_a_tick_freezes_what_exists_and_full_collections_skip_it(heap: None) -> None:
    freezer = gc_pauses.HeapFreezer(every_s=10, thaw_every_s=100)
    cycle = Cycle()
    dead = weakref.ref(cycle)
    assert freezer.tick(0.0) is False
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(cycle)
    del cycle
    gc.collect()
    assert dead() is not None  # frozen: a full collection no longer looks at it
    young = Cycle()
    young_dead = weakref.ref(young)
    del young
    gc.collect()
    assert young_dead() is None  # made after the freeze: collected as ever


def test_a_thaw_frees_cycles_that_died_frozen(heap: None, caplog: pytest.LogCaptureFixture) -> None:
    freezer = gc_pauses.HeapFreezer(every_s=10, thaw_every_s=100)
    cycle = Cycle()
    dead = weakref.ref(cycle)
    freezer.tick(0.0)
    del cycle
    assert freezer.tick(50.0) is False  # not yet: frozen again
    gc.collect()
    assert dead() is not None
    with caplog.at_level(logging.INFO, logger=gc_pauses.__name__):
        assert freezer.tick(100.0) is True
    assert dead() is None
    assert "a full garbage collection took" in caplog.text
    assert gc.get_freeze_count() > 0  # and frozen again after the thaw


async def test_run_ticks_until_stopped(heap: None) -> None:
    freezer = gc_pauses.HeapFreezer(every_s=0.01, thaw_every_s=100)
    ticked = asyncio.Event()
    tick = freezer.tick

    def counting(now: float) -> bool:
        ticked.set()
        return tick(now)

    freezer.tick = counting  # type: ignore[method-assign]
    stop = asyncio.Event()
    running = asyncio.create_task(freezer.run(stop))
    await asyncio.wait_for(ticked.wait(), timeout=10)
    stop.set()
    await asyncio.wait_for(running, timeout=10)


#: CPython's own thresholds.
CPYTHON = (700, 10, 10)


@pytest.fixture
def thresholds() -> Iterator[tuple[int, ...]]:
    """CPython's thresholds for the test (a server run in this process earlier may have
    set a server's); the process's own put back afterwards."""
    own = gc.get_threshold()
    gc.set_threshold(*CPYTHON)
    yield CPYTHON
    gc.set_threshold(*own)


def test_the_environment_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, thresholds: tuple[int, ...]
) -> None:
    monkeypatch.setenv(gc_pauses.ENV, "off")
    assert gc_pauses.from_environment() is None
    assert gc.get_threshold() == thresholds  # CPython's, left alone
    monkeypatch.setenv(gc_pauses.ENV, "on")
    assert isinstance(gc_pauses.from_environment(), gc_pauses.HeapFreezer)
    monkeypatch.delenv(gc_pauses.ENV)
    assert isinstance(gc_pauses.from_environment(), gc_pauses.HeapFreezer)


def test_a_server_collects_its_young_objects_less_often(
    monkeypatch: pytest.MonkeyPatch, thresholds: tuple[int, ...]
) -> None:
    monkeypatch.delenv(gc_pauses.ENV, raising=False)
    gc_pauses.from_environment()
    assert gc.get_threshold() == gc_pauses.THRESHOLDS
    assert gc_pauses.THRESHOLDS[0] > thresholds[0]


def test_bad_periods_are_refused() -> None:
    with pytest.raises(ValueError, match="thaw_every_s >= every_s"):
        gc_pauses.HeapFreezer(every_s=10, thaw_every_s=1)
