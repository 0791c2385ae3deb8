"""ray_two_jobs: two RL jobs on Ray, each a trainer actor and a sampler actor, time-sliced.

Every actor makes its own tslice client from the environment that the driver hands it
through ``runtime_env`` (``tslice.rl.ray.env_vars``); the driver runs each job's
synchronous loop (generate -> train -> weight sync) as veRL's or OpenRLHF's controller
does, both jobs at once, and prints who waited for whom::

    pip install ray                                   # next to tslice
    tslice up --group trainer --group sampler &       # orchestrator + simulated agents
    TSLICE_ORCHESTRATOR=127.0.0.1:50051 python examples/ray_two_jobs.py --steps 3

Without ``TSLICE_ORCHESTRATOR`` (or ``TIMESLICE_ORCH_ADDR``) the same script runs with
time-slicing off, as a training script must. The "GPU work" here is a short sleep.
Ray is started on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback-only local Ray

import ray

import tslice.rl.ray

WORK_S = 0.2  # stands for a phase's accelerator time


class Actor:
    """One role of a job: its phases are this process's ``tslice.rl.ray.phases()``."""

    def __init__(self) -> None:
        self.phases = tslice.rl.ray.phases()  # role from $TSLICE_ROLE (runtime_env)

    def run(self, phase: str, step: int) -> str:
        with self.phases.phase(phase) as grants:
            time.sleep(WORK_S)
        waited = sum(grant.waited_ms for grant in grants.values())
        held = "+".join(grants) or "-"
        who = f"{self.phases.job_id} {self.phases.role.value:7}"
        return f"{who} {phase:11} step {step}  held {held:15} waited {waited:5d} ms"

    def begin(self, phase: str) -> None:
        self.phases.begin(phase)  # hook style: the phase stays open across calls

    def end(self, phase: str) -> None:
        self.phases.end(phase)

    def receive_weights(self, step: int) -> str:
        time.sleep(WORK_S / 2)  # inside the trainer's weight_sync window: it holds both groups
        return f"{self.phases.job_id} {self.phases.role.value:7} {'(receive)':11} step {step}"


def job_loop(
    job: str, args: argparse.Namespace, out: list[str], failed: list[BaseException]
) -> None:
    try:
        _loop(job, args, out)
    except BaseException as exc:
        failed.append(exc)


def _loop(job: str, args: argparse.Namespace, out: list[str]) -> None:
    # The driver's TSLICE_*/TIMESLICE_* variables, plus this job's id and groups.
    env = tslice.rl.ray.env_vars(
        job_id=job, trainer_group=args.trainer_group, sampler_group=args.sampler_group
    )
    steps = args.steps
    make = ray.remote(Actor).options
    trainer = make(runtime_env={"env_vars": {**env, "TSLICE_ROLE": "trainer"}}).remote()
    sampler = make(runtime_env={"env_vars": {**env, "TSLICE_ROLE": "sampler"}}).remote()
    out += ray.get([trainer.run.remote("init", 0), sampler.run.remote("init", 0)])
    for step in range(steps):
        out.append(ray.get(sampler.run.remote("generate", step)))
        out.append(ray.get(trainer.run.remote("train", step)))
        ray.get(trainer.begin.remote("weight_sync"))
        out.append(ray.get(sampler.receive_weights.remote(step)))
        ray.get(trainer.end.remote("weight_sync"))
    out += ray.get([sampler.run.remote("eval", steps), trainer.run.remote("save", steps)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trainer-group", default="trainer")
    parser.add_argument("--sampler-group", default="sampler")
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        logs: dict[str, list[str]] = {"job-a": [], "job-b": []}
        failed: list[BaseException] = []
        threads = [
            threading.Thread(target=job_loop, args=(job, args, out, failed))
            for job, out in logs.items()
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for job, lines in logs.items():
            print(f"--- {job}")
            print("\n".join(lines))
        if failed:
            raise failed[0]
        print(f"both jobs done in {time.monotonic() - started:.1f} s")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
