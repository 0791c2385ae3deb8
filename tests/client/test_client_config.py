"""Configuration from arguments and environment, and the no-op mode."""

from __future__ import annotations

import logging

import pytest

import tslice
from tslice.client import _config
from tslice.common import errors


def test_no_address_means_noop_mode_and_calls_succeed_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with tslice.Client() as client:
        assert not client.enabled
        assert client.acquire("trainer") == tslice.AcquireResult(
            success=True, waited_ms=0, context_restored=False, grant_epoch=0
        )
        result = client.yield_("trainer")
        assert result.success and result.pending_waiters == 0
        with client.slice("sampler", "trainer") as held:
            assert set(held) == {"sampler", "trainer"}
            assert all(r.success for r in held.values())

        @client.sliced("trainer")
        def step(x: int) -> int:
            return x + 1

        assert step(1) == 2
    stderr = capsys.readouterr().err
    assert "time-slicing is off" in stderr
    assert "TSLICE_ORCHESTRATOR" in stderr


async def test_async_noop_mode() -> None:
    async with tslice.AsyncClient() as client:
        assert not client.enabled
        assert (await client.acquire("g")).success
        assert (await client.release("g")).success
        async with client.slice("g") as held:
            assert held["g"].waited_ms == 0


def test_noop_mode_is_said_on_stderr_once_per_process_at_the_first_acquire(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    first, second = tslice.Client(), tslice.Client()
    assert capsys.readouterr().err == ""  # nothing yet: building a client is not using it
    first.acquire("g")
    with second.slice("g"):
        pass
    first.acquire("g")
    stderr = capsys.readouterr().err
    assert stderr.count("time-slicing is off") == 1, stderr
    assert stderr.startswith("tslice: time-slicing is off: no orchestrator configured")
    assert "set $TSLICE_ORCHESTRATOR" in stderr and "TSLICE_DISABLED=1" in stderr
    assert "time-slicing is off" not in caplog.text  # said once, on stderr only


async def test_a_slice_is_the_first_use_too(capsys: pytest.CaptureFixture[str]) -> None:
    async with tslice.AsyncClient() as client:
        assert capsys.readouterr().err == ""
        async with client.slice("g"):
            pass
    assert "time-slicing is off" in capsys.readouterr().err


def test_disabled_env_forces_noop_even_with_an_address(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TSLICE_DISABLED", "1")
    client = tslice.Client("127.0.0.1:1", job_id="j")
    assert not client.enabled
    assert "TSLICE_DISABLED" in client.config.noop_reason
    # Nothing listens on port 1: success proves no RPC was attempted.
    assert client.acquire("g").success
    with client.slice("g"):
        pass
    # Off on purpose: nothing to announce.
    assert capsys.readouterr().err == ""


def test_disabled_env_rejects_unclear_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TSLICE_DISABLED", "maybe")
    with pytest.raises(errors.ConfigError, match="TSLICE_DISABLED"):
        tslice.Client()


def test_noop_mode_refuses_status_with_the_reason() -> None:
    client = tslice.Client()
    with pytest.raises(errors.ConfigError, match="no-op mode: no orchestrator configured"):
        client.status("g")
    with pytest.raises(errors.ConfigError, match="no-op mode"):
        client.list_groups()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TSLICE_ORCHESTRATOR": "a:1"}, "a:1"),
        ({"TIMESLICE_ORCH_ADDR": "b:2"}, "b:2"),
        ({"TSLICE_ORCHESTRATOR": "a:1", "TIMESLICE_ORCH_ADDR": "b:2"}, "a:1"),
        ({"TSLICE_ORCHESTRATOR": "  ", "TIMESLICE_ORCH_ADDR": "b:2"}, "b:2"),
    ],
    ids=["tslice", "llm-d", "tslice-wins", "blank-ignored"],
)
def test_address_from_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    client = tslice.Client(job_id="j")
    assert client.enabled and client.address == expected


def test_argument_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TSLICE_ORCHESTRATOR", "env:1")
    monkeypatch.setenv("TSLICE_JOB_ID", "env-job")
    monkeypatch.setenv("TSLICE_GROUP", "env-group")
    client = tslice.Client("arg:1", job_id="arg-job", default_group="arg-group")
    assert (client.address, client.job_id, client.default_group) == (
        "arg:1",
        "arg-job",
        "arg-group",
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TSLICE_JOB_ID": "one"}, "one"),
        ({"TIMESLICE_JOB_ID": "two"}, "two"),
        ({"TSLICE_JOB_ID": "one", "TIMESLICE_JOB_ID": "two"}, "one"),
        # Inside a Slurm job: its id, unless the job set a name (its tasks then act as one).
        ({"SLURM_JOB_ID": "4242"}, "4242"),
        ({"SLURM_JOB_ID": "4242", "TSLICE_JOB_ID": "grpo-7"}, "grpo-7"),
    ],
)
def test_job_id_from_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tslice.Client("x:1").job_id == expected


def test_missing_job_id_in_active_mode_fails_at_construction() -> None:
    for make in (tslice.Client, tslice.AsyncClient):
        with pytest.raises(
            errors.ConfigError, match=r"job id is required: pass job_id=.*TSLICE_JOB_ID"
        ):
            make("127.0.0.1:1")


def test_job_id_none_means_each_call_names_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    client = tslice.Client("127.0.0.1:1", job_id=None)
    assert client.job_id is None
    with pytest.raises(errors.ConfigError, match=r"job_id=None, so pass job_id= to the call"):
        client.acquire("g")
    with pytest.raises(errors.ConfigError, match="job id is required"):
        client.slice("g")
    monkeypatch.setenv("TSLICE_JOB_ID", "from-env")
    assert tslice.Client("127.0.0.1:1", job_id=None).job_id == "from-env"


def test_no_job_id_is_fine_in_noop_mode() -> None:
    assert tslice.Client().acquire("g").success


def test_missing_group_in_active_mode_is_a_clear_error() -> None:
    client = tslice.Client("127.0.0.1:1", job_id="j")
    with pytest.raises(errors.ConfigError, match=r"group is required.*TSLICE_GROUP"):
        client.acquire()


def test_malformed_ids_are_rejected_before_any_rpc(monkeypatch: pytest.MonkeyPatch) -> None:
    client = tslice.Client("127.0.0.1:1", job_id="j")
    with pytest.raises(errors.InvalidArgument, match="group_id 'bad group' is malformed"):
        client.acquire("bad group")
    with pytest.raises(errors.InvalidArgument, match="job_id is required"):
        client.acquire("g", job_id="")
    monkeypatch.setenv("TSLICE_JOB_ID", "no spaces please")
    with pytest.raises(errors.InvalidArgument, match=r"from \$TSLICE_JOB_ID"):
        tslice.Client("127.0.0.1:1")


def test_malformed_ids_are_rejected_in_noop_mode_too() -> None:
    with pytest.raises(errors.InvalidArgument):
        tslice.Client().acquire("white space")


@pytest.mark.parametrize(
    "kwargs",
    [{"timeout": 0}, {"timeout": -1}, {"call_timeout": 0}, {"footprint_bytes": -1}],
)
def test_bad_numbers_are_value_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        tslice.Client("x:1", job_id="j", **kwargs)  # type: ignore[arg-type]


def test_empty_address_argument_is_an_error() -> None:
    with pytest.raises(errors.ConfigError, match="address is empty"):
        tslice.Client(" ")


def test_resolve_reads_only_the_given_environment() -> None:
    config = _config.resolve(
        address=None,
        job_id=None,
        default_group=None,
        timeout=None,
        call_timeout=5.0,
        footprint_bytes=None,
        retry=tslice.RetryPolicy(),
        channel_options=None,
        environ={"TIMESLICE_ORCH_ADDR": "h:9", "TIMESLICE_JOB_ID": "j"},
    )
    assert config.enabled and config.address == "h:9" and config.job_id == "j"
    assert config.footprint_bytes == 0 and config.call_timeout == 5.0
