"""`tslice plan` through the real command line: the table, --json, --apply, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.support import run_cli
from tests.sim.plan_runs import four_jobs, two_jobs_log
from tslice.orchestrator import config


def test_apply_writes_a_topology_the_orchestrator_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "conf" / "topology.yaml"
    code, stdout, err = run_cli(
        capsys, "plan", str(four_jobs(tmp_path)), "--no-simulate", "--apply", "--out", str(out)
    )
    assert code == 0, err
    assert "recommended: {A, B}  {C, D} on 4 GPU(s)" in stdout
    assert "exhaustive search: 15 scored" in stdout
    assert f"wrote {out}" in stdout
    topology = config.load_topology(out)
    assert set(topology.groups) == {"sampler-1", "trainer-1", "sampler-2", "trainer-2"}
    agents = sorted(node.address for nodes in topology.groups.values() for node in nodes)
    assert agents == [f"127.0.0.1:{9001 + i}" for i in range(4)]
    text = out.read_text()
    assert "# job(s) A, B: groups" in text and "# job(s) C, D: groups" in text


def test_json_document_and_given_agents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "topology.yaml"
    agents = [f"--agent=10.0.0.{i}:9001" for i in range(1, 5)]
    code, stdout, err = run_cli(
        capsys,
        "plan",
        str(four_jobs(tmp_path)),
        "--no-simulate",
        "--json",
        "--apply",
        "--out",
        str(out),
        *agents,
    )
    assert code == 0, err
    document = json.loads(stdout)
    assert document["recommended"]["grouping"] == [["A", "B"], ["C", "D"]]
    assert document["search"] == {"method": "exhaustive", "groupings_scored": 15}
    assert "simulated" not in document and document["topology"] == str(out)
    loaded = config.load_topology(out)
    assert {n.address for nodes in loaded.groups.values() for n in nodes} == {
        f"10.0.0.{i}:9001" for i in range(1, 5)
    }


def test_too_few_agents_and_bad_input_exit_2_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = str(four_jobs(tmp_path))
    code, _, err = run_cli(capsys, "plan", source, "--apply", "--agent", "127.0.0.1:9001")
    assert code == 2
    assert "has 4 node(s)" in err and "give one --agent per node" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run_cli(capsys, "plan", str(empty))
    assert code == 2
    assert err.startswith("error: ") and "is empty: record an event log" in err


def test_events_refuses_an_unknown_kind_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "events", "--kind", "GRANTD", "--addr", "127.0.0.1:1")
    assert code == 2
    assert "unknown event kind 'GRANTD'" in err and "SWITCH_DONE" in err


def test_apply_never_replaces_the_file_with_a_result_that_does_not_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The topology was written before it was validated: an invalid result replaced the
    existing file (and the command exited 2)."""
    out = tmp_path / "topology.yaml"
    out.write_text("# the operator's topology\n")
    out.chmod(0o640)
    source = str(four_jobs(tmp_path))
    bad = [f"--agent=not an address {i}" for i in range(4)]
    code, _, err = run_cli(
        capsys, "plan", source, "--no-simulate", "--apply", "--out", str(out), *bad
    )
    assert code == 2
    assert f"does not load, so {out} was left as it was" in err and "not an agent address" in err
    assert out.read_text() == "# the operator's topology\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "topology.yaml"]
    # A good result replaces it in one rename, keeping its mode.
    code, _, err = run_cli(capsys, "plan", source, "--no-simulate", "--apply", "--out", str(out))
    assert code == 0, err
    assert config.load_topology(out).groups and (out.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "topology.yaml"]


def test_apply_refuses_a_symbolic_link_and_leaves_its_target_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "elsewhere.conf"
    target.write_text("precious\n")
    link = tmp_path / "topology.yaml"
    link.symlink_to(target)
    code, _, err = run_cli(
        capsys, "plan", str(four_jobs(tmp_path)), "--no-simulate", "--apply", "--out", str(link)
    )
    assert code == 2
    assert "is a symbolic link" in err and "nothing was written" in err
    assert target.read_text() == "precious\n" and link.is_symlink()


def test_a_job_id_from_the_log_cannot_inject_yaml_into_the_topology(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Job ids went unchecked into the '# job(s) ...' comment lines: a newline in one
    started a line of YAML of its own (an extra `groups:`, `mode: local`)."""
    lines = two_jobs_log()
    evil = "B\nmode: local\ngroups: {}\n#"
    for line in lines:
        if line["job_id"] == "B":
            line["job_id"] = evil
    source = tmp_path / "events.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "topology.yaml"
    out.write_text("# the operator's topology\n")
    code, _, err = run_cli(
        capsys, "plan", str(source), "--no-simulate", "--apply", "--out", str(out)
    )
    assert code == 2
    assert "job_id 'B\\nmode: local" in err and "is malformed" in err
    assert out.read_text() == "# the operator's topology\n"
