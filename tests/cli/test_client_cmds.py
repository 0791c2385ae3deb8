"""Client commands against a real local cluster: --json, a yield of a group not held, and
the live queue position of a waiting `tslice acquire` on a terminal (a real pty)."""

from __future__ import annotations

import json
import os
import pathlib
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import tslice
import tslice.client as tsclient
from tests.cli.support import run_cli
from tests.harness.ports import closed_port
from tests.security.conftest import make_certs, orchestrator_args, serving, tls_args
from tslice.security import tls
from tslice.sim import cluster

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.LocalCluster]:
    config = tmp_path_factory.mktemp("orchestrator") / "orchestrator.yaml"
    # One refusal makes a node degraded: the degraded-node test needs no retries.
    config.write_text("max_refusals: 1\n")
    with cluster.LocalCluster(
        agents=[cluster.SimAgent(name="node-1", backend="noop")],
        orchestrator_args=["--config", str(config)],
    ) as running:
        yield running


@pytest.fixture(scope="module")
def address(local: cluster.LocalCluster) -> str:
    return local.orchestrator_address


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"tslice {tslice.__version__}"


def test_json_documents(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "acquire", "json-g", "job-1", "--addr", address, "--json")
    assert code == 0
    acquired = json.loads(out)
    assert acquired["group_id"] == "json-g" and acquired["job_id"] == "job-1"
    assert acquired["success"] is True and acquired["grant_epoch"] >= 1
    assert {"waited_ms", "context_restored"} <= set(acquired)

    code, out, _ = run_cli(capsys, "status", "json-g", "--addr", address, "--json")
    assert code == 0
    status = json.loads(out)
    assert status["group_id"] == "json-g" and status["group_state"] == "LOCKED"
    assert status["locking_job"] == "job-1" and status["waiting_jobs"] == []
    assert status["nodes"] == ["node-1"]
    assert status["state_timestamp"] is None or isinstance(status["state_timestamp"], str)

    code, out, _ = run_cli(capsys, "list", "--addr", address, "--json")
    assert code == 0
    listed = json.loads(out)
    assert [g["locking_job"] for g in listed["groups"] if g["group_id"] == "json-g"] == ["job-1"]

    code, out, _ = run_cli(capsys, "yield", "json-g", "job-1", "--addr", address, "--json")
    assert code == 0
    assert json.loads(out) == {
        "group_id": "json-g",
        "job_id": "job-1",
        "held": True,
        "success": True,
        "pending_waiters": 0,
        "snapshot_deferred": True,
    }
    code, out, _ = run_cli(capsys, "yield", "json-g", "job-1", "--addr", address, "--json")
    assert code == 0 and json.loads(out)["held"] is False


def test_acquire_of_comma_separated_groups_takes_them_together(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "acquire", "set-a,set-b", "job-s", "--addr", address)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "job job-s holds group set-a",
        "job job-s holds group set-b",
    ]
    code, out, _ = run_cli(capsys, "acquire", "set-a,set-b", "job-s", "--addr", address, "--json")
    assert code == 0
    held = json.loads(out)
    assert held["job_id"] == "job-s" and sorted(held["groups"]) == ["set-a", "set-b"]
    assert all(g["success"] and g["grant_epoch"] == 1 for g in held["groups"].values())
    for group in ("set-a", "set-b"):
        assert run_cli(capsys, "yield", group, "job-s", "--addr", address)[0] == 0


def test_yield_of_a_group_not_held_says_so(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run_cli(capsys, "acquire", "free-g", "job-1", "--addr", address)
    assert code == 0
    code, out, _ = run_cli(capsys, "yield", "free-g", "job-1", "--addr", address)
    assert code == 0 and "job job-1 yielded group free-g" in out
    code, out, err = run_cli(capsys, "yield", "free-g", "job-1", "--addr", address)
    assert code == 0, err
    assert out.strip() == "job job-1 did not hold group free-g (nobody does); nothing was released"


def _read_until(fd: int, pattern: str, *, seen: list[str], timeout_s: float = 60) -> str:
    """Read the pty until ``pattern`` shows up in the text without escape codes."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _ANSI.sub("", "".join(seen))
        if re.search(pattern, text):
            return text
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{pattern!r} not shown within {timeout_s} s: {text!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"{pattern!r} never shown: {text!r}")
            seen.append(chunk.decode(errors="replace"))


def test_a_waiting_acquire_shows_its_queue_position_on_a_terminal(address: str) -> None:
    with tsclient.Client(address, job_id="job-a", lease_s=None) as holder:
        holder.acquire("tty-g", timeout=30)
        controller, terminal = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tslice", "acquire", "tty-g", "job-b", "--addr", address],
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
            env={**os.environ, "COLUMNS": "200", "TERM": "xterm"},
        )
        os.close(terminal)
        seen: list[str] = []
        try:
            shown = _read_until(
                controller,
                r"job job-b waiting for group tty-g: position 1 of 1 in the queue "
                r"\(held by job-a\); waited \d+\.\d s",
                seen=seen,
            )
            assert "Traceback" not in shown
            holder.yield_("tty-g")
            _read_until(controller, r"job job-b holds group tty-g", seen=seen)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(controller)
    with tsclient.Client(address, job_id="job-b", lease_s=None) as client:
        client.yield_("tty-g")


def test_status_shows_degraded_nodes_and_clear_degraded_clears_them(
    local: cluster.LocalCluster, address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Something wedged node-1 for this group: a grant mark the orchestrator cannot pass,
    # so that the agent refuses every grant of the orchestrator as stale.
    with tsclient.SnapshotAgentClient(local.agent_addresses["node-1"]) as agent:
        agent.grant("stray", "wedged-g", grant_epoch=2**62)
    code, _, err = run_cli(
        capsys, "acquire", "wedged-g", "job-1", "--addr", address, "--timeout", "30"
    )
    assert code == 1
    assert "node node-1 is degraded" in err and "clear-degraded wedged-g --node node-1" in err

    code, out, _ = run_cli(capsys, "status", "wedged-g", "--addr", address, "--json")
    assert code == 0
    degraded = json.loads(out)["degraded"]
    assert [d["node"] for d in degraded] == ["node-1"] and "stale grant" in degraded[0]["reason"]
    code, out, _ = run_cli(capsys, "status", "wedged-g", "--addr", address)
    assert code == 0 and "degraded" in out and "node-1: " in out and "stale grant" in out
    code, out, _ = run_cli(capsys, "list", "--addr", address)
    header, row = [
        line.split() for line in out.splitlines() if "degraded" in line or "wedged-g" in line
    ]
    assert code == 0 and header[-1] == "degraded" and row[0] == "wedged-g" and row[-1] == "node-1"

    code, _, err = run_cli(
        capsys, "clear-degraded", "wedged-g", "--node", "nope", "--addr", address
    )
    assert code == 2  # a bad argument
    assert err.strip().startswith("error: node 'nope' is not in group 'wedged-g'"), err
    code, _, err = run_cli(capsys, "clear-degraded", "no-such-g", "--addr", address)
    assert code == 1 and "no-such-g" in err and "tslice list" in err

    code, out, _ = run_cli(
        capsys, "clear-degraded", "wedged-g", "--node", "node-1", "--addr", address
    )
    assert code == 0, out
    assert out.strip() == "group wedged-g: cleared degraded node(s) node-1; its switches run again"
    code, out, _ = run_cli(capsys, "status", "wedged-g", "--addr", address, "--json")
    assert json.loads(out)["degraded"] == []
    code, out, _ = run_cli(capsys, "clear-degraded", "wedged-g", "--addr", address, "--json")
    assert code == 0
    assert json.loads(out) == {"group_id": "wedged-g", "node": "", "cleared": []}
    code, out, _ = run_cli(capsys, "clear-degraded", "wedged-g", "--addr", address)
    assert out.strip() == "group wedged-g has no degraded node; nothing to clear"


def test_a_plaintext_command_against_a_tls_orchestrator_names_the_tls_setting(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without $TSLICE_TLS_CA the handshake never happens: the one line says what to set,
    not only "is `tslice up` running?"."""
    for name in (tls.TLS_CA_ENV, tls.TLS_CERT_ENV, tls.TLS_KEY_ENV, tls.TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    certs = make_certs(tmp_path / "certs", identities=())
    agent = f"127.0.0.1:{closed_port()}"  # never started: the command fails before any switch
    args = orchestrator_args(tmp_path, agent, *tls_args(certs, mutual=False))
    with serving("orchestrator", args, tmp_path / "orchestrator.log") as orchestrator:
        code, out, err = run_cli(capsys, "status", "g", "--addr", orchestrator.address)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "not reachable" in lines[0] and f"${tls.TLS_CA_ENV}" in lines[0], lines[0]


def test_events_json_lines_are_an_event_log(address: str) -> None:
    """`tslice events --json` prints the stream as JSON lines, the event log `tslice plan` reads."""
    watcher = subprocess.Popen(
        [
            *(sys.executable, "-c", "from tslice.cli.main import main; main()"),
            *("events", "ev-g", "--json", "--count", "4", "--addr", address),
            *("--kind", "GRANTED", "--kind", "YIELDED"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with tsclient.Client(address, job_id=None) as client:
            # Turns go on until the watcher, subscribed at some point, has seen four events.
            for turn in range(2_000):
                if watcher.poll() is not None:
                    break
                job = f"ev-{turn % 2}"
                client.acquire("ev-g", job_id=job)
                client.yield_("ev-g", job_id=job)
        out, _ = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 4
    assert {r["kind"] for r in records} <= {"GRANTED", "YIELDED"}
    assert {r["group_id"] for r in records} == {"ev-g"}
    assert {r["job_id"] for r in records} <= {"ev-0", "ev-1"}
    # What the planner's reader needs of every line (tslice.planner.recording).
    assert all({"kind", "group_id", "time"} <= set(r) for r in records)
