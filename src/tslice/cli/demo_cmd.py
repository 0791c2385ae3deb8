"""``tslice demo``: simulated RL jobs, exclusive then time-sliced; live view and timeline.

Any recorded run the phase model can be derived from works (``--trace``): any pool
names and count, shared and private pools, synchronous and asynchronous jobs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from tslice.cli import client_cmds, render, sizes

# Mirrors tslice.demo.runner.DEFAULT_* (a test pins them): importing the demo here would
# slow down the start of every `tslice` process, servers included.
DEFAULT_STEPS = 4
DEFAULT_TIME_SCALE = 240.0


def register(app: typer.Typer) -> None:
    app.command("demo")(run)


def run(
    *,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="Recorded run to model the jobs on, any pools and RL mode (default: veRL "
            "2xH100, a sampler and a trainer GPU).",
        ),
    ] = None,
    jobs: Annotated[int, typer.Option("--jobs", min=1, max=26, help="Simulated RL jobs.")] = 2,
    steps: Annotated[int, typer.Option("--steps", min=1, help="RL steps per job.")] = DEFAULT_STEPS,
    time_scale: Annotated[
        float,
        typer.Option("--time-scale", min=0.001, help="Trace seconds per demo second."),
    ] = DEFAULT_TIME_SCALE,
    sim_bandwidth: Annotated[
        str | None,
        typer.Option(
            "--sim-bandwidth",
            help="Simulated copy rate of both nodes, snapshots and restores, e.g. 500GB/s "
            "(default: per pool and direction, so that snapshots and restores take what "
            "they took in the trace, scaled).",
        ),
    ] = None,
    sim_restore_bandwidth: Annotated[
        str | None,
        typer.Option(
            "--sim-restore-bandwidth",
            help="Simulated restore rate of both nodes, e.g. 1500GB/s (default: "
            "--sim-bandwidth if given, else derived per pool from the trace).",
        ),
    ] = None,
    sim_latency: Annotated[
        float, typer.Option("--sim-latency", min=0.0, help="Fixed cost per copy, demo seconds.")
    ] = 0.002,
    capacity: Annotated[
        str, typer.Option("--capacity", help="Memory per simulated device.")
    ] = "80GiB",
    contention: Annotated[
        float | None,
        typer.Option(
            "--contention",
            min=1.0,
            help="Phase stretch while jobs share the host (default: measured from the "
            "trace; 1 = ideal sharing).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the phase jitter.")] = 0,
    out: Annotated[
        Path, typer.Option("--out", help="Where timeline.html, summary.json and logs go.")
    ] = Path("demo-out"),
    events: Annotated[
        Path | None,
        typer.Option(
            "--events",
            help="Also save the orchestrator's events of both runs here, as the event log "
            "(JSON lines) that `tslice plan` reads.",
        ),
    ] = None,
    as_json: client_cmds.AsJson = False,
    no_live: Annotated[bool, typer.Option("--no-live", help="No live view.")] = False,
) -> None:
    """Simulated RL jobs share the pools of a recorded run: exclusive vs time-sliced."""
    from tslice.demo import runner

    config = runner.DemoConfig(
        trace_path=trace,
        jobs=jobs,
        steps=steps,
        time_scale=time_scale,
        # An empty flag value means the default too, as a missing one.
        sim_bandwidth_bytes_per_s=sizes.parse_rate_or_none(
            sim_bandwidth or None, option="--sim-bandwidth"
        ),
        sim_restore_bandwidth_bytes_per_s=sizes.parse_rate_or_none(
            sim_restore_bandwidth or None, option="--sim-restore-bandwidth"
        ),
        sim_latency_s=sim_latency,
        capacity_bytes=sizes.parse_bytes(capacity, option="--capacity"),
        contention=contention,
        out_dir=out,
        seed=seed,
        events_path=events,
    )
    config.check()
    progress = runner.DemoProgress(jobs=jobs, steps=steps, time_scale=time_scale)
    console = render.stdout()
    live = not as_json and not no_live and console.is_terminal
    if live:
        from rich.live import Live

        with Live(
            get_renderable=lambda: render.demo_live(progress),
            console=console,
            refresh_per_second=8,
        ):
            result = asyncio.run(runner.run_demo(config, progress=progress))
    else:
        if not as_json:
            console.print(
                f"tslice demo: {jobs} job(s) x {steps} steps, time scale {time_scale:g}; "
                "exclusive run, then time-sliced run..."
            )
        result = asyncio.run(runner.run_demo(config, progress=progress))
    # The table is only built when shown: --json needs nothing but the summary.
    view = "" if as_json else render.demo_summary(result)
    render.show(result.to_json(), view, as_json=as_json)
    if not result.ok:
        raise typer.Exit(1)
