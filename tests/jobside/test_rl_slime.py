"""tslice.rl.slime.TimesliceCallback driven with slime's own hook call sequences.

The sequences are those of slime's drivers (``train.py``, ``train_async.py`` with
``--phase-callback-path``): the same phase names, role arguments and order. Which
groups the job holds inside each phase is read back from a real orchestrator.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest

import tslice
from tests.jobside.stack import Stack
from tslice.rl import Phase, PhaseError, Phases
from tslice.rl.slime import TimesliceCallback, tslice_phase
from tslice.workload import CallbackAdapter

_ENV_PREFIXES = ("TSLICE_", "TIMESLICE_", "SNAPSHOT_AGENT_ADDR")
FREE = {"trainer": "", "sampler": ""}

#: What slime's role argument says the job must hold (at least) inside a phase.
POOLS = {"trainer": ("trainer",), "sampler": ("sampler",), "both": ("trainer", "sampler")}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) and name != "TSLICE_SERVER_PYTHON":
            monkeypatch.delenv(name)


@pytest.fixture
def observer(stack: Stack) -> Iterator[tslice.Client]:
    with tslice.Client(stack.address, job_id=None) as client:
        yield client


def holders(client: tslice.Client) -> dict[str, str]:
    return {group: client.status(group).locking_job for group in ("trainer", "sampler")}


def _adapter() -> CallbackAdapter:
    return CallbackAdapter(on_snapshot=lambda mode, tags: None, on_restore=lambda tags: None)


def callback(stack: Stack, job: str) -> TimesliceCallback:
    """The callback of one slime driver, with a workload per pool registered for ``job``."""
    phases = Phases(
        job_id=job,
        address=stack.address,
        workload={"trainer": _adapter(), "sampler": _adapter()},
        agent=stack.agent_address,
    )
    return TimesliceCallback(phases)


# A work function is called inside every phase with (phase, role).
Work = Callable[[str, str], None]


def sync_driver(
    cb: TimesliceCallback,
    work: Work,
    *,
    rollouts: int = 2,
    offload_rollout: bool = False,
    release_train: bool = False,
    eval_interval: int | None = None,
    before_close: Callable[[], object] = lambda: None,
) -> None:
    """The hook calls of slime's ``train.py``, in its order."""

    def span(phase: str, role: str, context: dict[str, int] | None = None) -> None:
        cb.on_phase_begin(phase, role, context)
        work(phase, role)
        cb.on_phase_end(phase, role, context)

    span("init", "both")
    for rollout_id in range(rollouts):
        ctx = {"rollout_id": rollout_id}
        if eval_interval is not None and rollout_id == 0:
            span("eval", "sampler", ctx)
        span("generate", "sampler", ctx)
        if offload_rollout:
            span("offload", "sampler", ctx)
        if release_train:
            span("create", "trainer", ctx)
        span("train", "trainer", ctx)
        if offload_rollout and not release_train:
            span("onload", "sampler", ctx)
        span("weight_sync", "both", ctx)
        if offload_rollout:
            span("onload", "sampler", ctx)
        if eval_interval is not None and (rollout_id + 1) % eval_interval == 0:
            span("eval", "sampler", ctx)
    before_close()
    cb.close()


def async_driver(
    cb: TimesliceCallback, work: Work, *, rollouts: int = 3, update_weights_interval: int = 1
) -> None:
    """The hook calls of slime's ``train_async.py``: generation N+1 runs during train N."""
    cb.on_phase_begin("init", "both")
    work("init", "both")
    cb.on_phase_end("init", "both")
    cb.on_phase_begin("generate", "sampler", {"rollout_id": 0})
    pending = True
    for rollout_id in range(rollouts):
        ctx = {"rollout_id": rollout_id}
        if pending:
            work("generate", "sampler")
            cb.on_phase_end("generate", "sampler", ctx)
            pending = False
        cb.on_phase_begin("train", "trainer", ctx)
        if rollout_id + 1 < rollouts:
            cb.on_phase_begin("generate", "sampler", {"rollout_id": rollout_id + 1})
            pending = True
        work("train", "trainer")
        cb.on_phase_end("train", "trainer", ctx)
        if (rollout_id + 1) % update_weights_interval == 0:
            if pending:
                work("generate", "sampler")
                cb.on_phase_end("generate", "sampler", ctx)
                pending = False
            cb.on_phase_begin("weight_sync", "both", ctx)
            work("weight_sync", "both")
            cb.on_phase_end("weight_sync", "both", ctx)
        cb.on_phase_begin("eval", "sampler", ctx)
        work("eval", "sampler")
        cb.on_phase_end("eval", "sampler", ctx)
    cb.close()


def test_slime_phase_names_map_onto_tslice_phases() -> None:
    assert tslice_phase("weight_sync", "both") is Phase.WEIGHT_SYNC
    assert tslice_phase("offload", "sampler") is Phase.GENERATE
    assert tslice_phase("onload", "sampler") is Phase.GENERATE
    assert tslice_phase("create", "trainer") is Phase.TRAIN
    assert tslice_phase("save", "trainer") is Phase.SAVE
    # A phase slime adds later is placed by the pools its role argument names.
    assert tslice_phase("reshard", "both") is Phase.WEIGHT_SYNC
    assert tslice_phase("warmup", "sampler") is Phase.GENERATE
    with pytest.raises(PhaseError, match=r"'warmup' with role 'gpu' cannot be placed"):
        tslice_phase("warmup", "gpu")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"offload_rollout": True, "eval_interval": 1},
        {"release_train": True, "offload_rollout": True},
    ],
    ids=["plain", "offload-eval", "release-train"],
)
def test_sync_driver_holds_each_phases_pools(
    stack: Stack, observer: tslice.Client, options: dict[str, object]
) -> None:
    seen: list[tuple[str, dict[str, str]]] = []

    def work(phase: str, role: str) -> None:
        held = holders(observer)
        seen.append((phase, held))
        wanted = set(POOLS[role])
        assert {g for g, job in held.items() if job == "job-a"} == wanted, (phase, held)

    sync_driver(callback(stack, "job-a"), work, **options)  # type: ignore[arg-type]
    assert holders(observer) == FREE  # close() left nothing held
    names = [phase for phase, _ in seen]
    assert names[0] == "init" and names.count("weight_sync") == 2  # two rollouts ran


@pytest.mark.parametrize("interval", [1, 2])
def test_async_driver_overlaps_generation_with_training(
    stack: Stack, observer: tslice.Client, interval: int
) -> None:
    inside_train: list[dict[str, str]] = []

    def work(phase: str, role: str) -> None:
        held = holders(observer)
        for group in POOLS[role]:
            assert held[group] == "job-a", (phase, held)
        if phase == "train":
            inside_train.append(held)

    async_driver(callback(stack, "job-a"), work, rollouts=3, update_weights_interval=interval)
    assert holders(observer) == FREE
    # While training N, generation N+1 was in flight: both pools held (trainer first).
    assert inside_train[0] == {"trainer": "job-a", "sampler": "job-a"}
    assert inside_train[-1] == {"trainer": "job-a", "sampler": ""}  # nothing left to generate


def test_weight_sync_end_yields_both_pools(stack: Stack, observer: tslice.Client) -> None:
    cb = callback(stack, "job-a")
    cb.on_phase_begin("weight_sync", "both", {"rollout_id": 0})
    assert holders(observer) == {"trainer": "job-a", "sampler": "job-a"}
    cb.on_phase_end("weight_sync", "both", {"rollout_id": 0})
    assert holders(observer) == FREE  # another job may train before this one's next step
    cb.close()


def test_two_slime_jobs_never_hold_the_pools_together(stack: Stack) -> None:
    inside: set[str] = set()
    overlaps: list[tuple[str, str, set[str]]] = []
    guard = threading.Lock()
    start, finish = threading.Barrier(2), threading.Barrier(2)

    def run(job: str) -> None:
        cb = callback(stack, job)

        def work(phase: str, role: str) -> None:
            with guard:
                if inside:
                    overlaps.append((job, phase, set(inside)))
                inside.add(job)
            with guard:
                inside.discard(job)

        start.wait(30)
        # Closing unregisters the workload: stay until the other job needs nothing moved.
        sync_driver(
            cb, work, rollouts=3, offload_rollout=True, before_close=lambda: finish.wait(60)
        )

    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        for done in [pool.submit(run, "job-a"), pool.submit(run, "job-b")]:
            done.result(120)
    assert overlaps == []


def test_unbalanced_hooks_are_errors(stack: Stack) -> None:
    cb = callback(stack, "job-a")
    with pytest.raises(PhaseError, match=r"'train' ended without a begin"):
        cb.on_phase_end("train", "trainer")
    cb.on_phase_begin("generate", "sampler")
    with pytest.raises(PhaseError, match=r"'generate' began twice"):
        cb.on_phase_begin("generate", "sampler")
    # Out of the trainer-first order: holding the sampler pool, asking for the trainer's.
    with pytest.raises(PhaseError, match=r"'train' cannot begin while phase 'generate'"):
        cb.on_phase_begin("train", "trainer")
    cb.on_phase_end("generate", "sampler")
    cb.close()


_SLIME_LIKE = """
import importlib, json, sys
import tslice

def load_function(path):  # what slime.utils.misc.load_function does with the path
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)

cls = load_function(sys.argv[1])
cb = cls()  # slime instantiates the class without arguments
observer = tslice.Client(job_id=None) if cb.phases.enabled else None
seen = []
for phase, role in [("init", "both"), ("generate", "sampler"), ("train", "trainer"),
                    ("weight_sync", "both"), ("eval", "sampler")]:
    cb.on_phase_begin(phase, role, {"rollout_id": 0})
    if observer is not None:
        seen.append({g: observer.status(g).locking_job for g in ("trainer", "sampler")})
    cb.on_phase_end(phase, role, {"rollout_id": 0})
cb.close()
print(json.dumps(seen))
"""


def _run_slime_like(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SLIME_LIKE, "tslice.rl.slime.TimesliceCallback"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_slime_loads_it_by_path_and_it_reads_llm_d_variables(stack: Stack) -> None:
    env = stack.env("job-slime")
    # Only llm-d's names: what a slime job configured for llm-d's callback already sets.
    env = {k: v for k, v in env.items() if not k.startswith("TSLICE_")}
    env["TSLICE_ORCHESTRATOR"] = ""  # blank: not set
    done = _run_slime_like(env)
    assert done.returncode == 0, done.stderr
    job = "job-slime"
    assert done.stdout.strip() == (
        f'[{{"trainer": "{job}", "sampler": "{job}"}}, {{"trainer": "", "sampler": "{job}"}}, '
        f'{{"trainer": "{job}", "sampler": ""}}, {{"trainer": "{job}", "sampler": "{job}"}}, '
        f'{{"trainer": "", "sampler": "{job}"}}]'
    )


def test_without_the_variables_it_is_a_noop_said_once() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIXES)}
    done = _run_slime_like(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    said = [line for line in done.stderr.splitlines() if "time-slicing is off" in line]
    assert len(said) == 1, done.stderr
