"""`tslice up`: a whole local cluster in one command, stopped cleanly by Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import tslice.client as tsclient


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_until_ctrl_c(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tslice",
            "up",
            "--port",
            "0",
            "--agents",
            "2",
            "--state-dir",
            str(tmp_path / "up"),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        assert proc.stdout is not None
        printed = []
        for line in proc.stdout:  # blocks until the table is printed: no sleeps
            printed.append(line)
            if "export TSLICE_ORCHESTRATOR=" in line:
                break
        text = "".join(printed)
        match = re.search(r"export TSLICE_ORCHESTRATOR=(127\.0\.0\.1:\d+)", text)
        assert match, text
        address = match.group(1)
        for component in ("orchestrator", "node-1", "node-2"):
            assert component in text
        pids = [int(p) for p in re.findall(r"127\.0\.0\.1:\d+\s+(\d+)", text)]
        assert len(pids) == 3

        with tsclient.Client(address, job_id="job-1") as client:
            assert client.acquire("g", timeout=30).success
            status = client.status("g")
            assert status.locking_job == "job-1"
            assert sorted(status.nodes) == ["node-1", "node-2"]
            client.yield_("g")

        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert not any(pid_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
