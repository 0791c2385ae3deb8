"""Retry decisions for one logical call, free of I/O so sync and async share them.

Only UNAVAILABLE is retried, and only for methods that are safe to re-issue: the
connection was refused or reset, or the server is shutting down. The orchestrator
keeps a re-issued Acquire's queue position (or recognises the holder), so
re-issuing Acquire across an orchestrator restart is safe. DEADLINE_EXCEEDED is
never retried: llm-d's client did, and a retried Acquire whose first attempt was
still queued is how ghost holders are born.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable

import grpc

from tslice.common import errors

log = logging.getLogger("tslice.client")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Back-off for re-issuing a call after UNAVAILABLE.

    Retries stop at the call's deadline; with no deadline (the default for
    ``acquire``) they go on until the orchestrator answers.
    """

    #: Delay before the first retry, in seconds.
    initial_backoff_s: float = 0.05
    #: Cap on the delay between two attempts, in seconds.
    max_backoff_s: float = 2.0
    #: Growth of the delay after each failed attempt.
    multiplier: float = 2.0
    #: Each delay is drawn uniformly from ``[delay * (1 - jitter), delay]`` so that many
    #: clients cut off by the same restart do not reconnect in lockstep.
    jitter: float = 0.5
    #: Attempts in total, the first included; ``None`` = until the deadline.
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if self.initial_backoff_s <= 0:
            raise ValueError("RetryPolicy.initial_backoff_s must be > 0 seconds")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("RetryPolicy.max_backoff_s must be >= initial_backoff_s")
        if self.multiplier < 1:
            raise ValueError("RetryPolicy.multiplier must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("RetryPolicy.jitter must be between 0 and 1")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be >= 1 (1 = no retry) or None")

    def delay(self, retry_number: int, *, rand: float) -> float:
        """Seconds to wait before retry number ``retry_number`` (1-based); ``rand`` in [0, 1)."""
        base = min(
            self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry_number - 1)
        )
        return base * (1.0 - self.jitter * rand)


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)


@dataclasses.dataclass(kw_only=True)
class Attempts:
    """Deadline and retry bookkeeping for one logical call (one or more attempts)."""

    method: str
    target: str
    #: Safe to re-issue after UNAVAILABLE.
    retryable: bool
    policy: RetryPolicy
    #: Deadline of the whole call, retries included, in seconds (``None`` = none).
    timeout: float | None
    #: Codes that, answering a re-issued attempt, mean an earlier one took effect.
    settled_codes: frozenset[grpc.StatusCode] = frozenset()
    #: Lets NOT_FOUND become :class:`~tslice.common.errors.UnknownGroup`.
    group_id: str | None = None
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random
    #: When the call began (``clock()`` time; None: now): its first attempt may have
    #: gone out before this bookkeeping was needed.
    since: float | None = None
    started: float = dataclasses.field(init=False)
    deadline: float | None = dataclasses.field(init=False)
    failures: int = dataclasses.field(init=False, default=0)
    #: The answer that settled the call (see ``settled_codes``), once one did.
    settled: errors.RPCError | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.started = self.clock() if self.since is None else self.since
        self.deadline = None if self.timeout is None else self.started + self.timeout

    def elapsed_ms(self) -> int:
        return int((self.clock() - self.started) * 1000)

    def attempt_timeout(self) -> float | None:
        """Time left for the next attempt (``None`` = no deadline)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self.clock())

    def after_error(self, err: grpc.RpcError) -> float | None:
        """Seconds to wait before the next attempt, ``None`` when the answer says an
        earlier attempt took effect (see ``settled_codes``; the answer is then
        :attr:`settled`, for the caller to confirm), or raise the mapped error.

        Must be called inside the ``except`` block that caught ``err`` so that the
        raised error chains to it.
        """
        mapped = errors.from_grpc(err, group_id=self.group_id)
        if self.failures and mapped.status in self.settled_codes:
            log.info(
                "%s to %s answered %s after a retry: the earlier attempt took effect",
                self.method,
                self.target,
                mapped,
                extra={"method": self.method, "target": self.target},
            )
            self.settled = mapped
            return None
        if mapped.status == grpc.StatusCode.DEADLINE_EXCEEDED and self.deadline is not None:
            raise errors.DeadlineExceeded(
                mapped.status,
                f"{mapped.message}: {self.method} to {self.target} did not finish within "
                f"{self.deadline - self.started:.3g} s",
            ) from err
        if mapped.status != grpc.StatusCode.UNAVAILABLE or not self.retryable:
            raise mapped from err
        self.failures += 1
        attempts_left = self.policy.max_attempts is None or self.failures < self.policy.max_attempts
        delay = self.policy.delay(self.failures, rand=self.rand())
        out_of_time = self.deadline is not None and self.clock() + delay >= self.deadline
        if not attempts_left or out_of_time:
            if self.failures == 1:
                raise mapped from err
            raise errors.Unavailable(
                grpc.StatusCode.UNAVAILABLE,
                f"{mapped.message} (gave up on {self.method} to {self.target} after "
                f"{self.failures} attempts over {self.elapsed_ms() / 1000:.1f} s)",
            ) from err
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(
            level,
            "%s to %s failed (%s); retrying in %.2f s",
            self.method,
            self.target,
            mapped,
            delay,
            extra={"method": self.method, "target": self.target, "attempt": self.failures},
        )
        return delay

    def succeeded(self) -> None:
        if self.failures:
            log.info(
                "%s to %s succeeded after %d failed attempts",
                self.method,
                self.target,
                self.failures,
                extra={"method": self.method, "target": self.target},
            )
