"""Where ``TimeSliceCallback`` begins and ends phases, hook by hook, in this process.

The trainer is a stand-in with GRPOTrainer's name and the three methods that
``attach`` wraps; the callbacks are called as transformers' training loop calls them;
``Phases`` is replaced by a recorder. The real thing, end to end with real TRL, is
``test_trl_grpo.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tslice.rl import phases as rl_phases

torch = pytest.importorskip("torch")
TrainerControl = pytest.importorskip("transformers").TrainerControl

from tslice.rl import trl as rl_trl  # noqa: E402 -- needs transformers


class RecordingPhases:
    """Records begins and ends; every phase takes the one group."""

    made: list[RecordingPhases] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.log: list[str] = []
        self.enabled = True
        self.job_id = "job-a"
        self.closed = False
        RecordingPhases.made.append(self)

    def begin(self, phase: Any) -> dict[str, Any]:
        self.log.append(f"+{phase}")
        return {}

    def end(self, phase: Any) -> None:
        self.log.append(f"-{phase}")

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TSLICE_ORCHESTRATOR", "TIMESLICE_ORCH_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TIMESLICE_TRAINER_GROUP", "trainer")
    monkeypatch.setenv("TIMESLICE_SAMPLER_GROUP", "sampler")
    monkeypatch.setattr(rl_phases, "Phases", RecordingPhases)
    RecordingPhases.made.clear()
    yield


class GRPOTrainer:
    """The parts of TRL's GRPOTrainer that the callback touches."""

    def __init__(self, reward_funcs: list[Any] | None = None) -> None:
        self.model = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.reward_funcs = reward_funcs if reward_funcs is not None else [lambda **_: [1.0]]
        self.callbacks: list[Any] = []
        self.calls: list[str] = []
        self.callback: rl_trl.TimeSliceCallback | None = None

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)
        self.callback = callback

    def _held(self) -> str:
        assert self.callback is not None
        phase = self.callback.current_phase
        return "none" if phase is None else phase.value

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        self.calls.append(f"generate@{self._held()}")
        self._calculate_rewards(inputs)
        return inputs

    def _calculate_rewards(self, inputs: Any) -> Any:
        self.calls.append(f"rewards@{self._held()}")
        return [1.0]

    def compute_loss(self, model: Any, inputs: Any) -> Any:
        self.calls.append(f"loss@{self._held()}")
        return 0.0


def step(trainer: Any, callback: Any, control: TrainerControl, *, generate: bool = True) -> None:
    """One optimizer step as transformers' loop runs it (GRPO generates inside it)."""
    callback.on_step_begin(None, None, control)
    if generate:
        trainer._generate_and_score_completions([])
    trainer.compute_loss(trainer.model, [])
    callback.on_step_end(None, None, control)


def begin_training(trainer: GRPOTrainer, callback: Any) -> RecordingPhases:
    callback.on_train_begin(
        None, None, TrainerControl(), model=trainer.model, optimizer=trainer.optimizer
    )
    (phases,) = RecordingPhases.made
    return phases


def test_grpo_step_generates_scores_released_then_trains() -> None:
    trainer = GRPOTrainer()
    callback = rl_trl.TimeSliceCallback.attach(trainer)
    assert trainer.callbacks == [callback]
    phases = begin_training(trainer, callback)
    # One group for every phase: the model is the sampler too.
    assert phases.kwargs["trainer_group"] == phases.kwargs["sampler_group"] == "trainer"
    assert phases.kwargs["role"] == "colocated"
    assert phases.kwargs["workload"] is callback.adapter is not None
    assert callback.adapter.tags == ["weights", "optimizer"]

    step(trainer, callback, TrainerControl())
    step(trainer, callback, TrainerControl(), generate=False)  # reuses buffered completions

    assert trainer.calls == [
        "generate@generate",
        "rewards@none",
        "loss@train",
        "loss@train",
    ]
    assert phases.log == [
        "+generate",
        "-generate",  # released while the reward function runs
        "+train",
        "-train",  # released between steps
        "+train",
        "-train",
    ]
    assert callback.stats.rewards_released == 1
    assert callback.stats.acquires == 3


def test_relabelling_never_yields_and_the_last_step_keeps_the_group_for_saving() -> None:
    trainer = GRPOTrainer()
    callback = rl_trl.TimeSliceCallback.attach(trainer)
    phases = begin_training(trainer, callback)

    step(trainer, callback, TrainerControl(should_save=True))
    callback.on_save(None, None, TrainerControl())
    step(trainer, callback, TrainerControl(should_evaluate=True))
    callback.on_evaluate(None, None, TrainerControl())
    step(trainer, callback, TrainerControl(should_training_stop=True))
    callback.on_epoch_end(None, None, TrainerControl(should_training_stop=True))
    callback.on_train_end(None, None, TrainerControl(should_training_stop=True))

    assert phases.log == [
        *("+generate", "-generate", "+train", "+save", "-train", "-save"),
        *("+generate", "-generate", "+train", "+eval", "-train", "-eval"),
        *("+generate", "-generate", "+train", "+save", "-train"),
    ]
    assert callback.current_phase == "save"  # trainer.save_model() reads resident weights

    callback.release()
    assert phases.log[-1] == "-save" and not phases.closed
    callback.close()
    assert phases.closed
    assert "_calculate_rewards" not in vars(trainer)  # unwrapped: the class's methods again


def test_reward_models_are_scored_with_the_group_held() -> None:
    trainer = GRPOTrainer(reward_funcs=[torch.nn.Linear(2, 1)])
    callback = rl_trl.TimeSliceCallback.attach(trainer)
    phases = begin_training(trainer, callback)

    step(trainer, callback, TrainerControl())

    assert trainer.calls == ["generate@generate", "rewards@generate", "loss@train"]
    assert phases.log == ["+generate", "+train", "-generate", "-train"]
    assert callback.stats.rewards_released == 0


def test_any_trainer_gets_one_train_phase_per_step() -> None:
    trainer = GRPOTrainer()
    callback = rl_trl.TimeSliceCallback()  # callbacks=[...]: the trainer is not known
    phases = begin_training(trainer, callback)
    trainer.callback = callback

    step(trainer, callback, TrainerControl())

    assert trainer.calls == ["generate@train", "rewards@train", "loss@train"]
    assert phases.log == ["+train", "-train"]


def test_a_trl_without_the_hooks_falls_back_to_whole_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Renamed(GRPOTrainer):
        _calculate_rewards = None

    Renamed.__name__ = "GRPOTrainer"
    trainer = Renamed()
    with caplog.at_level(logging.WARNING, logger="tslice.rl.trl"):
        callback = rl_trl.TimeSliceCallback.attach(trainer)
    assert "_calculate_rewards" in caplog.text
    phases = begin_training(trainer, callback)

    callback.on_step_begin(None, None, TrainerControl())
    trainer.compute_loss(trainer.model, [])
    callback.on_step_end(None, None, TrainerControl())

    assert phases.log == ["+train", "-train"]
    assert trainer.calls == ["loss@train"]
