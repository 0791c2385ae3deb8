"""Adapters around user code: a pair of callbacks, or any object with snapshot/restore.

Both follow llm-d's calling convention so existing integrations work unchanged:
``on_snapshot(mode_name, tags)`` receives the lower-case mode name (``"offload"`` /
``"discard"``) and ``on_restore(tags)`` the list of tags. Either may return ``None``,
an :class:`~tslice.workload.adapters.base.AdapterResult`, a mapping with
``device_bytes``/``host_bytes``, or an awaitable of one of those.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from tslice.workload.adapters import base

SnapshotCallback = Callable[[str, list[str]], Any]
RestoreCallback = Callable[[list[str]], Any]


def coerce_result(value: object) -> base.AdapterResult | None:
    """Turn what user code returned into an AdapterResult (``None`` = nothing measured)."""
    if value is None or isinstance(value, base.AdapterResult):
        return value
    if isinstance(value, Mapping):
        return base.AdapterResult(
            device_bytes=int(value.get("device_bytes", 0) or 0),
            host_bytes=int(value.get("host_bytes", 0) or 0),
        )
    # Callbacks written for llm-d return whatever they like (True, a dict of stats...).
    return None


def _coerce(value: object) -> base.Outcome:
    if inspect.isawaitable(value):
        return _await_and_coerce(value)
    return coerce_result(value)


async def _await_and_coerce(awaitable: Awaitable[object]) -> base.AdapterResult | None:
    return coerce_result(await awaitable)


class CallbackAdapter(base.WorkloadAdapter):
    """Calls ``on_snapshot(mode_name, tags)`` and ``on_restore(tags)``."""

    name = "callbacks"

    def __init__(
        self,
        *,
        on_snapshot: SnapshotCallback,
        on_restore: RestoreCallback,
        capabilities: base.Capabilities | None = None,
    ) -> None:
        if not callable(on_snapshot) or not callable(on_restore):
            raise TypeError("on_snapshot and on_restore must both be callables")
        self._on_snapshot = on_snapshot
        self._on_restore = on_restore
        self._capabilities = capabilities or base.Capabilities()

    def snapshot(self, mode: base.SuspendMode, tags: Sequence[str]) -> base.Outcome:
        return _coerce(self._on_snapshot(mode.label, list(tags)))

    def restore(self, tags: Sequence[str]) -> base.Outcome:
        return _coerce(self._on_restore(list(tags)))

    def capabilities(self) -> base.Capabilities:
        return self._capabilities


class SnapshottableAdapter(base.WorkloadAdapter):
    """Any object with ``snapshot(mode_name, tags)`` and ``restore(tags)`` methods.

    Optional attributes ``supported_modes`` (names), ``default_mode`` (name) and
    ``tags`` declare capabilities; optional ``state()`` returning a
    :class:`~tslice.workload.adapters.base.AdapterState` reports residency.
    """

    name = "object"

    def __init__(self, obj: Any) -> None:
        if not (
            callable(getattr(obj, "snapshot", None)) and callable(getattr(obj, "restore", None))
        ):
            raise TypeError(f"{type(obj).__name__} has no callable snapshot() and restore()")
        self._obj = obj

    def snapshot(self, mode: base.SuspendMode, tags: Sequence[str]) -> base.Outcome:
        return _coerce(self._obj.snapshot(mode.label, list(tags)))

    def restore(self, tags: Sequence[str]) -> base.Outcome:
        return _coerce(self._obj.restore(list(tags)))

    def capabilities(self) -> base.Capabilities:
        modes = getattr(self._obj, "supported_modes", None) or ()
        default = getattr(self._obj, "default_mode", None)
        return base.Capabilities(
            supported_modes=tuple(base.SuspendMode.parse(m) for m in modes),
            default_mode=base.SuspendMode.parse(default) if default else None,
            tags=base.normalize_tags(getattr(self._obj, "tags", None)),
        )

    def state(self) -> base.AdapterState | None:
        reader = getattr(self._obj, "state", None)
        if callable(reader):
            value = reader()
            if isinstance(value, base.AdapterState):
                return value
        return None
