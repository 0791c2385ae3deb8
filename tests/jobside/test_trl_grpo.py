"""TRL's ``GRPOTrainer`` time-sliced with ``tslice.rl.trl``: two real GRPO jobs (real
``transformers`` and ``trl`` on CPU, a tiny Llama and tokenizer built locally) share one
group through a real orchestrator and app-channel agent, and each ends bit-identical to
the same seed trained alone, with no tslice at all.

``examples/trl_grpo.py`` is the job script; each job runs in its own process, configured
by the stack's environment only (``TIMESLICE_*``, ``TSLICE_AGENT``), with the one line
``TimeSliceCallback.attach(trainer)``. The references run meanwhile in another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples_support import load_example, tensors
from tests.jobside.stack import Stack
from tslice import AsyncClient
from tslice.client import EventKind, OrchestratorEvent

torch = pytest.importorskip("torch")
# Looked up, not imported: only the job processes need them, and importing transformers
# here would cost seconds (and its FutureWarnings are errors in this suite).
for _framework in ("transformers", "trl", "datasets", "tokenizers"):
    if importlib.util.find_spec(_framework) is None:
        pytest.skip(f"needs {_framework}: pip install 'tslice[trl]'", allow_module_level=True)

STEPS = 4
GROUP = "trainer"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Switches:
    """The group's SWITCH_DONE events, from before the jobs start."""

    def __init__(self) -> None:
        self.seen: list[OrchestratorEvent] = []
        self.changed = asyncio.Condition()
        self.subscribed = asyncio.Event()

    async def watch(self, stack: Stack) -> None:
        async with AsyncClient(stack.address, job_id=None) as watcher:
            events = watcher.watch_events(GROUP, kinds=[EventKind.SWITCH_DONE])
            try:
                await events.started()
                self.subscribed.set()
                async for event in events:
                    async with self.changed:
                        self.seen.append(event)
                        self.changed.notify_all()
            finally:
                await events.aclose()

    async def wait_for(self, count: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.seen) >= count)


async def test_two_time_sliced_grpo_jobs_end_bit_identical_to_standalone_runs(
    stack: Stack, tmp_path: Path
) -> None:
    trl_grpo = load_example("trl_grpo")
    switches = _Switches()
    watcher = asyncio.create_task(switches.watch(stack))
    try:
        await asyncio.wait_for(switches.subscribed.wait(), 30)
        outcomes = await asyncio.to_thread(
            trl_grpo.run_pair, workdir=tmp_path / "run", env_for=stack.env, steps=STEPS
        )
        async with AsyncClient(stack.address, job_id=None) as client:
            status = await client.status(GROUP)
        # Every switch the orchestrator counted has reached the watcher (events trail).
        await asyncio.wait_for(switches.wait_for(status.switch_count), 30)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert len(switches.seen) == status.switch_count

    finals = {}
    for outcome in outcomes:
        report = outcome.report
        assert report["steps"] == STEPS and report["sliced"], report
        assert report["tags"] == ["weights", "optimizer"], report
        # GRPO's reward scoring ran with the group released, once per generation.
        assert report["callback"]["rewards_released"] == STEPS, report
        # The agent really took this job's tensors off and brought them back, as often as
        # the orchestrator switched away from it and back to it. (A registration reports
        # the state resident, so a job registered before the other's first grant is
        # evicted once more, before its own first grant.)
        adapter = report["adapter"]
        job = outcome.job_id
        away = [e for e in switches.seen if e.from_job == job]
        back = [e for e in switches.seen if e.job_id == job and e.detail == "restored"]
        assert len(away) >= STEPS // 2, switches.seen  # they took turns, step after step
        assert len(away) <= adapter["snapshots"] <= len(away) + 1, (adapter, switches.seen)
        assert adapter["restores"] == len(back), (adapter, switches.seen)
        assert adapter["bytes_out"] > 0 and adapter["bytes_in"] > 0, adapter
        assert report["callback"]["restored"] == adapter["restores"], report

        sliced = tensors(torch.load(outcome.sliced))
        standalone = tensors(torch.load(outcome.standalone))
        assert sliced.keys() == standalone.keys()
        assert any("exp_avg" in name for name in sliced)  # AdamW's state is compared too
        for name, tensor in standalone.items():
            assert sliced[name].dtype == tensor.dtype, name
            assert torch.equal(sliced[name], tensor), f"{outcome.job_id}: {name} differs"
        assert trl_grpo.states_identical(torch.load(outcome.sliced), torch.load(outcome.standalone))
        finals[outcome.job_id] = sliced

    # Training moved the weights, and the two seeds differ: the comparison can tell.
    name = "model.layers.0.self_attn.q_proj.weight"
    for outcome in outcomes:
        initial = torch.load(outcome.initial)
        assert not torch.equal(initial[name], finals[outcome.job_id][f"/model/{name}"])
    assert not torch.equal(finals["job-a"][f"/model/{name}"], finals["job-b"][f"/model/{name}"])


def test_tslice_rl_imports_without_transformers_and_trl_says_what_to_install() -> None:
    script = (
        "import sys\n"
        "import tslice.rl\n"
        "assert 'transformers' not in sys.modules and 'trl' not in sys.modules\n"
        "sys.modules['transformers'] = None  # as if it were not installed\n"
        "try:\n"
        "    import tslice.rl.trl\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "pip install transformers trl" in done.stdout, done.stdout
