"""`tslice watch` in a real terminal: tmux runs it (80 x 50) against a live orchestrator
serving mutual TLS, over a slow link (100 ms each way), and the test reads the screen while
jobs acquire and yield, a switch hangs (its agent frozen with SIGSTOP) and a node is
degraded; Ctrl-C ends it with exit code 0."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import pytest

import tslice.client as tsclient
from tests.cli.terminal import SlowLink, Tmux, keep_screen
from tests.harness.ports import closed_port
from tests.security.conftest import (
    Certs,
    agent_args,
    make_certs,
    orchestrator_args,
    serving_all,
    tls_args,
)
from tslice.common import errors
from tslice.security import tls

WIDTH = 80


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int, Certs]]:
    """(orchestrator, agent, agent pid, certs): mutual TLS, one sim node, local mode."""
    state = tmp_path_factory.mktemp("watch")
    certs = make_certs(state / "certs")
    port = closed_port()
    agent = agent_args(state, *tls_args(certs, mutual=True))
    agent[agent.index("--port") + 1] = str(port)
    me = certs.client("orchestrator")
    config = state / "orchestrator.yaml"
    config.write_text(
        f"agent_client: {{ca: {certs.ca.cert}, cert: {me.cert}, key: {me.key}}}\n"
        # One refusal makes a node degraded; events are written often (--history replays).
        "max_refusals: 1\nhistory: {flush_interval_s: 0.2}\n"
    )
    orch = orchestrator_args(
        state, f"127.0.0.1:{port}", "--config", str(config), *tls_args(certs, mutual=True)
    )
    servers = [("agent", agent, state / "agent.log"), ("orchestrator", orch, state / "orch.log")]
    with serving_all(servers) as (agent_server, orch_server):
        yield orch_server.address, agent_server.address, agent_server.proc.pid, certs


def _client(address: str, certs: Certs, job: str) -> tsclient.Client:
    return tsclient.Client(
        address,
        job_id=job,
        retry=tsclient.NO_RETRY,
        security=tls.ClientSecurity.from_env(certs.env(f"job:{job}")),
    )


def _wedge(agent: str, certs: Certs, group: str) -> None:
    """A grant mark on the agent that the orchestrator cannot pass: its grants of ``group``
    are refused as stale (and one refusal makes the node degraded)."""
    me = certs.client("orchestrator")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.cert.read_bytes(),
        private_key=me.key.read_bytes(),
        certificate_chain=me.cert.read_bytes(),
    )
    with grpc.secure_channel(agent, credentials) as channel:
        tsclient.SnapshotAgentClient(channel=channel).grant("stray", group, grant_epoch=2**62)


def _rows(screen: str, first: str) -> list[list[str]]:
    return [line.split() for line in screen.splitlines() if line.split()[:1] == [first]]


def test_watch_follows_jobs_switches_and_degraded_nodes_then_exits_on_ctrl_c(
    stack: tuple[str, str, int, Certs],
) -> None:
    orchestrator, agent, agent_pid, certs = stack
    link = SlowLink(orchestrator, delay_s=0.1)
    env = {**certs.env("admin"), "COLUMNS": str(WIDTH), "TERM": "xterm-256color"}
    env["PATH"] = os.environ.get("PATH", "")
    command = [sys.executable, "-m", "tslice", "watch", "--addr", link.address, "--refresh", "0.5"]
    term = Tmux(command, env=env, width=WIDTH, height=50)
    a, b = _client(orchestrator, certs, "job-a"), _client(orchestrator, certs, "job-b")
    try:
        # Over the slow link the first poll takes a few round trips: "connecting..." first.
        screen = term.wait_for(lambda s: "updated" in s and "(TLS)" in s)
        assert "Recent events" in screen

        a.acquire("g")
        screen = term.wait_for(lambda s: ["g", "LOCKED", "job-a"] in [r[:3] for r in _rows(s, "g")])
        waiting = threading.Thread(target=b.acquire, args=("g",), kwargs={"timeout": 60})
        waiting.start()
        screen = term.wait_for(lambda s: "Queues" in s and _rows(s, "g")[-1][2:3] == ["job-b"])
        queued = _rows(screen, "g")[-1]
        assert queued[:3] == ["g", "1", "job-b"] and queued[4:5] == ["s"] and "fifo" in queued

        # A switch that cannot finish: its agent is frozen.
        os.kill(agent_pid, signal.SIGSTOP)
        try:
            a.yield_("g")
            # SWITCHING, or UNKNOWN once the status read of the frozen agent times out.
            screen = term.wait_for(
                lambda s: (
                    "Switches in progress" in s
                    and "node-a" in s
                    and _rows(s, "g")[0][1] in ("SWITCHING", "UNKNOWN")
                )
            )
            switching = [r for r in _rows(screen, "g") if "job-a" in r and "->" in r]
            assert switching and "..." in switching[0], switching
            keep_screen(term.screen(escapes=True), "watch-switching", width=WIDTH)
        finally:
            os.kill(agent_pid, signal.SIGCONT)
        waiting.join(timeout=60)
        screen = term.wait_for(
            lambda s: (
                ["g", "LOCKED", "job-b"] in [r[:3] for r in _rows(s, "g")]
                and "Switches in progress" not in s
            )
        )
        assert any("GRANTED" in line and "job job-b" in line for line in screen.splitlines())
        assert any("SNAPSHOT_DONE" in line for line in screen.splitlines())

        # A degraded node, with its reason.
        _wedge(agent, certs, "w")
        with pytest.raises(errors.TsliceError, match="degraded"):
            # job-b: it holds g, on the same node (local mode), and may hold w beside it.
            b.acquire("w", timeout=30)
        screen = term.wait_for(lambda s: "Degraded nodes" in s)
        degraded = screen.split("Degraded nodes", 1)[1].split("Recent events", 1)[0]
        assert any(r[:2] == ["w", "node-a"] for r in _rows(degraded, "w")), screen
        assert "stale grant" in " ".join(degraded.split()), screen
        keep_screen(term.screen(escapes=True), "watch", width=WIDTH)

        lines = screen.splitlines()
        assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)

        term.keys("C-c")
        done = term.wait_for(lambda s: "command-exit=" in s)
        assert "command-exit=0" in done and "Traceback" not in done
        assert "Recent events" not in done, "the alternate screen was left"
    finally:
        term.close()
        a.close()
        b.close()
        link.close()


def test_watch_says_why_it_cannot_start(tmp_path: pathlib.Path) -> None:
    term = Tmux(
        [sys.executable, "-m", "tslice", "watch", "--addr", f"127.0.0.1:{closed_port()}"],
        env={"PATH": os.environ.get("PATH", "")},
        width=WIDTH,
        height=10,
    )
    try:
        done = term.wait_for(lambda s: "command-exit=" in s)
        assert "command-exit=1" in done and "not reachable" in done and "Traceback" not in done
    finally:
        term.close()


def test_watch_not_on_a_terminal_prints_one_screen(stack: tuple[str, str, int, Certs]) -> None:
    orchestrator, _, _, certs = stack
    with _client(orchestrator, certs, "job-a") as a:
        a.acquire("piped")
        done = subprocess.run(
            [sys.executable, "-m", "tslice", "watch", "--addr", orchestrator],
            env={**os.environ, **certs.env("admin"), "COLUMNS": str(WIDTH)},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        a.yield_("piped")
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout, "piped")
    assert rows and rows[0][1:3] == ["LOCKED", "job-a"], done.stdout
    assert "(TLS)" in done.stdout and "\x1b" not in done.stdout
