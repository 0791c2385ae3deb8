"""Retry decisions (pure: fake clock and random source, no sockets)."""

from __future__ import annotations

import grpc
import pytest

from tslice.client import _channel, _retry
from tslice.common import errors


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "details") -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def attempts(
    *,
    timeout: float | None = None,
    retryable: bool = True,
    policy: _retry.RetryPolicy = _retry.DEFAULT_RETRY,
    clock: Clock | None = None,
    rand: float = 0.0,
) -> _retry.Attempts:
    return _retry.Attempts(
        method="Acquire",
        target="127.0.0.1:1",
        retryable=retryable,
        policy=policy,
        timeout=timeout,
        group_id="g",
        clock=clock or Clock(),
        rand=lambda: rand,
    )


def fail(plan: _retry.Attempts, code: grpc.StatusCode, details: str = "details") -> float | None:
    try:
        raise FakeRpcError(code, details)
    except FakeRpcError as err:
        return plan.after_error(err)


def test_delays_grow_to_the_cap_without_jitter() -> None:
    policy = _retry.RetryPolicy(initial_backoff_s=0.05, max_backoff_s=2.0, jitter=0.0)
    delays = [policy.delay(n, rand=0.5) for n in range(1, 9)]
    assert delays == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])


def test_jitter_only_shortens_the_delay() -> None:
    policy = _retry.RetryPolicy(jitter=0.5)
    assert policy.delay(1, rand=0.0) == pytest.approx(0.05)
    assert policy.delay(1, rand=0.999) == pytest.approx(0.025, rel=0.01)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"initial_backoff_s": 0}, "initial_backoff_s"),
        ({"initial_backoff_s": 1, "max_backoff_s": 0.5}, "max_backoff_s"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"jitter": 2}, "jitter"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_policy_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _retry.RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_unavailable_is_retried_without_deadline_forever() -> None:
    plan = attempts()
    for n in range(1, 50):
        delay = fail(plan, grpc.StatusCode.UNAVAILABLE)
        assert delay is not None and delay > 0
        assert plan.failures == n


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ],
)
def test_other_codes_are_never_retried(code: grpc.StatusCode) -> None:
    """DEADLINE_EXCEEDED above all: llm-d retried it, which breeds ghost holders."""
    with pytest.raises(errors.RPCError) as caught:
        fail(attempts(), code)
    assert caught.value.status == code
    assert isinstance(caught.value.__cause__, FakeRpcError)


def test_deadline_exceeded_names_the_call_and_the_deadline() -> None:
    expected = r"Acquire to 127\.0\.0\.1:1 did not finish within 2\.5 s"
    with pytest.raises(errors.DeadlineExceeded, match=expected):
        fail(attempts(timeout=2.5), grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def test_non_retryable_methods_fail_on_the_first_unavailable() -> None:
    with pytest.raises(errors.Unavailable, match="details"):
        fail(attempts(retryable=False), grpc.StatusCode.UNAVAILABLE)


def test_deadline_stops_retries_and_says_so() -> None:
    clock = Clock()
    plan = attempts(timeout=1.0, clock=clock)
    assert plan.attempt_timeout() == pytest.approx(1.0)
    fail(plan, grpc.StatusCode.UNAVAILABLE, "connection refused")
    clock.now += 0.99
    assert plan.attempt_timeout() == pytest.approx(0.01)
    with pytest.raises(errors.Unavailable, match=r"connection refused \(gave up on Acquire"):
        fail(plan, grpc.StatusCode.UNAVAILABLE, "connection refused")


def test_max_attempts_counts_the_first_attempt() -> None:
    plan = attempts(policy=_retry.RetryPolicy(max_attempts=3))
    fail(plan, grpc.StatusCode.UNAVAILABLE)
    fail(plan, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(errors.Unavailable, match="after 3 attempts"):
        fail(plan, grpc.StatusCode.UNAVAILABLE)


def test_settled_codes_count_only_after_a_retry() -> None:
    settled = frozenset({grpc.StatusCode.PERMISSION_DENIED})
    first = _retry.Attempts(
        method="Yield",
        target="t",
        retryable=True,
        policy=_retry.DEFAULT_RETRY,
        timeout=None,
        settled_codes=settled,
    )
    with pytest.raises(errors.NotHolder):
        fail(first, grpc.StatusCode.PERMISSION_DENIED)
    retried = _retry.Attempts(
        method="Yield",
        target="t",
        retryable=True,
        policy=_retry.DEFAULT_RETRY,
        timeout=None,
        settled_codes=settled,
    )
    assert fail(retried, grpc.StatusCode.UNAVAILABLE) is not None
    assert fail(retried, grpc.StatusCode.PERMISSION_DENIED) is None


def test_not_found_on_a_group_becomes_unknown_group() -> None:
    with pytest.raises(errors.UnknownGroup):
        fail(attempts(), grpc.StatusCode.NOT_FOUND, "unknown group 'g'")


def test_channel_options_put_the_callers_values_last_and_drop_our_duplicates() -> None:
    merged = _channel.channel_options([("grpc.keepalive_time_ms", 5), ("x.custom", 1)])
    keys = [key for key, _ in merged]
    assert keys.count("grpc.keepalive_time_ms") == 1
    assert ("grpc.keepalive_time_ms", 5) in merged and ("x.custom", 1) in merged
    assert ("grpc.max_reconnect_backoff_ms", 2_000) in merged
    assert _channel.channel_options(None) == list(_channel.DEFAULT_CHANNEL_OPTIONS)
