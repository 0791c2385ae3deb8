"""verl_timeslice: launch a verl PPO/GRPO job time-sliced by tslice.

The change to a verl job is one config key, ``trainer.v1.trainer_mode=timeslice``,
plus the job's tslice settings in the environment of verl's TaskRunner actor. This
launcher adds both to your usual verl command line and runs verl::

    # see what it adds (works anywhere tslice is installed):
    python examples/verl_timeslice.py --job-id job-a --dry-run -- \\
        data.train_files=$HOME/data/gsm8k/train.parquet actor_rollout_ref.model.path=Qwen/...

    # run it (verl installed with its engines and GPUs, as for any verl run):
    TIMESLICE_ORCH_ADDR=orchestrator:50051 python examples/verl_timeslice.py --job-id job-a -- ...

    # on a CPU machine with verl installed: is the mode registered, what does each hook take?
    python examples/verl_timeslice.py --check

By default rollout and training share the GPUs (verl's hybrid engine), i.e. one group
(``--group``); give ``--trainer-group`` and ``--sampler-group`` when they are separate
pools. The settings go to verl both as this process's environment (a Ray cluster that
verl starts inherits it) and as ``ray_kwargs.ray_init.runtime_env.env_vars`` (a Ray
cluster that was already running gets them through Ray).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import tslice.rl.ray
from tslice.rl import Phase, phase_groups

#: verl's hook -> the phase tslice reports there (tslice.rl.verl's table).
HOOKS = (
    ("init()", Phase.INIT),
    ("on_validate_begin .. on_validate_end", Phase.EVAL),
    ("on_step_begin .. on_sample_end (generation)", Phase.GENERATE),
    ("on_sample_end .. on_step_end (log-probs, update)", Phase.TRAIN),
    ("_save_checkpoint()", Phase.SAVE),
    ("on_step_end (update_weights)", Phase.WEIGHT_SYNC),
)


def settings(args: argparse.Namespace) -> dict[str, str]:
    """The environment verl's TaskRunner needs: tslice's settings, and the module that
    registers the ``timeslice`` mode (unless tslice's verl.plugins entry point does)."""
    pools = args.trainer_group or args.sampler_group
    env = tslice.rl.ray.env_vars(
        job_id=args.job_id,
        address=args.orchestrator,
        trainer_group=args.trainer_group,
        sampler_group=args.sampler_group,
        group=None if pools else args.group,
        role="colocated",  # the TaskRunner runs every phase of the job
    )
    env["VERL_USE_EXTERNAL_MODULES"] = "tslice.rl.verl"
    return env


def verl_command(env: dict[str, str], overrides: list[str]) -> list[str]:
    passed = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={v}" for k, v in env.items()]
    mode = "trainer.v1.trainer_mode=timeslice"
    return [sys.executable, "-m", "verl.trainer.main_ppo", mode, *passed, *overrides]


def check(args: argparse.Namespace) -> None:
    """Import verl, show the registered mode and the groups each hook takes."""
    os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "tslice.rl.verl")
    from verl.trainer.ppo import v1  # registers 'timeslice' through tslice.rl.verl

    trainer = v1.get_trainer_cls("timeslice")
    print(f"verl trainer mode 'timeslice' = {trainer.__module__}.{trainer.__name__}")
    print("  bases: " + " -> ".join(c.__name__ for c in trainer.__mro__[1:4]))
    pools = args.trainer_group or args.sampler_group
    trainer_group = args.trainer_group if pools else args.group
    sampler_group = args.sampler_group if pools else args.group
    for hook, phase in HOOKS:
        groups = phase_groups("colocated", phase, trainer_group, sampler_group)
        print(f"  {hook:48} {phase.value:12} takes {' + '.join(groups)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-id", help="unique per job (else $TSLICE_JOB_ID/$TIMESLICE_JOB_ID)")
    parser.add_argument("--orchestrator", help="host:port (else $TIMESLICE_ORCH_ADDR)")
    parser.add_argument("--group", default="gpus", help="the job's one group (hybrid engine)")
    parser.add_argument("--trainer-group", help="separate pools: the training GPUs' group")
    parser.add_argument("--sampler-group", help="separate pools: the rollout GPUs' group")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--check", action="store_true", help="verl installed? show the mapping")
    parser.add_argument("overrides", nargs="*", help="your verl overrides (after --)")
    args = parser.parse_args()
    if args.check:
        check(args)
        return
    env = settings(args)
    command = verl_command(env, args.overrides)
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), "\\")
        print("  " + " \\\n    ".join(shlex.quote(part) for part in command))
        return
    os.execvpe(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    main()
