"""rl_tiny: two real PyTorch training jobs time-sliced through tslice, bit for bit.

Each job trains a small policy (a 2-layer MLP) with REINFORCE on a contextual
bandit, deterministically on CPU. Both jobs share one group ("trainer"): around
every training step a job acquires the group and yields it afterwards, and at
every hand-over the node agent tells the outgoing job, over its workload
channel, to offload its weights and Adam state (TorchAdapter), then tells the
incoming one to bring its own back. Training code is unchanged apart from the
``with client.slice(...)`` block; the proof is that each job ends with exactly
the weights and optimizer state of the same seed trained alone.

Run the whole proof (an orchestrator and an agent in this process, two
time-sliced jobs and two standalone references as subprocesses)::

    python examples/rl_tiny.py [--steps 20] [--workdir DIR]

or one job by hand against running servers, or without the platform::

    python examples/rl_tiny.py job --job-id job-a --seed 1 --out a.pt \\
        --orchestrator 127.0.0.1:50051 --agent 127.0.0.1:9001
    python examples/rl_tiny.py job --standalone --job-id job-a --seed 1 --out a-ref.pt

A job started with ``--barrier`` speaks a line protocol on stdin/stdout so that
the launcher can start both jobs' training together: it prints ``ready`` once
registered and waits for ``go``; after training it prints ``done`` and waits for
``exit`` (it must stay reachable until the other job no longer needs to switch
it out).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import torch

import tslice
import tslice.workload

GROUP = "trainer"
CONTEXT_DIM = 8
ACTIONS = 4
HIDDEN = 32
BATCH = 64
LEARNING_RATE = 0.03
DEFAULT_STEPS = 20
DEFAULT_SEEDS = (1, 2)


# ---- the training job --------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """A policy, its optimizer, and the bandit it learns (the environment stays on the host)."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Hidden truth of the bandit: the best action for context x is argmax(task @ x).
    task: torch.Tensor
    generator: torch.Generator


def make_job(seed: int) -> Job:
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(
        torch.nn.Linear(CONTEXT_DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, ACTIONS)
    )
    optimizer = torch.optim.Adam(policy.parameters(), lr=LEARNING_RATE)
    generator = torch.Generator().manual_seed(seed + 1000)
    task = torch.randn(ACTIONS, CONTEXT_DIM, generator=generator)
    return Job(policy=policy, optimizer=optimizer, task=task, generator=generator)


def sample_contexts(job: Job) -> torch.Tensor:
    """Environment work, done without holding the accelerators."""
    return torch.randn(BATCH, CONTEXT_DIM, generator=job.generator)


def train_step(job: Job, contexts: torch.Tensor) -> float:
    """One REINFORCE step with a mean-reward baseline; returns the mean reward."""
    logits = job.policy(contexts)
    probs = torch.softmax(logits.detach(), dim=-1)
    actions = torch.multinomial(probs, 1, generator=job.generator).squeeze(1)
    rewards = (actions == (contexts @ job.task.T).argmax(dim=-1)).float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(1, actions[:, None]).squeeze(1)
    loss = -((rewards - rewards.mean()) * log_probs).mean()
    job.optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    job.optimizer.step()
    return float(rewards.mean())


def final_state(job: Job) -> dict[str, Any]:
    return {"policy": job.policy.state_dict(), "optimizer": job.optimizer.state_dict()}


def train(job: Job, client: tslice.Client, *, steps: int, group: str, out: Path) -> list[float]:
    """The training loop: unchanged but for the ``client.slice`` blocks."""
    rewards = []
    for _ in range(steps):
        contexts = sample_contexts(job)
        with client.slice(group):
            rewards.append(train_step(job, contexts))
    # The state is read on the device, so the job must hold the group while saving.
    with client.slice(group):
        torch.save(final_state(job), out)
    return rewards


def _deterministic() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def run_job(args: argparse.Namespace) -> int:
    """One job, time-sliced (``--orchestrator``/``--agent``) or alone (``--standalone``)."""
    _deterministic()
    if args.standalone:
        os.environ["TSLICE_DISABLED"] = "1"  # the client becomes a no-op
    client = tslice.Client(
        None if args.standalone else args.orchestrator, job_id=args.job_id, default_group=args.group
    )
    job = make_job(args.seed)
    adapter = tslice.workload.TorchAdapter(job.policy, job.optimizer)
    handle = None
    if not args.standalone:
        handle = tslice.workload.register_workload(
            args.agent, args.job_id, args.group, workload=adapter
        )
        if not handle.wait_registered(timeout=args.register_timeout):
            raise SystemExit(f"agent {args.agent} did not accept the workload registration")
    _barrier(args, say="ready", expect="go")

    started = time.monotonic()
    rewards = train(job, client, steps=args.steps, group=args.group, out=args.out)
    train_s = time.monotonic() - started

    _barrier(args, say="done", expect="exit")
    if handle is not None:
        handle.close()
    client.close()
    report = {
        "job_id": args.job_id,
        "seed": args.seed,
        "steps": len(rewards),
        "standalone": args.standalone,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "train_s": round(train_s, 3),
        **dataclasses.asdict(adapter.stats),
    }
    Path(f"{args.out}.json").write_text(json.dumps(report))
    return 0


def run_references(args: argparse.Namespace) -> int:
    """Several jobs alone, one after the other, in this process (one torch import for all)."""
    _deterministic()
    os.environ["TSLICE_DISABLED"] = "1"
    for spec in args.job:
        job_id, _, seed = spec.partition(":")
        with tslice.Client(None, job_id=job_id, default_group=GROUP) as client:
            out = args.workdir / f"{job_id}-standalone.pt"
            train(make_job(int(seed)), client, steps=args.steps, group=GROUP, out=out)
    return 0


def _barrier(args: argparse.Namespace, *, say: str, expect: str) -> None:
    if not args.barrier:
        return
    print(say, flush=True)
    line = sys.stdin.readline().strip()
    if line != expect:
        raise SystemExit(f"launcher said {line!r}, expected {expect!r}")


# ---- the proof: platform in-process, jobs as subprocesses ----------------------------------


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    job_id: str
    seed: int
    sliced: Path
    standalone: Path
    report: dict[str, Any]
    identical: bool


async def run_proof(
    *, workdir: Path, steps: int = DEFAULT_STEPS, seeds: Sequence[int] = DEFAULT_SEEDS
) -> list[JobOutcome]:
    """Start an agent and an orchestrator here, run the jobs time-sliced and standalone,
    and compare their final states tensor by tensor."""
    from tslice.agent import app as agent_app
    from tslice.agent import config as agent_config
    from tslice.orchestrator import app as orchestrator_app
    from tslice.orchestrator import config as orchestrator_config

    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    stop = asyncio.Event()
    servers: list[asyncio.Task[None]] = []
    try:
        agent_cfg = agent_config.AgentConfig(
            node_name="node-a",
            port=0,
            state_dir=workdir / "agent",
            default_backend="app-channel",
        )
        agent_address = await _start(
            servers, lambda ready: agent_app.serve(agent_cfg, ready=ready, stop=stop)
        )
        orchestrator_cfg = orchestrator_config.OrchestratorConfig(
            topology=orchestrator_config.Topology(
                groups={GROUP: (orchestrator_config.NodeRef("node-a", agent_address),)}
            ),
            port=0,
            state_dir=workdir / "orchestrator",
        )
        orchestrator_address = await _start(
            servers, lambda ready: orchestrator_app.serve(orchestrator_cfg, ready=ready, stop=stop)
        )
        jobs = [(f"job-{chr(ord('a') + i)}", seed) for i, seed in enumerate(seeds)]
        references = _run_references(jobs, steps=steps, workdir=workdir)
        sliced = _run_sliced(
            jobs,
            steps=steps,
            workdir=workdir,
            servers=["--orchestrator", orchestrator_address, "--agent", agent_address],
        )
        await _all_or_nothing(sliced, references)
    finally:
        stop.set()
        await asyncio.gather(*servers, return_exceptions=True)

    return await asyncio.to_thread(_compare, workdir, jobs)


def _compare(workdir: Path, jobs: Sequence[tuple[str, int]]) -> list[JobOutcome]:
    outcomes = []
    for job_id, seed in jobs:
        sliced_path = workdir / f"{job_id}-sliced.pt"
        standalone_path = workdir / f"{job_id}-standalone.pt"
        report = json.loads(Path(f"{sliced_path}.json").read_text())
        identical = states_identical(torch.load(sliced_path), torch.load(standalone_path))
        outcomes.append(JobOutcome(job_id, seed, sliced_path, standalone_path, report, identical))
    return outcomes


def states_identical(a: Any, b: Any) -> bool:
    """Same structure and, for every tensor, same dtype, shape and values (torch.equal)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(states_identical(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


async def _start(
    servers: list[asyncio.Task[None]],
    serve: Callable[[Callable[[str], None]], Coroutine[Any, Any, None]],
) -> str:
    """Run ``serve(ready)`` as a task in ``servers``; return the address it reports."""
    address: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def ready(value: str) -> None:
        if not address.done():
            address.set_result(value)

    task = asyncio.create_task(serve(ready))
    servers.append(task)
    either: set[asyncio.Future[Any]] = {task, address}
    done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if address not in done:
        task.result()  # raises the server's start-up error
        raise RuntimeError("server stopped before it was ready")
    return address.result()


async def _spawn(args: list[str], *, log: Path, barrier: bool) -> asyncio.subprocess.Process:
    with log.open("wb") as stderr:  # the child keeps its own copy of the descriptor
        return await asyncio.create_subprocess_exec(
            *(sys.executable, __file__, *args),
            stdin=asyncio.subprocess.PIPE if barrier else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )


async def _run_references(jobs: Sequence[tuple[str, int]], *, steps: int, workdir: Path) -> None:
    specs = [arg for job_id, seed in jobs for arg in ("--job", f"{job_id}:{seed}")]
    log = workdir / "standalone.log"
    process = await _spawn(
        ["standalone", *specs, "--steps", str(steps), "--workdir", str(workdir)],
        log=log,
        barrier=False,
    )
    try:
        await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    _check_exit(process, log)


async def _all_or_nothing(*coroutines: Coroutine[Any, Any, None]) -> None:
    """Run together; if one fails, cancel the others (their processes get killed)."""
    running = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*running)
    except BaseException:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        raise


async def _run_sliced(
    jobs: Sequence[tuple[str, int]], *, steps: int, workdir: Path, servers: list[str]
) -> None:
    processes: list[tuple[asyncio.subprocess.Process, Path]] = []
    try:
        for job_id, seed in jobs:
            out = workdir / f"{job_id}-sliced.pt"
            args = ["job", "--job-id", job_id, "--seed", str(seed), "--steps", str(steps)]
            args += ["--group", GROUP, "--out", str(out), "--barrier", *servers]
            log = workdir / f"{job_id}-sliced.log"
            processes.append((await _spawn(args, log=log, barrier=True), log))
        # Training starts only when every job is registered, so that they really alternate.
        for word, reply in (("ready", "go"), ("done", "exit")):
            for process, log in processes:
                await _expect(process, word, log)
            for process, _ in processes:
                assert process.stdin is not None
                process.stdin.write(f"{reply}\n".encode())
                await process.stdin.drain()
        for process, log in processes:
            await process.wait()
            _check_exit(process, log)
    finally:
        for process, _ in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _expect(process: asyncio.subprocess.Process, word: str, log: Path) -> None:
    assert process.stdout is not None
    line = (await process.stdout.readline()).decode().strip()
    if line != word:
        await process.wait()
        raise RuntimeError(f"{log.stem}: expected {word!r}, got {line!r}; its log:\n{_tail(log)}")


def _check_exit(process: asyncio.subprocess.Process, log: Path) -> None:
    if process.returncode != 0:
        raise RuntimeError(f"{log.stem} exited with {process.returncode}; its log:\n{_tail(log)}")


def _tail(log: Path, *, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


# ---- command line -------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary dir")
    sub = parser.add_subparsers(dest="command")
    job = sub.add_parser("job", help="run one training job")
    job.add_argument("--job-id", required=True)
    job.add_argument("--seed", type=int, required=True)
    job.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    job.add_argument("--group", default=GROUP)
    job.add_argument("--out", type=Path, required=True, help="final state (torch.save)")
    job.add_argument("--orchestrator", help="orchestrator address (else $TSLICE_ORCHESTRATOR)")
    job.add_argument("--agent", help="node agent address (else $TSLICE_AGENT_ADDR)")
    job.add_argument("--standalone", action="store_true", help="train without the platform")
    job.add_argument("--barrier", action="store_true", help="line protocol with the launcher")
    job.add_argument("--register-timeout", type=float, default=30.0)
    refs = sub.add_parser("standalone", help="run several jobs alone, one after the other")
    refs.add_argument("--job", action="append", required=True, help="JOB_ID:SEED (repeatable)")
    refs.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    refs.add_argument("--workdir", type=Path, required=True, help="writes JOB_ID-standalone.pt")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "job":
        return run_job(args)
    if args.command == "standalone":
        return run_references(args)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="rl_tiny-") as tmp:
        workdir = args.workdir or Path(tmp)
        outcomes = asyncio.run(run_proof(workdir=workdir, steps=args.steps))
        for o in outcomes:
            r = o.report
            print(
                f"{o.job_id} (seed {o.seed}): {r['steps']} steps, reward {r['reward_first']:.2f}"
                f" -> {r['reward_last']:.2f}, offloaded {r['snapshots']}x"
                f" ({r['bytes_out']} bytes in all), restored {r['restores']}x;"
                f" bit-identical to standalone: {'yes' if o.identical else 'NO'}"
            )
    return 0 if all(o.identical for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
