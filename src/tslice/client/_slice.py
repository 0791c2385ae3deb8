"""``with client.slice(...)`` / ``@client.sliced(...)``: hold groups for a block.

A slice acquires the groups it does not hold yet together, all or nothing, when
there are two or more (AcquireSet), else (or from an orchestrator without it) one by
one in sorted order (see ``BaseClient._slice_groups``), and yields them in reverse
order on exit, also when the block raises. Slices nest: a
group already held by an open slice of the same client and job is not acquired
again, and only the outermost slice yields it. Each use of a slice object, and
each call of a function it decorates, is an independent entry.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import ParamSpec, Protocol, TypeVar

from tslice.client import _config, _types

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
