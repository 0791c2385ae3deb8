"""TRL / transformers: time-slice a ``Trainer`` or TRL's ``GRPOTrainer`` with one line.

::

    from tslice.rl.trl import TimeSliceCallback

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    slicing = TimeSliceCallback.attach(trainer)      # the one line
    trainer.train()
    trainer.save_model()                             # the group is still held: weights resident
    slicing.close()                                  # yield, unregister (or let the process end)

Configuration comes from the environment (``TIMESLICE_JOB_ID``, ``TIMESLICE_ORCH_ADDR``,
``TIMESLICE_TRAINER_GROUP``, ``TSLICE_AGENT``... see :meth:`tslice.rl.Phases.from_env`);
without an orchestrator the callback is a no-op, said once on stderr.

What is offloaded: at ``on_train_begin`` the trainer's model (parameters, gradients,
buffers; LoRA parameters under their own tag), the optimizer's state and, for GRPO
with ``beta != 0``, the reference model are put in one
:class:`~tslice.workload.TorchAdapter`, registered with the node agent on the
workload channel. When another job takes the group, the agent tells this process to
copy those tensors to host memory and free them; the next grant brings them back,
bit for bit, into the same ``Parameter`` objects.

Where the phases are, and why these hooks:

* ``transformers`` callbacks see the optimizer step (``on_step_begin`` ...
  ``on_step_end``) but nothing inside ``training_step``, where GRPO generates,
  scores and computes the loss. The callback alone therefore makes the whole
  optimizer step one ``train`` phase, for any ``Trainer``
  (``callbacks=[TimeSliceCallback()]`` works too, with that granularity).
* :meth:`TimeSliceCallback.attach` also knows the trainer, and for a
  ``GRPOTrainer`` wraps three of its methods on the instance (no subclass, the class
  is untouched): ``_generate_and_score_completions`` begins ``generate`` (generation
  and the log-probability passes after it), ``_calculate_rewards`` runs with the
  group *released* (reward functions run on the CPU: another job uses the
  accelerator meanwhile), and ``compute_loss`` (public) begins ``train``, which lasts
  to the end of the optimizer step. TRL has no public hook between generation and
  scoring; these are private names, so a TRL without them falls back, with a
  warning, to one ``train`` phase per step. Reward functions that are models stay
  on the device and are scored with the group held.
* A step that is followed by an evaluation or a checkpoint keeps the group
  (``eval`` / ``save``) until ``on_evaluate`` / ``on_save``; the last step keeps it
  through the end of ``train()`` and after it, so that ``trainer.save_model()`` reads
  resident weights. :meth:`TimeSliceCallback.release` yields it then (the workload
  stays registered), :meth:`TimeSliceCallback.close` also unregisters.

A phase changes its label without a hand-over (the next phase begins before the
last one ends: the group is held once, see :mod:`tslice.rl._book`). Every phase of
this integration takes one group, the one the model lives on: TRL generates with
the training model itself, so the sampler group is not used (with vLLM in server
mode the vLLM server is a separate workload; time-slice it on its own).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tslice.client import Client
from tslice.common import errors
from tslice.rl import _base
from tslice.rl import phases as _phases
from tslice.rl.roles import Phase

if TYPE_CHECKING:
    from tslice.workload.adapters.torch import TorchAdapter

    # mypy checks this module without following transformers (it may be absent).
    _TrainerCallback = object
else:
    try:
        _transformers = importlib.import_module("transformers")
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":
            raise
        raise ImportError(
            "tslice.rl.trl needs transformers (and trl for GRPOTrainer): "
            "pip install transformers trl  (or pip install 'tslice[trl]')"
        ) from exc
    _TrainerCallback = _transformers.TrainerCallback

log = logging.getLogger(__name__)

__all__ = ["GRPO_HOOKS", "SliceStats", "TimeSliceCallback"]

#: The GRPOTrainer methods that :meth:`TimeSliceCallback.attach` wraps, in call order.
GRPO_HOOKS = ("_generate_and_score_completions", "_calculate_rewards", "compute_loss")

#: Adapter tag of GRPO's reference model (when ``beta != 0``).
REFERENCE_TAG = "reference"


@dataclasses.dataclass(frozen=True)
class SliceStats:
    """What the callback did (for logs and tests)."""

    #: Phases begun while the job held nothing (each one an Acquire).
    acquires: int = 0
    #: Of those, grants that brought the job's state back (another job had the group).
    restored: int = 0
    #: Time spent waiting for those grants.
    waited_ms: int = 0
    #: Reward scorings run with the group released.
    rewards_released: int = 0


class TimeSliceCallback(_TrainerCallback):
    """A ``transformers.TrainerCallback`` that reports the trainer's phases to tslice and
    lets the node agent offload the model and optimizer between them.

    Args:
        group: the group the model lives on; default ``$TSLICE_TRAINER_GROUP`` /
            ``$TIMESLICE_TRAINER_GROUP``, else the sampler group's variables, else
            ``$TSLICE_GROUP`` / ``$TIMESLICE_GROUP``.
        offload: register the model and optimizer with the agent (``TorchAdapter``);
            ``False`` when something else moves the state (e.g. the ``cuda`` backend).
        release_during_rewards: yield the group while GRPO's reward functions run
            (only with :meth:`attach`, and only when no reward function is a model).
        timeout: seconds a phase may wait for the group (``None``: as long as it takes).
        agent: the node agent's address (else ``$TSLICE_AGENT``, ``$TSLICE_AGENT_ADDR``).
        register_timeout: seconds to wait for the agent to acknowledge the registration.
        chunk_bytes: the ``TorchAdapter``'s copy size (``None``: its default).
    """

    def __init__(
        self,
        *,
        group: str | None = None,
        offload: bool = True,
        release_during_rewards: bool = True,
        timeout: float | None = None,
        agent: str | None = None,
        register_timeout: float | None = 30.0,
        chunk_bytes: int | None = None,
    ) -> None:
        self._group = group
        self._offload = offload
        self._release_during_rewards = release_during_rewards
        self._timeout = timeout
        self._agent = agent
        self._register_timeout = register_timeout
        self._chunk_bytes = chunk_bytes
        self._phases: _phases.Phases | None = None
        self._client: Client | None = None
        self._adapter: TorchAdapter | None = None
        self._trainer: Any = None
        self._wrapped: list[str] = []
        self._lazy_steps = False
        self._current: Phase | None = None
        self._closed = False
        self.stats = SliceStats()

    # -- set-up -----------------------------------------------------------------------

    @classmethod
    def attach(cls, trainer: Any, **options: Any) -> TimeSliceCallback:
        """Add a new callback to ``trainer`` and wrap its generation and scoring (GRPO).

        ``options`` are the constructor's. Returns the callback (``close()`` it when done).
        """
        callback = cls(**options)
        callback.bind(trainer)
        trainer.add_callback(callback)
        return callback

    def bind(self, trainer: Any) -> None:
        """Wrap ``trainer``'s GRPO methods (see the module docstring); other trainers
        keep one ``train`` phase per optimizer step."""
        if self._trainer is not None:
            if self._trainer is trainer:
                return
            raise RuntimeError("this TimeSliceCallback is already bound to another trainer")
        self._trainer = trainer
        missing = [name for name in GRPO_HOOKS if not callable(getattr(trainer, name, None))]
        if not _is_grpo(trainer):
            return
        if missing:
            log.warning(
                "tslice: this GRPOTrainer has no %s (another TRL version?): each optimizer "
                "step is one 'train' phase, generation and scoring included",
                ", ".join(missing),
            )
            return
        self._wrap("_generate_and_score_completions", self._generating)
        self._wrap("_calculate_rewards", self._scoring)
        self._wrap("compute_loss", self._computing_loss)
        self._lazy_steps = True

    def _wrap(self, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(self._trainer, name)
        setattr(self._trainer, name, functools.wraps(original)(wrapper(original)))
        self._wrapped.append(name)

    # -- facts ------------------------------------------------------------------------

    @property
    def phases(self) -> _phases.Phases | None:
        """The job's :class:`~tslice.rl.Phases` (made at ``on_train_begin``)."""
        return self._phases

    @property
    def adapter(self) -> TorchAdapter | None:
        """The ``TorchAdapter`` registered with the agent (``None`` before training)."""
        return self._adapter

    @property
    def current_phase(self) -> Phase | None:
        """The phase held now (``None``: the job holds nothing)."""
        return self._current

    # -- the end ----------------------------------------------------------------------

    def release(self) -> None:
        """Yield the group now (e.g. after the final save); the job stays registered,
        so that the agent can still offload it for the other jobs."""
        self._switch(None)

    def close(self) -> None:
        """Release, unregister from the agent, close the client, unwrap the trainer.
        Idempotent; the trainer can train again without time-slicing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._switch(None)
        finally:
            if self._phases is not None:
                self._phases.close()
            if self._client is not None:
                self._client.close()
            for name in self._wrapped:
                vars(self._trainer).pop(name, None)
            self._wrapped.clear()

    def __enter__(self) -> TimeSliceCallback:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- transformers callbacks ---------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._closed:
            raise RuntimeError("this TimeSliceCallback is closed; attach a new one")
        if self._phases is None:
            self._start(kwargs.get("model"), kwargs.get("optimizer"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._lazy_steps:
            self._switch(Phase.TRAIN)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_training_stop:
            self._switch(Phase.SAVE)  # the end of train(), then the user's save_model()
        elif control.should_evaluate:
            self._switch(Phase.EVAL)
        elif control.should_save:
            self._switch(Phase.SAVE)
        else:
            self._switch(None)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_evaluate:
            self._switch(Phase.EVAL)
        elif control.should_save:
            self._switch(Phase.SAVE)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # With save_strategy "best" the trainer decides to save only after this call.
        if control.should_save or control.should_training_stop or _saves_best(args):
            self._switch(Phase.SAVE)
        else:
            self._switch(None)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not control.should_training_stop:
            self._switch(None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._switch(Phase.SAVE)

    # -- GRPO wrappers ------------------------------------------------------------------

    def _generating(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_and_score(*args: Any, **kwargs: Any) -> Any:
            self._switch(Phase.GENERATE if self._training() else Phase.EVAL)
            return original(*args, **kwargs)

        return generate_and_score

    def _scoring(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            if not self._may_release_for_rewards():
                return original(*args, **kwargs)
            self._switch(None)
            self.stats = dataclasses.replace(
                self.stats, rewards_released=self.stats.rewards_released + 1
            )
            result = original(*args, **kwargs)
            # Advantages, the loss and the optimizer step follow.
            self._switch(Phase.TRAIN if self._training() else Phase.EVAL)
            return result

        return calculate_rewards

    def _computing_loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            self._switch(Phase.TRAIN if self._training() else Phase.EVAL)
            return original(*args, **kwargs)

        return compute_loss

    # -- plumbing -----------------------------------------------------------------------

    def _start(self, model: Any, optimizer: Any) -> None:
        group = self._group or _env_group()
        client = Client()  # made here to know, before registering, whether it is on
        try:
            workload = None
            if self._offload and model is not None:
                workload = self._adapter = self._make_adapter(model, optimizer)
                if client.enabled:
                    _check_movable(model, getattr(self._trainer, "ref_model", None))
            # One group for every phase: TRL generates with the training model itself.
            self._phases = _phases.Phases(
                trainer_group=group,
                sampler_group=group,
                role="colocated",
                client=client,
                timeout=self._timeout,
                workload=workload,
                agent=self._agent,
                register_timeout=self._register_timeout,
            )
        except BaseException:
            client.close()
            raise
        self._client = client
        if self._phases.enabled:
            log.info(
                "tslice: time-slicing job %r on group %r (offload: %s)",
                self._phases.job_id,
                group,
                ", ".join(self._adapter.tags) if self._adapter is not None else "off",
            )

    def _make_adapter(self, model: Any, optimizer: Any) -> TorchAdapter:
        from tslice.workload.adapters.torch import DEFAULT_CHUNK_BYTES, TorchAdapter

        adapter = TorchAdapter(
            model, _inner_optimizer(optimizer), chunk_bytes=self._chunk_bytes or DEFAULT_CHUNK_BYTES
        )
        reference = getattr(self._trainer, "ref_model", None)
        if reference is not None and reference is not model:
            tensors = dict(reference.named_parameters())
            tensors.update(reference.named_buffers())
            adapter.add_tensors(REFERENCE_TAG, tensors)
        return adapter

    def _switch(self, phase: Phase | None) -> None:
        """Hold ``phase`` (``None``: nothing). A new label is begun before the old one
        ends, so relabelling never yields the group."""
        current = self._current
        if phase == current or self._phases is None:
            return
        if phase is not None:
            grants = self._phases.begin(phase)
            if current is None:
                self.stats = dataclasses.replace(
                    self.stats,
                    acquires=self.stats.acquires + 1,
                    restored=self.stats.restored
                    + sum(1 for g in grants.values() if g.context_restored),
                    waited_ms=self.stats.waited_ms + sum(g.waited_ms for g in grants.values()),
                )
        self._current = phase
        if current is not None:
            self._phases.end(current)

    def _training(self) -> bool:
        model = getattr(self._trainer, "model", None)
        return bool(getattr(model, "training", True))

    def _may_release_for_rewards(self) -> bool:
        if not self._release_during_rewards or self._current is None:
            return False
        import torch

        funcs = getattr(self._trainer, "reward_funcs", ()) or ()
        return not any(isinstance(f, torch.nn.Module) for f in funcs)


def _is_grpo(trainer: Any) -> bool:
    return any(cls.__name__ == "GRPOTrainer" for cls in type(trainer).__mro__)


def _saves_best(args: Any) -> bool:
    return str(getattr(args, "save_strategy", "")).lower().endswith("best")


def _inner_optimizer(optimizer: Any) -> Any:
    """accelerate's ``AcceleratedOptimizer`` wraps the torch optimizer that owns the state."""
    return getattr(optimizer, "optimizer", optimizer)


def _check_movable(*modules: Any) -> None:
    """Refuse, before registering, tensors whose memory torch cannot free: the agent's
    first offload would fail and leave the job FAULTED, with the other jobs waiting."""
    for module in modules:
        if module is None:
            continue
        for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
            storage = tensor.untyped_storage()
            if tensor.device.type != "meta" and storage.nbytes() and not storage.resizable():
                raise errors.ConfigError(
                    f"tslice.rl.trl cannot offload {name}: its memory cannot be freed by torch "
                    "(on CPU, from_pretrained memory-maps the safetensors file). Copy the "
                    "weights into ordinary memory before training: for t in "
                    "[*model.parameters(), *model.buffers()]: t.data = t.data.clone()  "
                    "(weights on a GPU are ordinary memory already)"
                )


def _env_group() -> str | None:
    trainer, sampler = _base.env_groups()
    return trainer or sampler
