"""tslice.rl.Phases / AsyncPhases against a real orchestrator and agent (job-side imports only).

What each role's phases hold is read back from the orchestrator with a second client;
two jobs time-slice through app-channel workloads registered by ``workload=``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import pytest

import tslice
from tests.jobside.stack import Stack
from tslice.client import EventKind
from tslice.rl import AsyncPhases, Phase, PhaseError, Phases, Role, phase_groups
from tslice.workload import CallbackAdapter

_ENV_PREFIXES = ("TSLICE_", "TIMESLICE_", "SNAPSHOT_AGENT_ADDR")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No stray TSLICE_*/TIMESLICE_* variable of the outer environment reaches a test."""
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) and name != "TSLICE_SERVER_PYTHON":
            monkeypatch.delenv(name)


def holders(client: tslice.Client) -> dict[str, str]:
    """group -> the job holding its lock ("" when free)."""
    return {group: client.status(group).locking_job for group in ("trainer", "sampler")}


@pytest.fixture
def observer(stack: Stack) -> Iterator[tslice.Client]:
    with tslice.Client(stack.address, job_id=None) as client:
        yield client


class Recorder:
    """A workload whose snapshots and restores are counted (the app-channel agent calls it)."""

    def __init__(self) -> None:
        self.snapshots = 0
        self.restores = 0
        self.adapter = CallbackAdapter(on_snapshot=self._snapshot, on_restore=self._restore)

    def _snapshot(self, mode: str, tags: list[str]) -> None:
        self.snapshots += 1

    def _restore(self, tags: list[str]) -> None:
        self.restores += 1


def make(stack: Stack, job: str, role: str = "colocated", **kwargs: object) -> Phases:
    """Phases of ``job`` with a workload registered for each pool the role holds state on
    (the app-channel agent moves a job's state between its groups too: they share devices)."""
    workload: object = (
        {"trainer": Recorder().adapter, "sampler": Recorder().adapter}
        if role == "colocated"
        else Recorder().adapter
    )
    return Phases(
        job_id=job,
        address=stack.address,
        role=role,
        workload=workload,
        agent=stack.agent_address,
        **kwargs,  # type: ignore[arg-type]
    )


# ---- the mapping, pure ---------------------------------------------------------------------

T, S = "tr", "sa"
MAPPING = {
    Role.COLOCATED: {
        "init": (T, S),
        "generate": (S,),
        "train": (T,),
        "weight_sync": (T, S),
        "eval": (S,),
        "save": (T,),
    },
    Role.TRAINER: {
        "init": (T,),
        "generate": (),
        "train": (T,),
        "weight_sync": (T, S),
        "eval": (),
        "save": (T,),
    },
    Role.SAMPLER: {
        "init": (S,),
        "generate": (S,),
        "train": (),
        "weight_sync": (),
        "eval": (S,),
        "save": (),
    },
}


@pytest.mark.parametrize("role", list(Role), ids=str)
def test_each_phase_of_each_role_takes_its_groups_trainer_first(role: Role) -> None:
    for phase, expected in MAPPING[role].items():
        assert phase_groups(role, phase, T, S) == expected, (role, phase)
        assert phase_groups(role.value, Phase(phase), T, S) == expected


def test_groups_collapse_when_the_same_or_missing() -> None:
    for phase in Phase:
        assert phase_groups("colocated", phase, "one", "one") == ("one",)
        assert phase_groups("colocated", phase, "one", None) == ("one",)
        assert phase_groups("colocated", phase, None, "one") == ("one",)
    # A trainer whose sampler pool is not time-sliced syncs weights on its own group.
    assert phase_groups("trainer", "weight_sync", "tr", None) == ("tr",)
    assert phase_groups("trainer", "weight_sync", "g", "g") == ("g",)


def test_unknown_phase_or_role_names_the_valid_ones() -> None:
    with pytest.raises(PhaseError, match=r"unknown phase 'rollout'; the phases are: init, gen"):
        phase_groups("colocated", "rollout", T, S)
    with pytest.raises(PhaseError, match=r"unknown role 'actor'; the roles are: colocated, "):
        phase_groups("actor", "train", T, S)
    assert "weight_sync" in {Phase.WEIGHT_SYNC} and str(Phase.TRAIN) == "train"


# ---- each role against the orchestrator ----------------------------------------------------


def test_colocated_phases_hold_exactly_their_groups(stack: Stack, observer: tslice.Client) -> None:
    with make(stack, "job-a") as phases:
        assert phases.enabled and phases.role is Role.COLOCATED
        for phase in Phase:
            groups = phases.groups_for(phase)
            with phases.phase(phase) as grants:
                assert set(grants) == set(groups)
                assert all(grant.success for grant in grants.values())
                expected = {g: ("job-a" if g in groups else "") for g in ("trainer", "sampler")}
                assert holders(observer) == expected, phase
            assert holders(observer) == {"trainer": "", "sampler": ""}, phase


def test_disaggregated_trainer_holds_both_pools_for_weight_sync(
    stack: Stack, observer: tslice.Client
) -> None:
    trainer = make(stack, "job-a", "trainer")
    sampler = make(stack, "job-a", "sampler")
    with trainer, sampler:
        with sampler.phase("generate"):
            assert holders(observer) == {"trainer": "", "sampler": "job-a"}
        with trainer.phase("train"):
            assert holders(observer) == {"trainer": "job-a", "sampler": ""}
        # The trainer side takes both; the sampler side's weight_sync takes nothing, so
        # neither process can yield the sampler group under the other.
        with trainer.phase("weight_sync"), sampler.phase("weight_sync") as grants:
            assert dict(grants) == {}
            assert holders(observer) == {"trainer": "job-a", "sampler": "job-a"}
        assert holders(observer) == {"trainer": "", "sampler": ""}
        for phase in ("generate", "eval"):
            assert trainer.begin(phase) == {}
            trainer.end(phase)
        for phase in ("train", "save"):
            with sampler.phase(phase):
                assert holders(observer) == {"trainer": "", "sampler": ""}


def test_overlapping_phases_share_a_group_and_yield_it_with_the_last(
    stack: Stack, observer: tslice.Client
) -> None:
    # train_async-style: the next generation is dispatched while training runs.
    with make(stack, "job-a") as phases:
        phases.begin("train")
        phases.begin("generate")
        phases.begin("eval")  # needs the sampler group, already held: no new acquire
        assert holders(observer) == {"trainer": "job-a", "sampler": "job-a"}
        phases.end("train")
        assert holders(observer) == {"trainer": "", "sampler": "job-a"}
        phases.end("generate")
        assert holders(observer) == {"trainer": "", "sampler": "job-a"}
        assert phases.open_phases == (Phase.EVAL,)
        phases.end("eval")
        assert holders(observer) == {"trainer": "", "sampler": ""}


def test_close_yields_the_phases_still_open(stack: Stack, observer: tslice.Client) -> None:
    phases = make(stack, "job-a")
    phases.begin("weight_sync")
    phases.close()
    phases.close()  # idempotent
    assert holders(observer) == {"trainer": "", "sampler": ""}
    with pytest.raises(PhaseError, match="closed"):
        phases.begin("train")


def test_from_env_reads_llm_d_variables(
    stack: Stack, observer: tslice.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm_d = {k: v for k, v in stack.env("job-env").items() if k.startswith("TIMESLICE_")}
    for name, value in llm_d.items():
        monkeypatch.setenv(name, value)
    with Phases.from_env() as phases:
        assert (phases.job_id, phases.trainer_group, phases.sampler_group) == (
            "job-env",
            "trainer",
            "sampler",
        )
        with phases.phase("save"):
            assert holders(observer) == {"trainer": "job-env", "sampler": ""}
    monkeypatch.setenv("TSLICE_ROLE", "sampler")
    monkeypatch.setenv("TSLICE_SAMPLER_GROUP", "trainer")  # TSLICE_* wins over TIMESLICE_*
    with Phases.from_env() as phases:
        assert phases.role is Role.SAMPLER
        assert phases.groups_for("generate") == ("trainer",)


def test_from_env_single_group(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICE_ORCH_ADDR", stack.address)
    monkeypatch.setenv("TIMESLICE_JOB_ID", "job-a")
    monkeypatch.setenv("TIMESLICE_GROUP", "sampler")
    with Phases.from_env(role="colocated") as phases:
        assert {phases.groups_for(p) for p in Phase} == {("sampler",)}


# ---- two jobs ------------------------------------------------------------------------------


def _recorded_phases(stack: Stack, job: str) -> tuple[Phases, Recorder, Recorder]:
    trainer, sampler = Recorder(), Recorder()
    phases = Phases(
        job_id=job,
        address=stack.address,
        workload={"trainer": trainer.adapter, "sampler": sampler.adapter},
        agent=stack.agent_address,
    )
    return phases, trainer, sampler


def _queued(events: Iterator[tslice.OrchestratorEvent], job: str) -> tslice.OrchestratorEvent:
    """The next QUEUED event of ``job`` (a job granted after a switch is queued too)."""
    return next(event for event in events if event.job_id == job)


def test_two_jobs_alternate_phases_and_exclude_each_other(
    stack: Stack, observer: tslice.Client
) -> None:
    a, a_trainer, _ = _recorded_phases(stack, "job-a")
    b, _, _ = _recorded_phases(stack, "job-b")
    events = observer.watch_events(kinds=[EventKind.QUEUED], timeout=60)
    # The pool is left last, after a and b closed: a failing test cannot hang on a waiter.
    with futures.ThreadPoolExecutor(max_workers=1) as pool, a, b:
        a.begin("train")
        waiting = pool.submit(b.begin, "train")
        assert _queued(events, "job-b").group_id == "trainer"  # behind job-a
        assert not waiting.done()
        a.end("train")
        waiting.result(60)
        assert holders(observer) == {"trainer": "job-b", "sampler": ""}
        assert a_trainer.snapshots == 1  # the agent offloaded job-a's trainer state

        # The groups share the agent's devices: job-a's generate waits for job-b too.
        generating = pool.submit(a.begin, "generate")
        assert _queued(events, "job-a").group_id == "sampler"
        assert not generating.done()
        b.end("train")
        generating.result(60)
        assert holders(observer) == {"trainer": "", "sampler": "job-a"}
        a.end("generate")
    events.close()  # type: ignore[attr-defined]


def test_two_jobs_in_a_loop_are_never_inside_a_phase_together(stack: Stack) -> None:
    inside: set[str] = set()
    overlaps: list[tuple[str, str, set[str]]] = []
    guard = threading.Lock()
    start, finish = threading.Barrier(2), threading.Barrier(2)

    def run(job: str) -> None:
        phases, _, _ = _recorded_phases(stack, job)
        with phases:
            start.wait(30)
            for _ in range(4):
                for phase in ("generate", "train", "weight_sync"):
                    phases.begin(phase)
                    with guard:  # after begin returned, before end is called: exclusive
                        if inside:
                            overlaps.append((job, phase, set(inside)))
                        inside.add(job)
                    with guard:
                        inside.discard(job)
                    phases.end(phase)
            # Closing unregisters the workload: stay until the other job no longer needs
            # this one's state moved out of its way.
            finish.wait(60)

    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        for done in [pool.submit(run, "job-a"), pool.submit(run, "job-b")]:
            done.result(120)
    assert overlaps == []


def test_a_begin_that_times_out_leaves_the_phase_closed(
    stack: Stack, observer: tslice.Client
) -> None:
    a, _, _ = _recorded_phases(stack, "job-a")
    b, _, _ = _recorded_phases(stack, "job-b")
    with a, b:
        a.begin("train")
        with pytest.raises(tslice.AcquireTimeout):
            b.begin("train", timeout=0.2)
        assert b.open_phases == ()
        assert observer.status("trainer").waiter_queue_depth == 0  # b left the queue
        a.end("train")
        with b.phase("train"):
            assert holders(observer)["trainer"] == "job-b"


# ---- rules and errors ---------------------------------------------------------------------


def test_begin_and_end_rules_hold_with_and_without_the_platform(stack: Stack) -> None:
    with (
        make(stack, "job-a") as live,
        Phases(job_id="job-a", address=None) as off,
    ):
        assert live.enabled and not off.enabled
        for phases in (live, off):
            with pytest.raises(PhaseError, match=r"'eval' was not begun.*open now: none"):
                phases.end("eval")
            with phases.phase("generate"):
                with pytest.raises(PhaseError, match="'generate' is already open"):
                    phases.begin("generate")
                # sampler held, trainer wanted: the order every job follows is trainer first
                with pytest.raises(PhaseError, match=r"'train' cannot begin while .*'generate'"):
                    phases.begin("train")
                with pytest.raises(PhaseError, match=r"'weight_sync' cannot begin"):
                    phases.begin("weight_sync")
            with phases.phase("train"), phases.phase("weight_sync"):  # trainer first: fine
                pass
            with pytest.raises(PhaseError, match="unknown phase 'rollout'"):
                phases.begin("rollout")
            with pytest.raises(ValueError, match="boom"), phases.phase("save"):
                raise ValueError("boom")
            assert phases.open_phases == ()


def test_configuration_errors_say_what_to_set(stack: Stack) -> None:
    address = stack.address
    with pytest.raises(tslice.ConfigError, match=r"role 'trainer' needs the trainer group.*"):
        Phases(job_id="j", address=address, role="trainer", trainer_group=None)
    with pytest.raises(tslice.ConfigError, match=r"TIMESLICE_SAMPLER_GROUP"):
        Phases(job_id="j", address=address, role="sampler", sampler_group=None)
    with pytest.raises(tslice.ConfigError, match=r"colocated job needs at least one group"):
        Phases(job_id="j", address=address, trainer_group=None, sampler_group=None)
    with pytest.raises(tslice.ConfigError, match="group 'bad group' is malformed"):
        Phases(job_id="j", address=address, trainer_group="bad group")
    with pytest.raises(tslice.ConfigError, match="a job id is required"):
        Phases(address=address)
    with (
        tslice.Client(address, job_id="j") as client,
        pytest.raises(tslice.ConfigError, match="either client= or address="),
    ):
        Phases(address=address, client=client)
    with (
        tslice.Client(address, job_id=None) as anonymous,
        pytest.raises(tslice.ConfigError, match="a job id is required: pass job_id="),
    ):
        Phases(client=anonymous)
    with pytest.raises(PhaseError, match="unknown role 'learner'"):
        Phases(job_id="j", address=address, role="learner")
    with pytest.raises(tslice.ConfigError, match=r"two groups .* workload=\{'trainer'"):
        Phases(job_id="j", address=address, workload=Recorder().adapter)
    with pytest.raises(tslice.ConfigError, match="needs the node agent's address"):
        Phases(job_id="j", address=address, role="trainer", workload=Recorder().adapter)
    # No groups are needed when nothing is configured: the script runs alone.
    assert not Phases(trainer_group=None, sampler_group=None).enabled


def test_a_workload_the_agent_never_accepts_is_an_error(stack: Stack) -> None:
    with pytest.raises(tslice.ConfigError, match=r"did not accept the workload of job 'j'"):
        Phases(
            job_id="j",
            address=stack.address,
            role="trainer",
            workload=Recorder().adapter,
            agent="127.0.0.1:1",  # nothing listens there
            register_timeout=0.5,
        )


def test_each_local_rank_of_a_job_registers_its_own_workload(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process per GPU (torchrun, veRL's workers): each says its $LOCAL_RANK, and the
    agent takes every rank of the job (one registration per (job, group) was refused
    ALREADY_EXISTS for the second process)."""
    ranks = []
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        ranks.append(make(stack, "ranked", role="trainer"))  # waits for the agent's yes
    for phases in ranks:
        phases.close()
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(tslice.ConfigError, match="LOCAL_RANK='first'"):
        make(stack, "ranked", role="trainer")


def test_noop_is_said_once_on_stderr() -> None:
    script = (
        "import asyncio\n"
        "from tslice.rl import AsyncPhases, Phases\n"
        "for _ in range(2):\n"
        "    with Phases.from_env() as phases:\n"
        "        assert not phases.enabled\n"
        "        for p in ('init', 'generate', 'train', 'weight_sync'):\n"
        "            with phases.phase(p) as grants:\n"
        "                assert all(g.success for g in grants.values())\n"
        "async def main():\n"
        "    async with AsyncPhases.from_env(role='trainer') as phases:\n"
        "        async with phases.phase('train'):\n"
        "            pass\n"
        "asyncio.run(main())\n"
        "print('ran')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIXES)}
    for extra, said in (({}, 1), ({"TSLICE_DISABLED": "1"}, 0)):
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "ran"
        lines = [line for line in done.stderr.splitlines() if line.startswith("tslice")]
        assert len(lines) == said, done.stderr
        if said:
            assert "time-slicing is off: no orchestrator configured" in lines[0]
            assert "TIMESLICE_ORCH_ADDR" in lines[0]


# ---- async ---------------------------------------------------------------------------------


def test_async_phases_take_the_same_groups(stack: Stack, observer: tslice.Client) -> None:
    async def main() -> None:
        recorder = Recorder()
        async with AsyncPhases(
            job_id="job-a",
            address=stack.address,
            role="trainer",
            workload=recorder.adapter,
            agent=stack.agent_address,
        ) as phases:
            async with phases.phase("weight_sync") as grants:
                assert set(grants) == {"trainer", "sampler"}
                assert await asyncio.to_thread(holders, observer) == {
                    "trainer": "job-a",
                    "sampler": "job-a",
                }
            await phases.begin("train")
            with pytest.raises(PhaseError, match="already open"):
                await phases.begin("train")
        assert phases.open_phases == ()  # closing ended "train"
        assert await asyncio.to_thread(holders, observer) == {"trainer": "", "sampler": ""}

    asyncio.run(main())
