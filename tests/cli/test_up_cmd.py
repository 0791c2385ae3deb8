"""`tslice up`: a whole local cluster in one command, stopped cleanly by Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tslice.client as tsclient
from tests.cli.support import run_cli


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_up(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """`tslice up ARGS` in its own process, and the table it printed once all serve."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tslice", "up",
            "--port", "0",
            "--state-dir", str(tmp_path / "up"),
            "--log-level", "warning",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:  # blocks until the table is printed: no sleeps
        printed.append(line)
        if "export TSLICE_ORCHESTRATOR=" in line:
            break
    return proc, "".join(printed)


def stop_up(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C; it must stop cleanly."""
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_up_serves_until_ctrl_c(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # On every interface, plaintext as asked (--insecure reaches every server it starts).
    proc, text = start_up(
        tmp_path, "--agents", "2", "--sim-restore-bandwidth", "5GB/s", "--host", "0.0.0.0",
        "--insecure",
    )  # fmt: skip
    try:
        match = re.search(r"export TSLICE_ORCHESTRATOR=(127\.0\.0\.1:\d+)", text)
        assert match, text
        address = match.group(1)
        for component in ("orchestrator", "node-1", "node-2"):
            assert component in text
        pids = [int(p) for p in re.findall(r"127\.0\.0\.1:\d+\s+(\d+)", text)]
        assert len(pids) == 3
        # The agents copy back onto the devices at the rate asked for.
        agent_args = [
            pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in pids
        ]
        restore = [
            args[args.index(b"--sim-restore-bandwidth") + 1]
            for args in agent_args
            if b"agent" in args
        ]
        assert restore == [b"5000000000", b"5000000000"], agent_args
        for args in agent_args:  # the orchestrator's and both agents'
            assert args[args.index(b"--host") + 1] == b"0.0.0.0" and b"--insecure" in args

        with tsclient.Client(address, job_id="job-1") as client:
            assert client.acquire("g", timeout=30).success
            status = client.status("g")
            assert status.locking_job == "job-1"
            assert sorted(status.nodes) == ["node-1", "node-2"]
            client.yield_("g")

        # The client commands against the live cluster.
        code, out, _ = run_cli(
            capsys, "acquire", "g", "job-2", "--addr", address, "--timeout", "30"
        )
        assert code == 0 and "job job-2 holds group g" in out
        assert "restored its state" not in out  # job-2 never ran before: nothing to restore
        code, out, _ = run_cli(capsys, "status", "g", "--addr", address)
        assert code == 0
        assert "LOCKED" in out and "job-2" in out and "node-1" in out and "node-2" in out
        code, out, _ = run_cli(capsys, "list", "--addr", address)
        assert code == 0 and "g" in out and "job-2" in out
        code, out, err = run_cli(capsys, "yield", "g", "job-1", "--addr", address)
        assert code == 1 and out == ""
        lines = err.strip().splitlines()
        # One line with the orchestrator's explanation (who holds it), no status jargon.
        assert len(lines) == 1 and lines[0].startswith("error: ") and "job-2" in lines[0]
        assert "permission_denied" not in lines[0]
        code, out, _ = run_cli(capsys, "yield", "g", "job-2", "--addr", address)
        assert code == 0 and "nobody waits" in out
        code, out, err = run_cli(capsys, "status", "nope", "--addr", address)
        assert code == 1 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "nope" in lines[0] and "tslice list" in lines[0]

        stop_up(proc)
        assert not any(pid_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_refuses_a_malformed_rate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "up", "--sim-restore-bandwidth", "fast")
    assert code == 2 and out == ""
    assert "--sim-restore-bandwidth 'fast' is not a rate" in err and "Traceback" not in err


def test_up_on_a_non_loopback_host_needs_insecure(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any process starts, in one line naming the flag `up` has."""
    code, out, err = run_cli(capsys, "up", "--host", "0.0.0.0", "--agents", "1")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "0.0.0.0 without TLS" in lines[0] and "give --insecure" in lines[0], lines[0]
