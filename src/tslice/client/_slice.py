"""``with client.slice(...)`` / ``@client.sliced(...)``: hold groups for a block.

A slice acquires the groups it does not hold yet together, all or nothing, when
there are two or more (AcquireSet), else (or from an orchestrator without it) one by
one in sorted order (see ``BaseClient._slice_groups``), and yields them in reverse
order on exit, also when the block raises. Slices nest: a
group already held by an open slice of the same client and job is not acquired
again, and only the outermost slice yields it (:class:`Holds` counts them). Each use
of a slice object, and each call of a function it decorates, is an independent entry.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import MappingProxyType
from typing import ParamSpec, Protocol, TypeVar

import grpc

from tslice.client import _config, _types
from tslice.common import errors

log = logging.getLogger("tslice.client")

P = ParamSpec("P")
R = TypeVar("R")


class _SyncOwner(Protocol):
    def _enter_slice(
        self, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> dict[str, _types.AcquireResult]: ...

    def _exit_slice(self, groups: tuple[str, ...], job: str, *, raise_errors: bool) -> None: ...


class _AsyncOwner(Protocol):
    async def _enter_slice(
        self, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> dict[str, _types.AcquireResult]: ...

    async def _exit_slice(
        self, groups: tuple[str, ...], job: str, *, raise_errors: bool
    ) -> None: ...


class _SliceSpec:
    def __init__(self, *, groups: tuple[str, ...], job: str, timeout: _config.Timeout) -> None:
        self.groups = groups
        self.job = job
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(groups={self.groups!r}, job={self.job!r})"


class SliceContext(_SliceSpec):
    """Holds ``groups`` for the duration of a ``with`` block or a decorated call.

    ``__enter__`` returns a read-only mapping group → :class:`AcquireResult`.
    """

    def __init__(
        self, owner: _SyncOwner, *, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> None:
        super().__init__(groups=groups, job=job, timeout=timeout)
        self._owner = owner

    def __enter__(self) -> Mapping[str, _types.AcquireResult]:
        results = self._owner._enter_slice(self.groups, self.job, self.timeout)
        return MappingProxyType(results)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # A failure to yield must not hide the exception that ended the block.
        self._owner._exit_slice(self.groups, self.job, raise_errors=exc is None)

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(func):
            raise TypeError(
                f"{func.__qualname__} is a coroutine function; decorate it with "
                "AsyncClient.sliced(...) instead"
            )

        @functools.wraps(func)
        def sliced(*args: P.args, **kwargs: P.kwargs) -> R:
            with SliceContext(self._owner, groups=self.groups, job=self.job, timeout=self.timeout):
                return func(*args, **kwargs)

        return sliced


class AsyncSliceContext(_SliceSpec):
    """Async twin of :class:`SliceContext` (``async with`` / decorated coroutine)."""

    def __init__(
        self, owner: _AsyncOwner, *, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> None:
        super().__init__(groups=groups, job=job, timeout=timeout)
        self._owner = owner

    async def __aenter__(self) -> Mapping[str, _types.AcquireResult]:
        results = await self._owner._enter_slice(self.groups, self.job, self.timeout)
        return MappingProxyType(results)

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        await self._owner._exit_slice(self.groups, self.job, raise_errors=exc is None)

    def __call__(self, func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"{getattr(func, '__qualname__', func)!s} is not a coroutine function; "
                "decorate it with Client.sliced(...) instead"
            )

        @functools.wraps(func)
        async def sliced(*args: P.args, **kwargs: P.kwargs) -> R:
            async with AsyncSliceContext(
                self._owner, groups=self.groups, job=self.job, timeout=self.timeout
            ):
                return await func(*args, **kwargs)

        return sliced


class SliceClock:
    """The deadline that bounds acquiring all the groups of one slice together."""

    def __init__(self, timeout: float | None) -> None:
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout

    def remaining(self, *, job: str, group: str) -> float | None:
        """Time left for the acquire of ``group``; AcquireTimeout once none is left."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise errors.AcquireTimeout(
                job_id=job,
                group_id=group,
                waited_ms=int((time.monotonic() - self.started) * 1000),
            )
        return left


HoldKey = tuple[str, str]


class Holds:
    """How many open slices of a client hold each (job, group), and the grant they
    share (no I/O; the clients serialise each key's transitions with a lock of their
    own). Only ``slice()`` uses it: ``acquire()``/``yield_()`` are raw."""

    def __init__(self) -> None:
        self._counts: dict[HoldKey, int] = {}
        self._results: dict[HoldKey, _types.AcquireResult] = {}
        #: False once the orchestrator answered UNIMPLEMENTED to an AcquireSet: a slice
        #: then takes its groups one by one (sorted) without asking again.
        self.sets_supported = True

    def held(self, key: HoldKey) -> _types.AcquireResult | None:
        """The grant an open slice already holds for ``key``; counts one more holder."""
        if self._counts.get(key, 0) == 0:
            return None
        self._counts[key] += 1
        return self._results[key]

    def record(self, key: HoldKey, result: _types.AcquireResult) -> None:
        if not result.success:
            raise errors.RPCError(
                grpc.StatusCode.UNKNOWN,
                f"the orchestrator answered Acquire({key[0]!r}, {key[1]!r}) with success=false",
            )
        self._counts[key] = 1
        self._results[key] = result

    def wants_set(self, groups: tuple[str, ...]) -> bool:
        """Whether a slice asks for its groups in one AcquireSet (when 2+ are not held)."""
        return self.sets_supported and len(groups) >= 2

    def join(
        self, groups: Iterable[str], job: str, results: dict[str, _types.AcquireResult]
    ) -> tuple[str, ...]:
        """Count one more holder of each group an open slice holds (into ``results``);
        return the others."""
        wanted = []
        for group in groups:
            held = self.held((job, group))
            if held is None:
                wanted.append(group)
            else:
                results[group] = held
        return tuple(wanted)

    def record_set(
        self,
        job: str,
        granted: dict[str, _types.AcquireResult],
        results: dict[str, _types.AcquireResult],
    ) -> None:
        for group, result in granted.items():
            self.record((job, group), result)
            results[group] = result

    @staticmethod
    def set_refused(err: errors.RPCError) -> bool:
        """An AcquireSet of a slice failed with ``err``: True when the orchestrator has
        none (take the groups one by one), False to raise ``err``."""
        return err.status == grpc.StatusCode.UNIMPLEMENTED

    def drop(self, key: HoldKey) -> bool:
        """Count one holder less; True when it was the last (time to yield)."""
        count = self._counts.get(key, 0) - 1
        if count > 0:
            self._counts[key] = count
            return False
        self._counts.pop(key, None)
        self._results.pop(key, None)
        return True


def released(failures: list[tuple[str, BaseException]], job: str, *, raise_errors: bool) -> None:
    """After a slice yielded its groups: raise the first failure (when the block did not
    raise already), log the others."""
    if failures and raise_errors:
        _report_release_failures(failures[1:], job)
        raise failures[0][1]
    _report_release_failures(failures, job)


def _report_release_failures(failures: list[tuple[str, BaseException]], job: str) -> None:
    for group, failure in failures:
        log.warning(
            "could not yield group %s for job %s: %s",
            group,
            job,
            failure,
            extra={"job_id": job, "group_id": group},
        )
