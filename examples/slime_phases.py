"""slime_phases: two slime-style jobs time-sliced through tslice.rl.slime.TimesliceCallback.

slime's driver (``train.py``) calls its phase callback at every GPU phase boundary;
``--phase-callback-path tslice.rl.slime.TimesliceCallback`` makes those calls take
and yield the job's groups. This example needs no slime: each job replays the exact
hook calls of slime's ``train.py`` (init, then per rollout generate, train,
weight_sync, eval) with a little sleep standing in for the GPU work, and registers
a workload whose offload/restore commands it prints, so the hand-overs show.

Run it with an orchestrator and an app-channel agent started here::

    python examples/slime_phases.py [--rollouts 3]

or as one job of your own against running servers (the variables llm-d's slime
integration reads; without them the callback is a no-op and says so)::

    TIMESLICE_JOB_ID=job-a TIMESLICE_ORCH_ADDR=127.0.0.1:50051 \\
    TIMESLICE_TRAINER_GROUP=trainer TIMESLICE_SAMPLER_GROUP=sampler \\
    TSLICE_AGENT=127.0.0.1:9001 python examples/slime_phases.py job
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tslice.rl import Phases
from tslice.rl.slime import TimesliceCallback
from tslice.workload import CallbackAdapter

GROUPS = ("trainer", "sampler")
_started = time.monotonic()
_print_lock = threading.Lock()


def say(job: str, text: str) -> None:
    with _print_lock:
        print(f"{time.monotonic() - _started:6.2f}s  {job:6}  {text}", flush=True)


def workload(job: str, pool: str) -> CallbackAdapter:
    """Stands for the job's model on that pool: prints what the agent asks of it."""
    return CallbackAdapter(
        on_snapshot=lambda mode, tags: say(job, f"   agent: {pool} state offloaded ({mode})"),
        on_restore=lambda tags: say(job, f"   agent: {pool} state restored"),
    )


def slime_train_py(job: str, cb: TimesliceCallback, *, rollouts: int, work_s: float) -> None:
    """The phase-callback calls of slime's train.py, with sleeps for the GPU work."""

    def span(phase: str, role: str, rollout_id: int | None = None) -> None:
        context = None if rollout_id is None else {"rollout_id": rollout_id}
        waited = time.monotonic()
        cb.on_phase_begin(phase, role, context)
        say(job, f"{phase:<11} on {role:<7} (waited {time.monotonic() - waited:.2f}s)")
        time.sleep(work_s)
        cb.on_phase_end(phase, role, context)

    span("init", "both")
    for rollout_id in range(rollouts):
        span("generate", "sampler", rollout_id)
        time.sleep(work_s)  # reward scoring on the CPU: the other job may use the GPUs
        span("train", "trainer", rollout_id)
        span("weight_sync", "both", rollout_id)
        span("eval", "sampler", rollout_id)


def run_job(job: str, phases: Phases, *, rollouts: int, work_s: float) -> None:
    cb = TimesliceCallback(phases)
    try:
        slime_train_py(job, cb, rollouts=rollouts, work_s=work_s)
    finally:
        cb.close()


def demo(rollouts: int, work_s: float) -> int:
    """An orchestrator and an agent in a thread here, two jobs as threads."""
    with tempfile.TemporaryDirectory(prefix="slime_phases-") as tmp, _Servers(Path(tmp)) as srv:
        finished = threading.Barrier(2)

        def one(job: str) -> None:
            phases = Phases(
                job_id=job,
                address=srv.orchestrator,
                workload={pool: workload(job, pool) for pool in GROUPS},
                agent=srv.agent,
            )
            with phases:
                run_job(job, phases, rollouts=rollouts, work_s=work_s)
                # Stay registered until the other job needs nothing of ours moved.
                finished.wait(120)

        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for done in [pool.submit(one, "job-a"), pool.submit(one, "job-b")]:
                done.result()
    return 0


class _Servers:
    """Orchestrator (groups trainer and sampler on one node) and an app-channel agent,
    served by an event loop in a background thread."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.orchestrator = ""
        self.agent = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def __enter__(self) -> _Servers:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        from tslice.agent import app as agent_app
        from tslice.agent import config as agent_config
        from tslice.orchestrator import app as orchestrator_app
        from tslice.orchestrator import config as orchestrator_config

        self._stop = asyncio.Event()
        agent_cfg = agent_config.AgentConfig(
            node_name="node-a",
            port=0,
            state_dir=self.workdir / "agent",
            default_backend="app-channel",
        )
        self.agent = await self._serve(
            lambda ready: agent_app.serve(agent_cfg, ready=ready, stop=self._stop)
        )
        node = orchestrator_config.NodeRef("node-a", self.agent)
        orchestrator_cfg = orchestrator_config.OrchestratorConfig(
            topology=orchestrator_config.Topology(groups={g: (node,) for g in GROUPS}),
            port=0,
            state_dir=self.workdir / "orchestrator",
        )
        self.orchestrator = await self._serve(
            lambda ready: orchestrator_app.serve(orchestrator_cfg, ready=ready, stop=self._stop)
        )

    async def _serve(self, serve: object) -> str:
        address: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def ready(value: str) -> None:
            if not address.done():
                address.set_result(value)

        task = asyncio.create_task(serve(ready))  # type: ignore[operator]
        self._tasks.append(task)
        done, _ = await asyncio.wait({task, address}, return_when=asyncio.FIRST_COMPLETED)
        if address not in done:
            task.result()  # the server's start-up error
            raise RuntimeError("server stopped before it was ready")
        return address.result()

    async def _shutdown(self) -> None:
        if self._stop is not None:
            self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=["demo", "job"], default="demo")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--work-s", type=float, default=0.05, help="seconds of fake GPU work")
    args = parser.parse_args(argv)
    if args.command == "job":  # one job, configured like llm-d's slime integration
        phases = Phases.from_env(role="colocated")
        with phases:
            run_job(phases.job_id or "job", phases, rollouts=args.rollouts, work_s=args.work_s)
        return 0
    return demo(args.rollouts, args.work_s)


if __name__ == "__main__":
    sys.exit(main())
