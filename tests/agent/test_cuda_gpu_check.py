"""bench/gpu_check.py runs end to end (``--simulate``: CPU tensors, FakeDriver) and
refuses clearly without a GPU, so the one run on a lent GPU is not wasted on a script bug."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_simulated_run_passes_every_check() -> None:
    done = _run("--simulate", "--size-gib", "0.01", "--tensors", "2", "--reps", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    names = [c["name"] for c in report["checks"]]
    assert "registration: peer pid is the GPU job" in names
    assert "agent restart: checkpointed job reads back SAVED" in names
    assert "cycle 2: data bit-exact after restore" in names
    assert "TorchAdapter: bit-exact after restore" in names
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["cuda snapshot (lock+checkpoint)"]["bytes"] > 0
    assert rows["pinned copy host->device"]["seconds"] > 0
    assert report["environment"]["checkpoint driver"] == "fake"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    done = _run("--reps", "1")
    assert done.returncode == 2
    assert "no CUDA GPU is visible" in done.stderr
    assert "--simulate" in done.stderr
