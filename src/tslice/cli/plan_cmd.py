"""``tslice plan``: which jobs should share which pools, from a recording; ``--apply``
writes the topology it recommends."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tslice.cli import client_cmds, render

DEFAULT_TOPOLOGY = Path("topology.yaml")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def plan(
    source: Annotated[
        Path,
        typer.Argument(
            help="Event log (JSON lines of `tslice events --json` or `tslice demo --events`) "
            "or recorded trace (shared/traces/*.json).",
            show_default=False,
        ),
    ],
    *,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            help="Jobs to plan for, 2-26 (default: the recording's; job i replays "
            "recorded job i mod K).",
        ),
    ] = None,
    steps: Annotated[
        int,
        typer.Option("--steps", min=1, help="RL steps per job, predicted and simulated (1-100)."),
    ] = 4,
    max_sets: Annotated[
        int | None,
        typer.Option(
            "--max-sets",
            min=1,
            help="At most this many sets of pools (default: one per job at most).",
        ),
    ] = None,
    max_share: Annotated[
        int | None,
        typer.Option(
            "--max-share",
            min=1,
            help="At most this many jobs share one set of pools (bounds each job's "
            "slowdown; default: no bound).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the phase jitter.")] = 0,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate/--no-simulate",
            help="Replay the recommendation through a real orchestrator and sim agents.",
        ),
    ] = True,
    time_scale: Annotated[
        float | None,
        typer.Option(
            "--time-scale",
            min=0.000001,
            help="Recording seconds per wall second of the simulation (default: so that it "
            "takes about 8 s).",
        ),
    ] = None,
    apply: Annotated[
        bool, typer.Option("--apply", help="Write the recommended topology file (--out).")
    ] = False,
    out: Annotated[
        Path, typer.Option("--out", help="Where --apply writes the topology.")
    ] = DEFAULT_TOPOLOGY,
    agent: Annotated[
        list[str] | None,
        typer.Option(
            "--agent",
            help="Agent address host:port of each node of the written topology, in order "
            "(repeat; default 127.0.0.1:9001, :9002, ...).",
        ),
    ] = None,
    as_json: client_cmds.AsJson = False,
) -> None:
    """Recommend which jobs share which pools, from a recording; predicted vs simulated gain."""
    from tslice.planner import plan as planning
    from tslice.planner import simulate as simulation
    from tslice.planner import topology

    config = planning.PlanConfig(
        source=source, jobs=jobs, steps=steps, seed=seed, max_sets=max_sets, max_share=max_share
    )
    result = planning.make_plan(config)
    # The topology is built (and its addresses checked) before minutes of simulation.
    written = topology.text(result, agent) if apply else None
    simulated = None
    if simulate:
        simulated = simulation.run(result, time_scale=time_scale)
    document = planning.to_json(result)
    if simulated is not None:
        document["simulated"] = {
            "gain": round(simulated.gain, 4),
            "makespan_s": {k: round(v, 3) for k, v in simulated.makespan_s.items()},
            "solo_s": {k: round(v, 3) for k, v in simulated.solo_s.items()},
            "switches": dict(simulated.switches),
            "errors": list(simulated.errors),
            "time_scale": round(simulated.time_scale, 6),
            "wall_s": round(simulated.wall_s, 2),
        }
    if written is not None:
        topology.write(out, written)
        document["topology"] = str(out)
    view = "" if as_json else render.plan_view(result, simulated)
    render.show(document, view, as_json=as_json)
    if written is not None and not as_json:
        render.stdout().print(f"wrote {out} (the recommended topology)", soft_wrap=True)
    if simulated is not None and simulated.errors:
        raise typer.Exit(1)
