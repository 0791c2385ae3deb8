"""bench/gpu_check.py runs end to end (``--simulate``: CPU tensors, FakeDriver, FakeNvml)
and refuses clearly without a GPU, so the one run on a lent GPU is not wasted on a script
bug; each part reports its own failure and the table always prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )


def test_simulated_run_passes_every_check() -> None:
    done = _run("--simulate", "--size-gib", "0.01", "--tensors", "2", "--reps", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    names = [c["name"] for c in report["checks"]]
    for name in (
        "registration: peer pid is the GPU job",
        "agent restart: checkpointed job reads back SAVED",
        "cycle 2: data bit-exact after restore",
        "cycle 2: device memory held before, released after",
        "cycle 2: the backend verified the release",
        "host budget: a state beyond it is refused, nothing frozen",
        "ranks, cycle 2 (together): every rank bit-exact",
        "TorchAdapter: bit-exact after restore",
        "TorchAdapter: host buffers at their exact size",
        "frozen weights: a snapshot copies only the trainable part",
        "overlapped switch: both jobs bit-exact",
    ):
        assert name in names, name
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["cuda snapshot (lock+checkpoint)"]["bytes"] > 0
    assert rows["ranks snapshot, together"]["seconds"] > 0
    assert rows["ranks snapshot, one at a time"]["seconds"] > 0
    assert rows["pinned copy host->device"]["seconds"] > 0
    assert rows["TorchAdapter snapshot, frozen base"]["seconds"] > 0
    assert report["environment"]["checkpoint driver"] == "fake"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    done = _run("--reps", "1")
    assert done.returncode == 2
    assert "no CUDA GPU is visible" in done.stderr
    assert "--simulate" in done.stderr


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_check
    import gpu_check_cuda
    import gpu_check_report

    return gpu_check, gpu_check_cuda, gpu_check_report


def test_a_failing_part_is_its_own_failed_check_and_the_table_still_prints(bench: Any) -> None:
    gpu_check, _, report_mod = bench
    report = report_mod.Report()
    report.check("earlier part", True)

    def missing() -> None:
        raise ImportError("No module named 'pydantic'")

    def broken() -> None:
        raise RuntimeError("the backend blew up")

    gpu_check.run_part("cuda", missing, report)
    gpu_check.run_part("ranks", broken, report)
    table = report_mod.render(report, as_json=False)
    assert "[ok] earlier part" in table
    assert "[FAIL] cuda: ran (No module named 'pydantic': carry the missing package" in table
    assert "[FAIL] ranks: ran (RuntimeError: the backend blew up)" in table
    assert table.endswith("SOME CHECKS FAILED")


def test_memory_released_needs_memory_held_before(bench: Any) -> None:
    _, cuda_part, _ = bench
    assert cuda_part.released(4096, 0)
    assert not cuda_part.released(0, 0)  # NVML measured nothing: nothing is proved
    assert not cuda_part.released(None, None)
    assert not cuda_part.released(4096, 512)
