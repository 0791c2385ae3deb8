"""In-process SGLang engine adapter (``sglang.Engine`` built with ``enable_memory_saver``).

SGLang moves its own memory: ``release_memory_occupation(tags=...)`` frees the named
parts (``kv_cache``, ``weights``, ``cuda_graph``; all when no tags) and
``resume_memory_occupation(tags=...)`` brings them back. Whether released weights are
kept in host memory (OFFLOAD) or dropped (DISCARD) is fixed when the engine starts
(``enable_weights_cpu_backup``), so the adapter declares exactly that one mode and
the agent refuses the other before sending anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tslice.workload.adapters import base

#: Parts SGLang's memory saver can release separately.
SGLANG_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")


def looks_like_sglang(obj: object) -> bool:
    """Duck typing: callable ``release_memory_occupation`` and ``resume_memory_occupation``."""
    return callable(getattr(obj, "release_memory_occupation", None)) and callable(
        getattr(obj, "resume_memory_occupation", None)
    )


class SglangAdapter(base.WorkloadAdapter):
    """Drives SGLang's release/resume of memory occupation, with tags passed through.

    ``mode`` is the mode the engine was started for: OFFLOAD when it keeps a CPU copy
    of the weights (``enable_weights_cpu_backup``), DISCARD when the weights come back
    by weight sync.
    """

    name = "sglang"

    def __init__(
        self,
        engine: Any,
        *,
        mode: base.SuspendMode | str | int = base.SuspendMode.OFFLOAD,
        tags: Sequence[str] = SGLANG_TAGS,
    ) -> None:
        if not looks_like_sglang(engine):
            raise TypeError(
                f"{type(engine).__name__} has no release_memory_occupation()/"
                "resume_memory_occupation(); is it an SGLang engine?"
            )
        self.engine = engine
        self.mode = base.SuspendMode.parse(mode)
        self._tags = base.normalize_tags(tags)
        self._residency = base.ResidencyTracker(declared=self._tags)

    def capabilities(self) -> base.Capabilities:
        return base.Capabilities(
            supported_modes=(self.mode,), default_mode=self.mode, tags=self._tags
        )

    def state(self) -> base.AdapterState:
        return self._residency.state()

    def snapshot(self, mode: base.SuspendMode, tags: Sequence[str]) -> base.Outcome:
        if mode != self.mode:
            # The agent refuses this before sending; a direct caller gets the same answer.
            raise ValueError(
                f"this SGLang engine was started for {self.mode.label}; "
                f"{mode.label} is not possible"
            )
        before = base.device_free_bytes()
        outcome = self.engine.release_memory_occupation(tags=list(tags) or None)
        return base.finish_engine_call(
            outcome, before=before, snapshot=True, tracker=self._residency, tags=tags
        )

    def restore(self, tags: Sequence[str]) -> base.Outcome:
        before = base.device_free_bytes()
        outcome = self.engine.resume_memory_occupation(tags=list(tags) or None)
        return base.finish_engine_call(
            outcome, before=before, snapshot=False, tracker=self._residency, tags=tags
        )
