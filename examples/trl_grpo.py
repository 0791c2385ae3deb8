"""trl_grpo: two TRL GRPO jobs time-sliced through tslice, ending as if each ran alone.

Each job trains a tiny Llama (built from a config, random weights) with TRL's
``GRPOTrainer`` on CPU: a word-level tokenizer made in memory, sixteen two-word
prompts, and a reward function that counts the even-numbered words of the completion.
Nothing is downloaded. The only line that time-slices it::

    slicing = TimeSliceCallback.attach(trainer)

Both jobs share one group ("trainer"). A job holds it while it generates, releases it
while its reward function runs, holds it again for the loss and the optimizer step,
and releases it between steps. Whenever the other job takes the group, the node agent
tells this one, over its workload channel, to copy its model and AdamW state to host
memory and free them (``TorchAdapter``), and brings them back at its next grant. The
proof is that each job ends with exactly the weights and optimizer state of the same
seed trained alone.

The whole proof (an app-channel agent and an orchestrator as subprocesses, two
time-sliced jobs and the standalone references)::

    python examples/trl_grpo.py [--steps 4] [--workdir DIR]

One job by hand, against running servers or without the platform::

    TIMESLICE_JOB_ID=job-a TIMESLICE_ORCH_ADDR=127.0.0.1:50051 \\
    TIMESLICE_TRAINER_GROUP=trainer TSLICE_AGENT=127.0.0.1:9001 \\
        python examples/trl_grpo.py job --seed 1 --out a.pt
    TSLICE_DISABLED=1 python examples/trl_grpo.py job --seed 1 --out a-ref.pt

A job started with ``--barrier`` speaks a line protocol with its launcher (on its
original stdout; everything the trainer prints goes to stderr): it says ``ready``
once registered with the agent and waits for ``go``; after training and saving it
releases the group, says ``done`` and waits for ``exit``, staying reachable until the
other job no longer needs to switch it out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")  # never reach for a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GROUP = "trainer"
DEFAULT_STEPS = 4
DEFAULT_SEEDS = (1, 2)
WORDS = 24
TARGETS = frozenset(f"w{i}" for i in range(0, WORDS, 2))  # the reward counts these words
PROMPTS = 16
COMPLETION_TOKENS = 6
GENERATIONS = 4  # completions per prompt; also the batch (one prompt per step)


# ---- the training job ----------------------------------------------------------------------


def make_tokenizer() -> Any:
    """A word-level tokenizer built in memory: ``<pad>``, ``<eos>``, ``<unk>``, w0..w23."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(WORDS))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def make_model(seed: int, tokenizer: Any) -> Any:
    """A one-layer Llama with random weights drawn from ``seed``."""
    import transformers

    transformers.set_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return transformers.LlamaForCausalLM(config)


def reward_even_words(completions: list[str], **_: Any) -> list[float]:
    """CPU work between generation and the loss: the group is released meanwhile."""
    return [float(sum(word in TARGETS for word in c.split())) for c in completions]


def make_trainer(seed: int, *, steps: int, output_dir: Path) -> Any:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = make_tokenizer()
    model = make_model(seed, tokenizer)
    prompts = [f"w{i % WORDS} w{(3 * i + 1) % WORDS}" for i in range(PROMPTS)]
    args = GRPOConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION_TOKENS,
        learning_rate=1e-2,
        seed=seed,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_even_words,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )


def final_state(trainer: Any) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
    }


def _deterministic() -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def run_job(args: argparse.Namespace) -> int:
    """One job: time-sliced when the environment names an orchestrator, else alone."""
    protocol = _take_stdout() if args.barrier else None
    _deterministic()
    import torch

    from tslice.rl.trl import TimeSliceCallback

    trainer = make_trainer(args.seed, steps=args.steps, output_dir=args.out.parent / "trainer")
    torch.save(trainer.model.state_dict(), f"{args.out}.initial")  # to show training moved it
    slicing = TimeSliceCallback.attach(trainer)
    if protocol is not None:
        trainer.add_callback(_barrier_callback(protocol))  # runs after the registration
    started = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - started
    # The group is still held ("save"): the weights are on the device.
    torch.save(final_state(trainer), args.out)
    slicing.release()
    if protocol is not None:
        _barrier(protocol, say="done", expect="exit")
    slicing.close()
    adapter = slicing.adapter
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    phases = slicing.phases
    report = {
        "seed": args.seed,
        "steps": trainer.state.global_step,
        "sliced": phases is not None and phases.enabled,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "train_s": round(train_s, 3),
        "callback": dataclasses.asdict(slicing.stats),
        "adapter": dataclasses.asdict(adapter.stats) if adapter is not None else None,
        "tags": adapter.tags if adapter is not None else [],
    }
    Path(f"{args.out}.json").write_text(json.dumps(report))
    return 0


def run_references(args: argparse.Namespace) -> int:
    """Several seeds alone, one after the other, in this process (one import for all)."""
    os.environ["TSLICE_DISABLED"] = "1"
    _deterministic()
    import torch

    for spec in args.job:
        job_id, _, seed = spec.partition(":")
        out = args.workdir / f"{job_id}-standalone.pt"
        trainer = make_trainer(int(seed), steps=args.steps, output_dir=args.workdir / job_id)
        trainer.train()
        torch.save(final_state(trainer), out)
    return 0


def _barrier_callback(protocol: IO[str]) -> Any:
    """Says ``ready`` once training has begun (the workload is registered by then)."""
    from transformers import TrainerCallback

    class Barrier(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _barrier(protocol, say="ready", expect="go")

    return Barrier()


def _take_stdout() -> IO[str]:
    """The protocol keeps the original stdout; anything else printed goes to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def _barrier(protocol: IO[str], *, say: str, expect: str) -> None:
    protocol.write(f"{say}\n")
    protocol.flush()
    line = sys.stdin.readline().strip()
    if line != expect:
        raise SystemExit(f"launcher said {line!r}, expected {expect!r}")


# ---- the proof: servers and jobs as subprocesses --------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    job_id: str
    seed: int
    sliced: Path
    standalone: Path
    #: The sliced job's model before training.
    initial: Path
    report: dict[str, Any]


def run_pair(
    *,
    workdir: Path,
    env_for: Callable[[str], Mapping[str, str]],
    steps: int = DEFAULT_STEPS,
    seeds: Sequence[int] = DEFAULT_SEEDS,
) -> list[JobOutcome]:
    """Run one time-sliced job per seed (``env_for(job_id)``: its environment, naming the
    orchestrator, the group and the agent) and, meanwhile, the same seeds alone."""
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = [(f"job-{chr(ord('a') + i)}", seed) for i, seed in enumerate(seeds)]
    specs = [arg for job_id, seed in jobs for arg in ("--job", f"{job_id}:{seed}")]
    outs = [_out(workdir, job_id) for job_id, _ in jobs]
    quiet = {k: v for k, v in os.environ.items() if not k.startswith(("TSLICE_", "TIMESLICE_"))}
    with _Launched() as launched:
        references = launched.start(
            "standalone",
            ["standalone", *specs, "--steps", str(steps), "--workdir", str(workdir)],
            env=quiet,
            log=workdir / "standalone.log",
        )
        sliced = [
            launched.start(
                job_id,
                ["job", "--barrier", "--seed", str(seed), "--steps", str(steps), "--out", out],
                env=env_for(job_id),
                log=workdir / f"{job_id}-sliced.log",
                barrier=True,
            )
            for (job_id, seed), out in zip(jobs, outs, strict=True)
        ]
        # Training starts only when both are registered, so that they really alternate;
        # neither exits before both are done (each must stay reachable for the other).
        for word, reply in (("ready", "go"), ("done", "exit")):
            for job in sliced:
                job.expect(word)
            for job in sliced:
                job.send(reply)
        for job in [*sliced, references]:
            job.finish()
    return [
        JobOutcome(
            job_id,
            seed,
            Path(_out(workdir, job_id)),
            workdir / f"{job_id}-standalone.pt",
            workdir / f"{job_id}-sliced.pt.initial",
            json.loads((workdir / f"{job_id}-sliced.pt.json").read_text()),
        )
        for job_id, seed in jobs
    ]


def _out(workdir: Path, job_id: str) -> str:
    return str(workdir / f"{job_id}-sliced.pt")


class _Job:
    def __init__(self, name: str, proc: subprocess.Popen[str], log: Path) -> None:
        self.name, self.proc, self.log = name, proc, log

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != word:
            self.proc.wait()
            raise RuntimeError(f"{self.name}: expected {word!r}, got {line!r}\n{self.tail()}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{line}\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        if self.proc.wait() != 0:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}\n{self.tail()}")

    def tail(self, chars: int = 6000) -> str:
        return f"----- {self.log} -----\n" + self.log.read_text(errors="replace")[-chars:]


class _Launched:
    """Subprocesses of this script, killed on the way out if they are still running."""

    def __init__(self) -> None:
        self.jobs: list[_Job] = []

    def start(
        self,
        name: str,
        args: list[str],
        *,
        env: Mapping[str, str],
        log: Path,
        barrier: bool = False,
    ) -> _Job:
        with log.open("w") as stderr:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, __file__, *args],
                stdin=subprocess.PIPE if barrier else subprocess.DEVNULL,
                stdout=subprocess.PIPE if barrier else subprocess.DEVNULL,
                stderr=stderr,
                env=dict(env),
                text=True,
            )
        job = _Job(name, proc, log)
        self.jobs.append(job)
        return job

    def __enter__(self) -> _Launched:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for job in self.jobs:
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()
            for stream in (job.proc.stdin, job.proc.stdout):
                if stream is not None:
                    stream.close()


def states_identical(a: Any, b: Any) -> bool:
    """Same structure and, for every tensor, same dtype, shape and values (torch.equal)."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(states_identical(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


# ---- servers for the whole proof (the test uses its own fixture instead) ---------------------

_SERVING = re.compile(r"serving on (127\.0\.0\.1:\d+)")


@dataclasses.dataclass
class _Server:
    proc: subprocess.Popen[str]
    address: str = ""


def _serve(kind: str, args: list[str], log: Path) -> _Server:
    """``python -m tslice KIND ...``; returns once it logs its address (its readiness)."""
    out = log.open("w", buffering=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tslice", kind, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = _Server(proc)
    ready = threading.Event()

    def copy() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            match = _SERVING.search(line)
            if match and not server.address:
                server.address = match.group(1)
                ready.set()
        ready.set()
        out.close()

    threading.Thread(target=copy, daemon=True).start()
    ready.wait(60)
    if not server.address:
        proc.kill()
        raise RuntimeError(f"{kind} did not start; see {log}")
    return server


@contextlib.contextmanager
def _servers(workdir: Path) -> Iterator[tuple[str, str]]:
    sockets = Path(tempfile.mkdtemp(prefix="tslice-"))
    started: list[_Server] = []
    try:
        agent_args = [
            "--node-name", "node-a", "--port", "0", "--backend", "app-channel",
            "--state-dir", str(workdir / "agent"), "--metrics-port", "0",
            "--register-socket", str(sockets / "register.sock"),
        ]  # fmt: skip
        agent = _serve("agent", agent_args, workdir / "agent.log")
        started.append(agent)
        orchestrator_args = [
            "--local-agent", f"node-a={agent.address}", "--group", GROUP, "--port", "0",
            "--state-dir", str(workdir / "orchestrator"), "--metrics-port", "0",
        ]  # fmt: skip
        orchestrator = _serve("orchestrator", orchestrator_args, workdir / "orchestrator.log")
        started.append(orchestrator)
        yield orchestrator.address, agent.address
    finally:
        for server in reversed(started):
            server.proc.terminate()
            try:
                server.proc.wait(15)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()


def prove(workdir: Path, *, steps: int) -> int:
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    with _servers(workdir) as (orchestrator, agent):

        def env_for(job_id: str) -> dict[str, str]:
            env = {k: v for k, v in os.environ.items() if k != "TSLICE_DISABLED"}
            env.update(
                TIMESLICE_JOB_ID=job_id,
                TIMESLICE_ORCH_ADDR=orchestrator,
                TIMESLICE_TRAINER_GROUP=GROUP,
                TSLICE_AGENT=agent,
            )
            return env

        outcomes = run_pair(workdir=workdir, env_for=env_for, steps=steps)
    same = True
    for o in outcomes:
        identical = states_identical(torch.load(o.sliced), torch.load(o.standalone))
        same = same and identical
        r, a, c = o.report, o.report["adapter"], o.report["callback"]
        print(
            f"{o.job_id} (seed {o.seed}): {r['steps']} steps, reward {r['reward_first']:.2f}"
            f" -> {r['reward_last']:.2f}; offloaded {a['snapshots']}x ({a['bytes_out']} bytes"
            f" in all), restored {a['restores']}x, {c['rewards_released']} reward scorings"
            f" with the group released; bit-identical to standalone: {'yes' if identical else 'NO'}"
        )
    return 0 if same else 1


# ---- command line ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary dir")
    sub = parser.add_subparsers(dest="command")
    job = sub.add_parser("job", help="run one GRPO job (configured by the environment)")
    job.add_argument("--seed", type=int, required=True)
    job.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    job.add_argument("--out", type=Path, required=True, help="final state (torch.save)")
    job.add_argument("--barrier", action="store_true", help="line protocol with the launcher")
    refs = sub.add_parser("standalone", help="run several seeds alone, one after the other")
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
    with tempfile.TemporaryDirectory(prefix="trl_grpo-") as tmp:
        return prove(args.workdir or Path(tmp), steps=args.steps)


if __name__ == "__main__":
    sys.exit(main())
