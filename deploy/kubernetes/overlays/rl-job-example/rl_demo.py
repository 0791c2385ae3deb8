"""Stand-in for an RL job's trainer or sampler process: replace it with your own.

It reports its phases to tslice exactly as an RL framework integration does
(``tslice.rl.Phases``, configured by the TIMESLICE_* variables and TSLICE_ROLE), with
sleeps where the GPU work goes. A real process that holds GPU memory also calls
``tslice.workload.announce_process(job_id, group=...)`` once after CUDA is initialised,
so that the agent's cuda backend checkpoints it when the other job's turn comes.
"""

import os
import time

from tslice.rl import Phases

STEPS = int(os.environ.get("DEMO_STEPS", "20"))
WORK_S = float(os.environ.get("DEMO_WORK_S", "2"))


def main() -> None:
    with Phases.from_env() as phases:
        with phases.phase("init"):
            time.sleep(WORK_S)
        for step in range(STEPS):
            if phases.role.value == "trainer":
                with phases.phase("train"):
                    time.sleep(WORK_S)
                with phases.phase("weight_sync"):
                    time.sleep(WORK_S / 4)
            else:
                with phases.phase("generate"):
                    time.sleep(WORK_S)
            print(f"{phases.job_id} {phases.role.value}: step {step + 1}/{STEPS}", flush=True)


if __name__ == "__main__":
    main()
