"""In-process vLLM engine adapter (``LLM``, ``AsyncLLMEngine``, ``AsyncLLM``).

vLLM's sleep mode does the moving: ``sleep(level=1)`` offloads the weights to host
memory and drops the KV cache, ``sleep(level=2)`` drops both, and ``wake_up(tags=...)``
brings back the named parts (``weights``, ``kv_cache``) or everything. That is what
makes staged restore work: wake the weights, run the weight sync, then wake the KV
cache once there is room.

vLLM cannot put only part of the engine to sleep, so a snapshot naming a subset of
the tags is refused instead of silently sleeping everything.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from tslice.workload.adapters import base

#: Parts vLLM's ``wake_up(tags=...)`` understands.
VLLM_TAGS: tuple[str, ...] = ("weights", "kv_cache")


def looks_like_vllm(obj: object) -> bool:
    """Duck typing: callable ``sleep`` and ``wake_up``."""
    return callable(getattr(obj, "sleep", None)) and callable(getattr(obj, "wake_up", None))


class VllmAdapter(base.WorkloadAdapter):
    """Drives a vLLM engine's sleep mode (the engine must be built with ``enable_sleep_mode``).

    OFFLOAD maps to ``sleep(level=1)`` and DISCARD to ``sleep(level=2)``; restore calls
    ``wake_up(tags=[...])``, or ``wake_up()`` when no tags are given. Async engines work:
    their coroutines run on the channel's event loop.
    """

    name = "vllm"

    def __init__(self, engine: Any, *, tags: Sequence[str] = VLLM_TAGS) -> None:
        if not looks_like_vllm(engine):
            raise TypeError(
                f"{type(engine).__name__} has no sleep()/wake_up(); is it a vLLM engine?"
            )
        self.engine = engine
        self._tags = base.normalize_tags(tags)
        self._residency = base.ResidencyTracker(
            declared=self._tags, suspended=self._engine_sleeping() is True
        )

    def capabilities(self) -> base.Capabilities:
        # No default mode: the agent resolves an unspecified request to OFFLOAD (level 1).
        return base.Capabilities(
            supported_modes=(base.SuspendMode.OFFLOAD, base.SuspendMode.DISCARD),
            tags=self._tags,
        )

    def state(self) -> base.AdapterState:
        # The engine's own answer wins where it gives one (sync engines only).
        sleeping = self._engine_sleeping()
        if sleeping is False:
            return base.AdapterState(suspended=False, resident_tags=self._tags)
        if sleeping is True and not self._residency.suspended:
            return base.AdapterState(suspended=True, resident_tags=())
        return self._residency.state()

    def snapshot(self, mode: base.SuspendMode, tags: Sequence[str]) -> base.Outcome:
        if tags and set(tags) < set(self._tags):
            raise ValueError(
                f"vLLM sleeps the whole engine; snapshot of only {sorted(tags)} is not possible "
                f"(send no tags, or all of {list(self._tags)})"
            )
        level = 2 if mode == base.SuspendMode.DISCARD else 1
        before = base.device_free_bytes()
        return base.finish_engine_call(
            self.engine.sleep(level=level),
            before=before,
            snapshot=True,
            tracker=self._residency,
            tags=tags,
        )

    def restore(self, tags: Sequence[str]) -> base.Outcome:
        before = base.device_free_bytes()
        outcome = self.engine.wake_up(tags=list(tags)) if tags else self.engine.wake_up()
        return base.finish_engine_call(
            outcome, before=before, snapshot=False, tracker=self._residency, tags=tags
        )

    def _engine_sleeping(self) -> bool | None:
        probe = getattr(self.engine, "is_sleeping", None)
        if not callable(probe):
            return None
        value = probe()
        if inspect.isawaitable(value):
            # Async engines answer with a coroutine; we cannot block on it here.
            close = getattr(value, "close", None)
            if callable(close):
                close()
            return None
        return bool(value)
