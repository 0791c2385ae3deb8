"""The CLI: help everywhere, one-line errors with the right exit codes, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli.support import run_cli
from tests.harness.ports import closed_port
from tslice.cli import main

COMMANDS = [
    "version",
    "up",
    "list",
    "status",
    "acquire",
    "yield",
    "clear-degraded",
    "demo",
    "agent",
    "orchestrator",
    "plan",
    "events",
]


def registered() -> set[str]:
    import typer.main

    return set(typer.main.get_command(main.app).commands)  # type: ignore[attr-defined]


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in registered():
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    assert command in registered(), f"`tslice {command}` is not registered"
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert "Usage" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tslice

    code, out, _ = run_cli(capsys, "version")
    assert code == 0
    assert out.strip() == f"tslice {tslice.__version__}"


def unreachable(port: int, within_s: float) -> str:
    return (
        f"error: orchestrator at 127.0.0.1:{port} is not reachable within {within_s:g} s "
        "(is `tslice up` running? --connect-timeout waits longer)"
    )


def test_unreachable_orchestrator_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_port()
    for args in (["status", "g"], ["list"], ["yield", "g", "job-1"], ["clear-degraded", "g"]):
        code, out, err = run_cli(capsys, *args, "--addr", f"127.0.0.1:{port}", "--timeout", "5")
        assert code == 1, (args, err)
        assert out == ""
        # The CLI's own short bound on the first connection, not the library's 5 s.
        assert err.strip().splitlines() == [unreachable(port, 1)]


def test_the_connect_bound_is_an_option_and_read_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = closed_port()
    address = f"127.0.0.1:{port}"
    code, _, err = run_cli(capsys, "status", "g", "--addr", address, "--connect-timeout", "0.3")
    assert code == 1 and err.strip() == unreachable(port, 0.3)
    code, _, err = run_cli(capsys, "acquire", "g", "j", "--addr", address, "--timeout", "0.2")
    assert code == 1 and err.strip() == unreachable(port, 0.2)
    monkeypatch.setenv("TSLICE_CONNECT_TIMEOUT_S", "0.4")
    code, _, err = run_cli(capsys, "list", "--addr", address)
    assert code == 1 and err.strip() == unreachable(port, 0.4)


@pytest.mark.parametrize("flag", ["--timeout", "--connect-timeout"])
def test_a_deadline_of_zero_seconds_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    code, out, err = run_cli(capsys, "status", "g", "--addr", "127.0.0.1:1", flag, "0")
    assert code == 2 and out == ""
    assert err.strip() == (
        f"error: Invalid value for '{flag}': must be more than 0 seconds (got 0) "
        "(see `tslice status --help`)"
    )


def test_address_comes_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = closed_port()
    monkeypatch.setenv("TSLICE_ORCHESTRATOR", f"127.0.0.1:{port}")
    code, _, err = run_cli(capsys, "status", "g")
    assert code == 1
    assert f"127.0.0.1:{port}" in err


def test_bad_ids_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "acquire", "bad group!", "job-1", "--addr", "127.0.0.1:1")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "group" in lines[0]


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "status", "--no-such-flag")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "--no-such-flag" in lines[0] and "tslice status --help" in lines[0]
    code, _, err = run_cli(capsys, "demo", "--jobs", "0")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_bad_demo_size_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "demo", "--capacity", "lots")
    assert code == 2
    assert (
        err.strip() == "error: --capacity 'lots' is not a size: use e.g. 80GiB, 60GB or a "
        "number of bytes"
    )


def test_python_dash_m_runs_the_cli_without_traceback() -> None:
    port = closed_port()
    proc = subprocess.run(
        [sys.executable, "-m", "tslice", "status", "g", "--addr", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [unreachable(port, 1)]


def test_demo_command_defaults_match_the_library() -> None:
    from tslice.cli import demo_cmd
    from tslice.demo import runner

    assert demo_cmd.DEFAULT_STEPS == runner.DEFAULT_STEPS == runner.DemoConfig().steps
    assert (
        demo_cmd.DEFAULT_TIME_SCALE == runner.DEFAULT_TIME_SCALE == runner.DemoConfig().time_scale
    )


def test_an_unknown_policy_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(
        capsys, "orchestrator", "--policy", "lottery", "--local-agent", "127.0.0.1:1"
    )
    assert code == 2
    assert (
        "unknown policy kind 'lottery'; use one of: fifo, priority, fair-share, cost-aware" in err
    )
