"""The contract between the workload channel and the thing that owns device state.

An adapter lives inside the workload process. The channel (``tslice.workload.channel``)
receives a snapshot or restore command from the node agent and calls the adapter on a
worker thread; the adapter moves its own memory (a PyTorch module, a vLLM or SGLang
engine, user callbacks) and says how many bytes it moved.

Methods may be plain functions or return an awaitable; the channel runs awaitables on
the event loop captured at ``register_workload`` time (or on a private loop).

Residency vocabulary, shared with the agent:

- ``capabilities().tags`` are the parts an adapter can move separately (``weights``,
  ``kv_cache``...). A command with no tags means "all of it".
- ``state().resident_tags`` are the declared tags currently on the device and
  ``state().suspended`` is true when anything is off the device. A partly restored
  workload (weights back, KV cache still off) is ``suspended=True`` with
  ``resident_tags=("weights",)``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import inspect
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeAlias

from tslice.common import residency


class SuspendMode(enum.IntEnum):
    """What a snapshot does with the state; values equal ``snapshot_agent.v1alpha1.SuspendMode``."""

    #: Copy the state to host memory; restore brings it back unchanged.
    OFFLOAD = 1
    #: Drop the state; the application re-provisions it (e.g. the next weight sync).
    DISCARD = 2

    @classmethod
    def parse(cls, value: str | int) -> SuspendMode:
        """Accept ``OFFLOAD``/``offload``/``SUSPEND_MODE_OFFLOAD``, an enum member or its int."""
        if isinstance(value, str):
            name = value.strip().upper().removeprefix("SUSPEND_MODE_")
            try:
                return cls[name]
            except KeyError:
                raise ValueError(
                    f"unknown suspend mode {value!r}; use 'offload' or 'discard'"
                ) from None
        try:
            return cls(int(value))
        except ValueError:
            raise ValueError(
                f"unknown suspend mode {value!r}; use 1 (offload) or 2 (discard)"
            ) from None

    @property
    def label(self) -> str:
        """Lower-case name, as llm-d's callbacks receive it (``"offload"``)."""
        return self.name.lower()


@dataclasses.dataclass(frozen=True)
class AdapterResult:
    """Bytes an operation moved, as measured by the adapter (0 = not measured)."""

    #: Device bytes freed (snapshot) or brought back (restore).
    device_bytes: int = 0
    #: Host bytes holding the workload's saved state after the operation.
    host_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What the adapter can do; sent to the agent at registration."""

    #: Modes the adapter accepts; empty = any (the agent then sends whatever it resolves).
    supported_modes: tuple[SuspendMode, ...] = ()
    #: Mode used when a request names none; ``None`` lets the agent pick OFFLOAD.
    default_mode: SuspendMode | None = None
    #: Parts that can be moved separately; empty = all-or-nothing.
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class AdapterState:
    """What the adapter holds on the device right now."""

    suspended: bool = False
    resident_tags: tuple[str, ...] = ()


#: What adapter methods may return: a result, nothing, or an awaitable of either.
Outcome: TypeAlias = "AdapterResult | Awaitable[AdapterResult | None] | None"


class WorkloadAdapter(abc.ABC):
    """Moves one workload's device state when the agent says so.

    Called from one worker thread, one command at a time, so an adapter needs no
    locking against itself. Raise any exception to report failure: the channel sends
    ``"<ExceptionType>: <message>"`` back to the agent and the operation fails.
    """

    #: Short name for logs (``torch``, ``vllm``, ``sglang``, ``callbacks``).
    name: ClassVar[str] = "custom"

    @abc.abstractmethod
    def snapshot(self, mode: SuspendMode, tags: Sequence[str]) -> Outcome:
        """Move the tagged state (all of it when ``tags`` is empty) off the device."""

    @abc.abstractmethod
    def restore(self, tags: Sequence[str]) -> Outcome:
        """Bring the tagged state (all of it when ``tags`` is empty) back onto the device."""

    def capabilities(self) -> Capabilities:
        """Declared modes and tags. Default: any mode, no tags."""
        return Capabilities()

    def state(self) -> AdapterState | None:
        """What is on the device now, or ``None`` to let the channel track it from commands."""
        return None


def normalize_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """Strip, drop duplicates and keep order; reject empty tag names."""
    if tags is None:
        return ()
    if isinstance(tags, str):
        tags = [tags]
    seen: dict[str, None] = {}
    for tag in tags:
        if not isinstance(tag, str) or not tag.strip():
            raise ValueError(f"tag {tag!r} is not a non-empty string")
        seen.setdefault(tag.strip(), None)
    return tuple(seen)


class ResidencyTracker(residency.ResidencyTracker):
    """Follows what is on the device from the commands that succeeded.

    For adapters that cannot ask their engine; the agent applies the same rules
    (``tslice.common.residency``), so both sides agree after a reconnect.
    """

    def state(self) -> AdapterState:
        return AdapterState(suspended=self.suspended, resident_tags=self.resident_tags)


def device_free_bytes() -> int | None:
    """Free CUDA memory on the current device, if torch is loaded and CUDA is in use.

    Engines such as vLLM allocate outside torch's caching allocator, so the only
    honest measure of what a sleep released is the driver's free-memory figure.
    """
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    except Exception:  # measurement must never fail a command
        return None


def finish_engine_call(
    outcome: object,
    *,
    before: int | None,
    snapshot: bool,
    tracker: ResidencyTracker,
    tags: Sequence[str],
) -> Outcome:
    """Complete an engine call that may be sync or async, then measure what it moved.

    ``before`` is :func:`device_free_bytes` read before the call; once the call has
    finished without raising, ``tracker`` records that ``tags`` moved.
    """
    done = tracker.snapshot_done if snapshot else tracker.restore_done
    if inspect.isawaitable(outcome):
        return _finish_async(
            outcome, before=before, snapshot=snapshot, on_success=lambda: done(tags)
        )
    done(tags)
    return _moved(before, snapshot=snapshot)


async def _finish_async(
    outcome: Awaitable[object],
    *,
    before: int | None,
    snapshot: bool,
    on_success: Callable[[], None],
) -> AdapterResult | None:
    await outcome
    on_success()
    return _moved(before, snapshot=snapshot)


def _moved(before: int | None, *, snapshot: bool) -> AdapterResult | None:
    after = device_free_bytes()
    if before is None or after is None:
        return None
    moved = after - before if snapshot else before - after
    return AdapterResult(device_bytes=max(moved, 0))


def overridden_capabilities(
    declared: Capabilities,
    supported_modes: Iterable[SuspendMode | str | int] | None,
    default_mode: SuspendMode | str | int | None,
    tags: Iterable[str] | None,
) -> Capabilities:
    """``declared`` with what ``register_workload`` was told instead (modes by name or
    number): a default the modes exclude is dropped, a single mode is the default."""
    modes = (
        tuple(dict.fromkeys(SuspendMode.parse(m) for m in supported_modes))
        if supported_modes is not None
        else declared.supported_modes
    )
    default = SuspendMode.parse(default_mode) if default_mode is not None else None
    # An adapter default that the overriding modes exclude would be refused by the agent.
    if (
        default is None
        and declared.default_mode is not None
        and (not modes or declared.default_mode in modes)
    ):
        default = declared.default_mode
    if default is None and len(modes) == 1:
        # The agent falls back to OFFLOAD, which a DISCARD-only workload would refuse.
        default = modes[0]
    if default is not None and modes and default not in modes:
        raise ValueError(
            f"default_mode {default.label!r} is not among supported_modes "
            f"{[m.label for m in modes]}"
        )
    return Capabilities(
        supported_modes=modes,
        default_mode=default,
        tags=normalize_tags(tags) if tags is not None else declared.tags,
    )
