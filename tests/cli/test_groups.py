"""`--group NAME` (tslice up / tslice orchestrator): with it, local mode has exactly those
groups and any other is NOT_FOUND; without it, a group created by its first Acquire is
logged once, naming it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tslice.client as tsclient
from tests.cli.support import run_cli
from tslice.common import errors
from tslice.orchestrator import config
from tslice.sim import cluster


def test_up_with_groups_serves_those_groups_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tslice",
            "up",
            "--port",
            "0",
            "--agents",
            "1",
            "--group",
            "sampler",
            "--group",
            "trainer",
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
        for line in proc.stdout:  # blocks until the table is printed
            printed.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(printed)
        assert "Groups: sampler, trainer (no others)" in text
        match = re.search(r"export TSLICE_ORCHESTRATOR=(127\.0\.0\.1:\d+)", text)
        assert match, text
        address = match.group(1)

        code, out, _ = run_cli(capsys, "list", "--addr", address, "--json")
        assert code == 0
        listed = json.loads(out)["groups"]
        assert [(g["group_id"], g["group_state"]) for g in listed] == [
            ("sampler", "IDLE"),
            ("trainer", "IDLE"),
        ]
        with tsclient.Client(address, job_id="job-1", lease_s=None) as client:
            with pytest.raises(errors.UnknownGroup) as info:
                client.acquire("nope", timeout=10)
            assert info.value.status.name == "NOT_FOUND"
            assert "'nope' is not one of the groups given with --group (sampler, trainer)" in (
                info.value.message
            )
            assert client.acquire("sampler", timeout=30).success
            client.yield_("sampler")
            assert client.list_groups() == ("sampler", "trainer")
        code, out, err = run_cli(capsys, "acquire", "nope", "job-1", "--addr", address)
        assert code == 1 and out == "" and "--group" in err and "tslice list" in err
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0


def test_without_groups_a_group_created_on_first_acquire_is_logged_once() -> None:
    agents = [cluster.SimAgent(name="node-1", backend="noop")]
    with cluster.LocalCluster(agents=agents, log_level="info") as local:
        with tsclient.Client(local.orchestrator_address, job_id="job-1", lease_s=None) as client:
            for _ in range(2):
                assert client.acquire("fresh", timeout=30).success
                client.yield_("fresh")
        records = [
            json.loads(line)
            for line in local.log_path(cluster.ORCHESTRATOR).read_text().splitlines()
            if line.startswith("{")
        ]
    created = [r for r in records if "created by its first Acquire" in r["msg"]]
    assert len(created) == 1, created
    assert created[0]["level"] == "info" and created[0]["group_id"] == "fresh"
    assert "group fresh" in created[0]["msg"]


def test_group_config_is_validated(tmp_path: Path) -> None:
    built = config.build(
        overrides={"local_agents": ["a=127.0.0.1:1"], "local_groups": ["x", "y", "x"]}
    )
    assert built.topology.local_groups == ("x", "y")
    with pytest.raises(errors.ConfigError, match=r"local_groups.*group id"):
        config.build(overrides={"local_agents": ["a=127.0.0.1:1"], "local_groups": ["bad id!"]})
    topology = tmp_path / "topology.yaml"
    topology.write_text("groups: {g: {nodes: [{name: a, agent: '127.0.0.1:1'}]}}\n")
    with pytest.raises(errors.ConfigError, match=r"--group .*static topology"):
        config.build(overrides={"topology_file": topology, "local_groups": ["x"]})
