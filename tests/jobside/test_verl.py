"""``tslice.rl.verl`` against the real verl trainer classes (verl 0.9.1, CPU).

verl's own control flow runs unchanged: ``PPOTrainer.init``/``fit``/``step``/``_step_once``,
``PPOTrainerSync``'s hooks (``on_init_end``, ``on_sample_end``, ``on_step_end``), its
trainer registry (``register_trainer``/``get_trainer_cls``) and its default hydra config
(``verl/trainer/config/ppo_trainer.yaml``). Only verl's calls *into* its worker groups,
rollout servers and TransferQueue are stand-ins that record what runs when, with the
signatures of ``verl/trainer/ppo/v1/trainer_base.py`` in 0.9.1:
``_setup(self)``, ``prepare_step(self) -> dict``, ``_balance_batch(self, batch, metrics,
logging_prefix="global_seqlen", keep_minibatch=False)``, ``_compute_old_log_prob``,
``_compute_ref_log_prob``, ``_compute_values``, ``_compute_advantage``,
``_update_critic``, ``_update_actor`` (each ``(self, batch, metrics)``),
``_save_checkpoint(self)``, ``_validate(self) -> dict``, ``_compute_metrics(self, batch,
metrics, timing_raw, global_steps, epoch)``; ``ReplayBuffer.sample(global_steps,
partition_id, batch_size) -> (batch, metrics)``; ``CheckpointEngineManager.update_weights(
global_steps)`` and ``.sleep_replicas()``; ``transfer_queue.kv_clear(keys, partition_id)``.

Each stand-in asks the orchestrator (a real one, ``stack``) who holds each group, so the
tests prove which groups each of verl's phases ran under, that two jobs never overlapped,
and, from the orchestrator's event stream, the order in which the hooks took and yielded
the groups.

Runs in a venv with verl (``make test-verl``); skipped elsewhere.
"""

from __future__ import annotations

import os
import pathlib
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

with warnings.catch_warnings():  # verl warns about every optional engine it lacks
    warnings.simplefilter("ignore")
    v1 = pytest.importorskip("verl.trainer.ppo.v1")
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import replay_buffer, trainer_base

import tslice
import tslice.rl.ray
import tslice.rl.verl
from tests.jobside.stack import running_stack
from tslice.client import EventKind
from tslice.rl import Phases

pytestmark = [
    pytest.mark.timeout(240),
    # verl's own notices (a critic disabled for GRPO, engines it lacks): not ours to fix
    pytest.mark.filterwarnings("ignore::UserWarning:verl"),
]

STEPS = 2
_ENV_PREFIXES = ("TSLICE_", "TIMESLICE_", "SNAPSHOT_AGENT_ADDR")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) and name != "TSLICE_SERVER_PYTHON":
            monkeypatch.delenv(name)
    # verl's fit() clears the batch from TransferQueue; there is none here.
    monkeypatch.setattr(trainer_base, "tq", types.SimpleNamespace(kv_clear=lambda **_: None))
    tslice.rl.ray.close()
    yield
    tslice.rl.ray.close()


def verl_config() -> Any:
    """verl's default config (V1 sync trainer, GRPO), two steps, validation before and at
    the end, a checkpoint every step."""
    config_dir = pathlib.Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                "algorithm.adv_estimator=grpo",
                "data.train_batch_size=4",
                "trainer.logger=[console]",
                f"trainer.total_training_steps={STEPS}",
                f"trainer.test_freq={STEPS}",
                "trainer.save_freq=1",
                "trainer.val_before_train=true",
                f"trainer.v1.trainer_mode={MODE}",  # what a user selects
            ],
        )


class _Recorder:
    """What the stand-ins saw: the call, the open phases, who held each group."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.rows: list[dict[str, Any]] = []

    def __call__(self, what: str) -> None:
        phases: Phases = self.trainer.tslice_phases
        groups = {g for g in (phases.trainer_group, phases.sampler_group) if g}
        holders = (
            {g: phases.client.status(g).locking_job for g in sorted(groups)}
            if phases.enabled
            else {}
        )
        self.rows.append(
            {
                "what": what,
                "job": phases.job_id,
                "open": tuple(p.value for p in phases.open_phases),
                "held": tuple(g for p in phases.open_phases for g in phases.groups_for(p)),
                "holders": holders,
            }
        )


class _Workers:
    """verl's calls into workers, rollout servers and storage, replaced (see module doc)."""

    fail_at: str = ""

    def _rec(self, what: str) -> None:
        if not hasattr(self, "recorder"):
            self.recorder = _Recorder(self)
        self.recorder(what)
        if what == self.fail_at:
            raise RuntimeError(f"worker failed in {what}")

    def _build_replay_buffer(self) -> Any:
        buffer = super()._build_replay_buffer()  # type: ignore[misc]  # verl's own choice

        def sample(global_steps: int, partition_id: str, batch_size: int) -> Any:
            self._rec("sample")
            batch = types.SimpleNamespace(extra_info={}, keys=[], tags=[], partition_id="train")
            return batch, {}

        buffer.sample = sample  # what the rollout servers would fill
        return buffer

    def _setup(self) -> None:
        self._rec("_setup")
        trainer = self

        class CheckpointEngineManager:
            def update_weights(self, global_steps: int | None = None) -> None:
                trainer._rec("update_weights")

            def sleep_replicas(self) -> None:
                trainer._rec("sleep_replicas")

        self.checkpoint_manager = CheckpointEngineManager()
        self.reward_loop_manager = types.SimpleNamespace(reward_loop_worker_handles=["reward"])
        self.steps_per_epoch, self.total_training_steps, self.global_steps = 10, STEPS, 0
        self._init_dump_executor()

    def prepare_step(self) -> dict[str, Any]:
        self._rec("prepare_step")
        return {}

    def _balance_batch(self, batch: Any, metrics: Any, logging_prefix: str = "", **_: Any) -> Any:
        return batch

    def _compute_old_log_prob(self, batch: Any, metrics: Any) -> Any:
        self._rec("old_log_prob")
        return batch

    def _compute_ref_log_prob(self, batch: Any, metrics: Any) -> Any:
        self._rec("ref")
        return batch

    def _compute_values(self, batch: Any, metrics: Any) -> Any:
        self._rec("values")
        return batch

    def _compute_advantage(self, batch: Any, metrics: Any) -> Any:
        self._rec("adv")
        return batch

    def _update_critic(self, batch: Any, metrics: Any) -> Any:
        self._rec("update_critic")
        return batch

    def _update_actor(self, batch: Any, metrics: Any) -> Any:
        self._rec("update_actor")
        return batch

    def _save_checkpoint(self) -> None:
        self._rec("save_checkpoint")

    def _validate(self) -> dict[str, float]:
        self._rec("validate")
        return {"val/score": 1.0}

    def _compute_metrics(self, *args: Any, **kwargs: Any) -> None:
        pass


#: verl's sync trainer over the stand-ins, time-sliced: registered as its own mode.
MODE = "timeslice_stand_ins"
Trainer = tslice.rl.verl.register(MODE, base=type("StandInSync", (_Workers, v1.PPOTrainerSync), {}))

# What verl 0.9.1's sync trainer runs, in order, and the phases open meanwhile.
_STEP = [
    ("prepare_step", ("generate",)),
    ("sample", ("generate",)),
    ("sleep_replicas", ("generate",)),
    ("old_log_prob", ("train",)),
    ("adv", ("train",)),
    ("update_actor", ("train",)),
    ("save_checkpoint", ("train", "save")),
    ("update_weights", ("weight_sync",)),
]
EXPECTED = [
    ("_setup", ("init",)),
    ("update_weights", ("init",)),  # on_init_end: the first weight sync
    ("validate", ("eval",)),
    *_STEP * STEPS,
    ("validate", ("eval",)),
]


def _run(trainer: Any, failures: list[BaseException]) -> None:
    """What verl's TaskRunnerV1.run does with the trainer."""
    try:
        trainer.init()
        trainer.fit(agent_loop_manager=None)
    except BaseException as exc:
        failures.append(exc)


def test_the_timeslice_mode_is_verls_sync_trainer_with_the_hooks() -> None:
    registered = v1.get_trainer_cls(tslice.rl.verl.TRAINER_MODE)
    assert issubclass(registered, tslice.rl.verl.TimeSliceHooks)
    assert issubclass(registered, v1.PPOTrainerSync)
    assert registered.__mro__.index(tslice.rl.verl.TimeSliceHooks) < registered.__mro__.index(
        v1.PPOTrainerSync
    )
    assert tslice.rl.verl.register() is registered  # idempotent


def test_the_trainer_runs_as_verls_sync_mode() -> None:
    """verl tests the mode's name (replay buffer, storage, checkpoints): selected as
    ``timeslice``, the trainer is verl's ``sync`` trainer inside."""
    config = verl_config()
    assert v1.get_trainer_cls(config.trainer.v1.trainer_mode) is Trainer
    trainer = Trainer(config=config)
    assert trainer.trainer_mode == config.trainer.v1.trainer_mode == "sync"
    assert type(trainer.replay_buffer) is replay_buffer.ReplayBuffer  # not ReplayBufferAsync


def test_two_jobs_phases_map_to_groups_and_exclude_each_other(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, backend="noop") as stack:

        def make(job: str) -> Any:
            trainer = Trainer(config=verl_config())
            # Two trainers in one test process: each its own Phases (verl runs one
            # trainer per TaskRunner process, which takes the process's Phases).
            trainer.tslice_make_phases = lambda: Phases(job_id=job, address=stack.address)
            return trainer

        trainers = {job: make(job) for job in ("job-a", "job-b")}
        with tslice.Client(stack.address, job_id=None) as observer:
            events = observer.watch_events(kinds=(EventKind.GRANTED, EventKind.YIELDED))
            failures: list[BaseException] = []
            threads = [threading.Thread(target=_run, args=(t, failures)) for t in trainers.values()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not failures, failures
            # The stream has everything up to here once it shows an acquire made after.
            observer.acquire("trainer", job_id="zz-end")
            seen = []
            for event in events:
                if event.job_id == "zz-end":
                    break
                seen.append((event.job_id, event.kind.value, event.group_id))
            events.close()
            observer.yield_("trainer", job_id="zz-end")

    for job, trainer in trainers.items():
        rows = trainer.recorder.rows
        assert [(r["what"], r["open"]) for r in rows] == EXPECTED
        for r in rows:
            assert all(r["holders"][g] == job for g in r["held"]), r
            assert set(r["holders"].values()) <= {job, ""}, f"{job} ran {r} beside another job"
        expected_groups = {
            "init": {"trainer", "sampler"},
            "eval": {"sampler"},
            "generate": {"sampler"},
            "train": {"trainer"},
            "save": {"trainer"},
            "weight_sync": {"trainer", "sampler"},
        }
        for r in rows:
            assert set(r["held"]) == set().union(*(expected_groups[p] for p in r["open"])), r

        # The order the hooks took (GRANTED) and yielded the groups, per the orchestrator.
        step = [
            ("GRANTED", "sampler"),  # on_step_begin: generate
            ("YIELDED", "sampler"),  # on_sample_end: generate ends first (the trainer
            ("GRANTED", "trainer"),  # group is taken only without the sampler group)
            ("GRANTED", "sampler"),  # on_step_end: weight_sync joins train's trainer group
            ("YIELDED", "sampler"),
            ("YIELDED", "trainer"),
        ]
        assert [(k, g) for j, k, g in seen if j == job] == [
            ("GRANTED", "trainer"),  # init: trainer group first
            ("GRANTED", "sampler"),
            ("YIELDED", "sampler"),
            ("YIELDED", "trainer"),
            ("GRANTED", "sampler"),  # validation before training
            ("YIELDED", "sampler"),
            *step * STEPS,
            ("GRANTED", "sampler"),  # validation at the last step
            ("YIELDED", "sampler"),
        ]


def test_one_group_from_the_environment_is_held_once_per_step(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rollout and training on the same GPUs (verl's hybrid engine): one group, taken by
    the process's Phases from llm-d's variables; each step acquires it once."""
    with running_stack(tmp_path, groups=("gpus",), backend="noop") as stack:
        monkeypatch.setenv("TIMESLICE_ORCH_ADDR", stack.address)
        monkeypatch.setenv("TIMESLICE_JOB_ID", "job-h")
        monkeypatch.setenv("TIMESLICE_GROUP", "gpus")
        trainer = Trainer(config=verl_config())
        with tslice.Client(stack.address, job_id=None) as observer:
            events = observer.watch_events("gpus", kinds=(EventKind.GRANTED,))
            trainer.init()
            trainer.fit(agent_loop_manager=None)
            assert trainer.tslice_phases is tslice.rl.ray.phases()
            observer.acquire("gpus", job_id="zz-end")
            grants = []
            for event in events:
                if event.job_id == "zz-end":
                    break
                grants.append(event.job_id)
            events.close()
    rows = trainer.recorder.rows
    assert [(r["what"], r["open"]) for r in rows] == EXPECTED
    assert all(r["holders"] == {"gpus": "job-h"} for r in rows)
    # init, validation, each step (generate -> train -> weight_sync without a gap), validation
    assert grants == ["job-h"] * (1 + 1 + STEPS + 1)


def test_without_an_orchestrator_verl_runs_as_it_would(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = Trainer(config=verl_config())
    trainer.init()
    trainer.fit(agent_loop_manager=None)
    assert [(r["what"], r["open"]) for r in trainer.recorder.rows] == EXPECTED
    assert not trainer.tslice_phases.enabled
    assert capsys.readouterr().err.count("time-slicing is off") <= 1


def test_a_failing_step_yields_what_it_held(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, backend="noop") as stack:
        trainer = Trainer(config=verl_config())
        trainer.fail_at = "update_actor"
        trainer.tslice_make_phases = lambda: Phases(job_id="job-f", address=stack.address)
        trainer.init()
        with pytest.raises(RuntimeError, match="update_actor"):
            trainer.fit(agent_loop_manager=None)
        assert trainer.recorder.rows[-1]["holders"] == {"trainer": "job-f", "sampler": ""}
        assert trainer.tslice_phases.open_phases == ()
        with tslice.Client(stack.address, job_id=None) as observer:
            assert {g: observer.status(g).locking_job for g in stack.groups} == {
                "trainer": "",
                "sampler": "",
            }
