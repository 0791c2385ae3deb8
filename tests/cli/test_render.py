"""The live demo view follows job updates and orchestrator events."""

from __future__ import annotations

import datetime
import io
import time

from rich.console import Console

import tslice.client as tsclient
from tslice.cli import render
from tslice.demo import runner
from tslice.phases import rljob


def text_of(renderable: object) -> str:
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def update(job: str, step: int, activity: str, holding: tuple[str, ...]) -> rljob.JobUpdate:
    return rljob.JobUpdate(
        run="exclusive",
        job=job,
        step=step,
        steps=3,
        activity=activity,
        holding=holding,
        t=time.time(),
    )


def test_live_view_tracks_holders_steps_and_switches() -> None:
    progress = runner.DemoProgress(jobs=2, steps=3, time_scale=100.0)
    progress.start_run("exclusive", ["A", "B"], 3)
    progress.on_job(update("A", 1, "sample", ("sampler",)))
    progress.on_job(update("B", 0, "wait sampler", ()))
    progress.on_event(
        tsclient.OrchestratorEvent(
            time=datetime.datetime.now(datetime.timezone.utc),
            kind=tsclient.EventKind.SWITCH_DONE,
            group_id="sampler",
            job_id="A",
            from_job="B",
            duration_ms=120,
        )
    )
    # A first grant on an empty pool is not a switch.
    progress.on_event(
        tsclient.OrchestratorEvent(
            time=None, kind=tsclient.EventKind.SWITCH_DONE, group_id="trainer", job_id="A"
        )
    )
    text = text_of(render.demo_live(progress))
    assert "job A" in text and "free" in text  # sampler held by A, trainer free
    assert "1/3" in text and "wait sampler" in text
    assert "B -> A" in text and "12.0 s trace" in text
    assert progress.switch_count == 1
    assert progress.done_steps == 1

    progress.on_job(update("A", 2, "done", ()))
    assert progress.done_steps == 3
    assert "sampler" not in progress.holders


def _status(draining: bool) -> tsclient.GroupStatus:
    return tsclient.GroupStatus(
        group_id="trainer",
        group_state=tsclient.GroupState.LOCKED,
        state_timestamp=None,
        locking_job="job-a",
        active_job="job-a",
        waiter_queue_depth=1,
        loaded_job="job-a",
        draining=draining,
    )


def test_a_drained_group_says_so_and_how_to_resume_it() -> None:
    assert "(draining)" in text_of(render.groups_table([_status(True)]))
    assert "resume with tslice admin resume trainer" in text_of(render.group_status(_status(True)))
    assert "draining" not in text_of(render.groups_table([_status(False)]))
    assert "resume" not in text_of(render.group_status(_status(False)))
