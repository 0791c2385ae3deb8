"""Transparency proof: two real PyTorch jobs time-sliced through orchestrator + agent +
workload channel + TorchAdapter end bit-identical to the same seeds trained alone.

``examples/rl_tiny.py`` starts a real orchestrator and agent (app-channel backend) in
this event loop and the jobs as separate processes; this test reads back what the
processes saved and checks it tensor by tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples_support import load_example, tensors

torch = pytest.importorskip("torch")

STEPS = 12

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_time_sliced_jobs_end_bit_identical_to_standalone_runs(tmp_path: Path) -> None:
    rl_tiny = load_example("rl_tiny")

    outcomes = await rl_tiny.run_proof(workdir=tmp_path, steps=STEPS, seeds=(1, 2))

    finals = {}
    for outcome in outcomes:
        report = outcome.report
        assert report["steps"] == STEPS and not report["standalone"]
        # The agent really moved this job's tensors off and back at the switches: with two
        # jobs alternating step by step, nearly every step starts with a restore.
        assert report["snapshots"] >= STEPS // 2, report
        assert report["restores"] >= STEPS // 2, report
        assert report["bytes_out"] > 0 and report["bytes_in"] > 0

        sliced = tensors(torch.load(outcome.sliced))
        standalone = tensors(torch.load(outcome.standalone))
        assert sliced.keys() == standalone.keys()
        assert any("exp_avg" in name for name in sliced)  # Adam state is compared too
        for name, tensor in standalone.items():
            assert sliced[name].dtype == tensor.dtype, name
            assert torch.equal(sliced[name], tensor), f"{outcome.job_id}: {name} differs"
        assert outcome.identical

        # Training happened: the weights moved away from the seed's initial ones.
        initial = rl_tiny.make_job(outcome.seed).policy.state_dict()
        assert not torch.equal(initial["0.weight"], sliced["/policy/0.weight"])
        finals[outcome.job_id] = sliced

    # Two seeds, two different results: the comparison above can tell jobs apart.
    a, b = finals["job-a"], finals["job-b"]
    assert not torch.equal(a["/policy/0.weight"], b["/policy/0.weight"])


def test_states_identical_notices_a_single_flipped_bit() -> None:
    rl_tiny = load_example("rl_tiny")
    state = {"policy": {"w": torch.arange(6, dtype=torch.float32)}, "step": 3}
    flipped = {"policy": {"w": torch.arange(6, dtype=torch.float32)}, "step": 3}
    flipped["policy"]["w"].view(torch.int32)[2] ^= 1

    assert rl_tiny.states_identical(
        state, {"policy": {"w": state["policy"]["w"].clone()}, "step": 3}
    )
    assert not rl_tiny.states_identical(state, flipped)
    assert not rl_tiny.states_identical(state, {**state, "step": 4})
