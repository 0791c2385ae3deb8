"""The event history of a real run, through the CLI: `tslice events --since`, a SIGKILL of
the orchestrator (the history keeps every batch it wrote, with no hole), `--export` in the
recorded-run format that `tslice plan`, the trace replay and `tslice timeline --from` read,
and `tslice timeline --since` drawing the run."""

from __future__ import annotations

import json
import pathlib
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import tslice.client as tsclient
from tests.cli.support import run_cli
from tests.timeline import chromium
from tslice.phases import derive
from tslice.sim import cluster
from tslice.timeline import export

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Work and CPU phases of the jobs below, seconds (drawn x100: seconds of a trace).
HOLD_S, CPU_S = 0.15, 0.08
SCALE = "100"


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.LocalCluster]:
    config = tmp_path_factory.mktemp("orchestrator") / "orchestrator.yaml"
    config.write_text("history: {flush_interval_s: 0.2}\n")
    with cluster.LocalCluster(
        # Switches of a few tens of ms (256 MiB at 10 GB/s), as on fast hardware.
        agents=[
            cluster.SimAgent(
                name=n, bandwidth_bytes_per_s=10 * 10**9, footprint_bytes=2**28, latency_s=0.005
            )
            for n in ("node-1", "node-2")
        ],
        groups={"sampler": ["node-1"], "trainer": ["node-2"]},
        orchestrator_args=["--config", str(config)],
    ) as running:
        yield running


def _rl_job(address: str, job: str, steps: int, failed: list[BaseException]) -> None:
    """An RL-shaped job: each step generates on the sampler, scores on the CPU, trains."""
    try:
        with tsclient.Client(address, job_id=job) as client:
            for _ in range(steps):
                with client.slice("sampler"):
                    time.sleep(HOLD_S)  # the subject: the job's GPU work
                time.sleep(CPU_S)  # the subject: CPU work while the other job generates
                with client.slice("trainer"):
                    time.sleep(HOLD_S)
    except BaseException as err:
        failed.append(err)


def _run_jobs(address: str, steps: int) -> None:
    failed: list[BaseException] = []
    threads = [threading.Thread(target=_rl_job, args=(address, job, steps, failed)) for job in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failed, failed


def _stored_epochs(db: pathlib.Path) -> dict[str, list[int]]:
    """Grant epochs of the GRANTED events in the history file, per group (read directly)."""
    from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT event FROM events WHERE kind = 2 ORDER BY seq").fetchall()
    out: dict[str, list[int]] = {}
    for (blob,) in rows:
        event = opb.OrchestratorEvent.FromString(blob)
        out.setdefault(event.group_id, []).append(event.grant_epoch)
    return out


def _until_stored(db: pathlib.Path, group: str, epoch: int, timeout: float = 20.0) -> None:
    """Wait until the history file holds ``group``'s grant ``epoch`` (written in batches)."""
    deadline = time.monotonic() + timeout
    while epoch not in _stored_epochs(db).get(group, []):
        assert time.monotonic() < deadline, f"grant {epoch} of {group} never written"
        time.sleep(0.05)


def test_history_survives_a_sigkill_and_exports_a_plannable_trace(
    local: cluster.LocalCluster,
    capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
) -> None:
    address = local.orchestrator_address
    db = local.state_dir(cluster.ORCHESTRATOR) / "events.db"
    began = time.time()
    _run_jobs(address, steps=4)
    with tsclient.Client(address, job_id=None) as client:
        epochs = {g: client.status(g).grant_epoch for g in ("sampler", "trainer")}
    for group, epoch in epochs.items():
        _until_stored(db, group, epoch)
    # Killed outright: what was written stays, and nothing after a hole.
    local.kill(cluster.ORCHESTRATOR, signal.SIGKILL)
    local.restart(cluster.ORCHESTRATOR)
    after_kill = _stored_epochs(db)
    for group, epoch in epochs.items():
        assert after_kill[group] == list(range(1, epoch + 1)), group
    code, out, err = run_cli(capsys, "events", "--since", "10m", "--json", "--addr", address)
    assert code == 0, err
    stored = [json.loads(line) for line in out.splitlines()]
    granted = [(e["group_id"], e["grant_epoch"]) for e in stored if e["kind"] == "GRANTED"]
    assert sorted(granted) == sorted((g, n) for g, e in epochs.items() for n in range(1, e + 1))
    assert all(export.seconds(e["time"]) >= began - 1 for e in stored)
    # Filters, and --until before the run: nothing.
    code, out, _ = run_cli(
        capsys,
        "events",
        "--since",
        "10m",
        "--group",
        "trainer",
        "--job",
        "B",
        "--json",
        "--addr",
        address,
    )
    assert code == 0 and out
    assert all(
        e["group_id"] == "trainer" and "B" in (e["job_id"], e["from_job"])
        for e in map(json.loads, out.splitlines())
    )
    code, out, _ = run_cli(capsys, "events", "--since", "1h", "--until", "30m", "--addr", address)
    assert code == 0 and out == ""

    # The export is a trace: the planner, the trace replay and the timeline read it.
    exported = tmp_path / "run.json"
    code, out, err = run_cli(
        capsys,
        "events",
        "--since",
        "10m",
        "--export",
        str(exported),
        "--time-scale",
        SCALE,
        "--addr",
        address,
    )
    assert code == 0, err
    assert f"wrote {exported}" in out
    doc = json.loads(exported.read_text())
    assert set(doc["timeslice"]["windows"]) == {"sampler", "trainer"}
    assert len(doc["timeslice"]["windows"]["sampler"]) == 8  # 2 jobs x 4 steps
    model = derive.load(exported)
    assert {s.job for s in model.jobs} == {"A", "B"}
    assert set(model.shared) == {"sampler", "trainer"}
    code, out, err = run_cli(capsys, "plan", str(exported), "--no-simulate", "--json")
    assert code == 0, err
    planned = json.loads(out)
    assert planned["format"] == "trace" and len(planned["jobs"]) == 2
    assert set(planned["shared_pools"]) == {"sampler", "trainer"}
    replay = subprocess.run(
        [
            sys.executable,
            "bench/trace_replay.py",
            "--trace",
            str(exported),
            "--quick",
            "--only",
            "reference",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert json.loads(replay.stdout)["trace"] == str(exported)

    page = tmp_path / "real-run.html"
    code, out, err = run_cli(
        capsys,
        "timeline",
        "--since",
        "10m",
        "--out",
        str(page),
        "--time-scale",
        SCALE,
        "--title",
        "tslice: a real run (two RL jobs, sim agents)",
        "--addr",
        address,
    )
    assert code == 0, err
    html_text = page.read_text()
    assert "sampler" in html_text and "trainer" in html_text and 'class="switch"' in html_text
    assert page.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = chromium.dom(page)
    assert 'data-ready="yes"' in dom and 'data-errors=""' in dom
    shot = chromium.screenshot(page, tmp_path / "shot.png", width=1300, height=620)
    chromium.keep(shot, "timeline-real-run.png")
    code, _, err = run_cli(
        capsys,
        "timeline",
        "--from",
        str(exported),
        "--out",
        str(tmp_path / "again.html"),
        "--no-png",
    )
    assert code == 0, err


def test_bad_history_options_are_refused_with_the_fix(
    local: cluster.LocalCluster, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    address = local.orchestrator_address
    for args, says in (
        (("--since", "yesterday"), "not a time"),
        (("--until", "1h"), "--until needs --since"),
        (("--since", "1h", "--until", "2h"), "is before --since"),
        (("--export", str(tmp_path / "x.json")), "give --since"),
    ):
        code, _, err = run_cli(capsys, "events", *args, "--addr", address)
        assert code == 2 and says in err, (args, err)
    code, _, err = run_cli(capsys, "timeline", "--addr", address)
    assert code == 2 and "--since 2h" in err
    missing = tmp_path / "missing.json"
    code, _, err = run_cli(capsys, "timeline", "--from", str(missing))
    assert code == 2 and "does not exist" in err
