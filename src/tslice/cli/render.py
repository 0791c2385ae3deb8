"""Rich rendering for the CLI: tables and views built from library results, no I/O of their own.

Commands hand their results here; nothing in this module talks to a server.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

import tslice.client as tsclient

if TYPE_CHECKING:
    # The demo pulls in the local cluster and the timeline; server commands should
    # not pay for that at start-up, so it is imported where it is drawn.
    from tslice.demo import runner
    from tslice.planner import plan as planning
    from tslice.planner import simulate

_STATE_STYLE = {
    "LOCKED": "green",
    "SWITCHING": "yellow",
    "IDLE_YIELDED": "cyan",
    "IDLE": "dim",
    "UNKNOWN": "bold red",
    "RUNNING": "green",
    "TRANSITIONING": "yellow",
    "SAVED": "cyan",
    "FAULTED": "bold red",
}


@functools.cache
def stdout() -> Console:
    return Console(highlight=False)


@functools.cache
def stderr() -> Console:
    return Console(stderr=True, highlight=False)


def error(message: str) -> None:
    """Print ONE line ``error: message`` on stderr (no wrapping, no markup)."""
    line = " ".join(message.split())
    stderr().print(Text(f"error: {line}", style="red"), soft_wrap=True)


def state(name: str) -> Text:
    return Text(name, style=_STATE_STYLE.get(name, ""))


def _or_dash(value: str) -> str:
    return value or "-"


# ---- client commands -------------------------------------------------------------------


def groups_table(statuses: Sequence[tsclient.GroupStatus]) -> RenderableType:
    if not statuses:
        return Text("no groups yet (a group appears on its first acquire in local mode)")
    # The degraded column only when a group has one: it is an alarm, not a routine fact.
    degraded = any(s.degraded for s in statuses)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    columns = ["group", "state", "holder", "resident", "queue", "nodes", "switches"]
    for column in [*columns, "degraded"] if degraded else columns:
        table.add_column(column, justify="right" if column in ("queue", "switches") else "left")
    for s in statuses:
        cells: list[RenderableType] = [
            s.group_id,
            Text.assemble(
                state(s.group_state.value), (" (draining)" if s.draining else "", "yellow")
            ),
            _or_dash(s.locking_job),
            _or_dash(s.loaded_job or s.active_job),
            str(s.waiter_queue_depth),
            ", ".join(s.nodes) or "-",
            str(s.switch_count),
        ]
        if degraded:
            nodes = ", ".join(d.node for d in s.degraded)
            cells.append(Text(nodes, style="bold red") if nodes else "-")
        table.add_row(*cells)
    return table


def group_status(status: tsclient.GroupStatus) -> RenderableType:
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    facts.add_row("state", state(status.group_state.value))
    if status.draining:
        facts.add_row(
            "", Text(f"drained: resume with tslice admin resume {status.group_id}", style="dim")
        )
    if status.detail:
        facts.add_row("detail", Text(status.detail, style="yellow"))
    for degraded in status.degraded:
        facts.add_row(
            "degraded",
            Text.assemble((degraded.node, "bold red"), f": {degraded.reason}"),
        )
    if status.degraded:
        facts.add_row(
            "",
            Text(f"fix the cause, then: tslice clear-degraded {status.group_id}", style="dim"),
        )
    facts.add_row("holder", _or_dash(status.locking_job))
    facts.add_row("active", _or_dash(status.active_job))
    facts.add_row("loaded", _or_dash(status.loaded_job))
    queue = ", ".join(status.waiting_jobs) if status.waiting_jobs else ""
    unlisted = status.waiter_queue_depth - len(status.waiting_jobs)
    if queue and unlisted > 0:  # (the server lists the first waiters of a long queue)
        queue += f", and {unlisted} more"
    facts.add_row("queue", f"{status.waiter_queue_depth}" + (f"  ({queue})" if queue else ""))
    facts.add_row("nodes", ", ".join(status.nodes) or "-")
    facts.add_row("grant epoch", str(status.grant_epoch))
    facts.add_row("switches", str(status.switch_count))
    if status.state_timestamp is not None:
        facts.add_row("since", status.state_timestamp.astimezone().strftime("%Y-%m-%d %H:%M:%S"))
    parts: list[RenderableType] = [facts]
    if status.agent_job_states:
        agents = Table(title="jobs on the agents", box=box.SIMPLE_HEAD, title_justify="left")
        agents.add_column("node")
        agents.add_column("job")
        agents.add_column("state")
        for a in sorted(status.agent_job_states, key=lambda a: (a.agent, a.job_id)):
            agents.add_row(a.agent, a.job_id, state(a.job_state.value))
        parts.append(agents)
    return Panel(Group(*parts), title=f"group {escape(status.group_id)}", expand=False)


def queue_position(status: tsclient.GroupStatus, job: str) -> int | None:
    """Queue position of ``job`` (1 = next), or None when it is not queued (yet)."""
    try:
        return status.waiting_jobs.index(job) + 1
    except ValueError:
        return None


def acquire_waiting(
    *, group: str, job: str, status: tsclient.GroupStatus | None, waited_s: float
) -> Text:
    """The live line of a waiting ``tslice acquire``."""
    waited = f"waited {waited_s:.1f} s"
    if status is None:
        return Text(f"job {job} waiting for group {group}; {waited}", style="yellow")
    position = queue_position(status, job)
    holder = f"held by {status.locking_job}" if status.locking_job else "free"
    depth = max(status.waiter_queue_depth, len(status.waiting_jobs))
    if position is not None:
        where = f"position {position} of {depth} in the queue ({holder})"
    elif len(status.waiting_jobs) < depth:  # (a long queue: its first waiters are listed)
        where = f"behind position {len(status.waiting_jobs)} of {depth} in the queue ({holder})"
    elif status.locking_job == job:
        where = "granted, moving its state onto the devices"
    else:
        where = f"joining the queue ({holder})"
    return Text(f"job {job} waiting for group {group}: {where}; {waited}", style="yellow")


def acquire_result(*, group: str, job: str, result: tsclient.AcquireResult) -> Text:
    restored = "restored its state" if result.context_restored else "no restore needed"
    return Text(
        f"job {job} holds group {group} (waited {result.waited_ms} ms, {restored}, "
        f"grant epoch {result.grant_epoch})"
    )


def acquire_set_result(*, job: str, results: Mapping[str, tsclient.AcquireResult]) -> Text:
    """Every group of an AcquireSet, one line each."""
    return Text("\n").join(
        acquire_result(group=group, job=job, result=result) for group, result in results.items()
    )


def yield_result(*, group: str, job: str, result: tsclient.YieldResult, held: bool = True) -> Text:
    if not held:
        return Text(f"job {job} did not hold group {group} (nobody does); nothing was released")
    if result.snapshot_deferred:
        tail = "nobody waits: its state stays resident (snapshot deferred)"
    else:
        tail = f"{result.pending_waiters} job(s) waiting; the next one is switched in"
    return Text(f"job {job} yielded group {group}; {tail}")


def cleared_degraded(*, group: str, node: str | None, cleared: Sequence[str]) -> Text:
    if cleared:
        return Text(
            f"group {group}: cleared degraded node(s) {', '.join(cleared)}; its switches run again"
        )
    if node:
        return Text(f"node {node} of group {group} was not degraded; nothing to clear")
    return Text(f"group {group} has no degraded node; nothing to clear")


def jsonable(value: Any) -> Any:
    """A client result (frozen dataclasses, enums, datetimes) as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def print_json(document: Any) -> None:
    """ONE JSON document on stdout (no colour, no wrapping): what ``--json`` prints."""
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


def show(document: Any, view: RenderableType, *, as_json: bool) -> None:
    """What a client command prints: ``document`` with ``--json``, else ``view``."""
    if as_json:
        print_json(document)
    else:
        stdout().print(view, soft_wrap=isinstance(view, str))  # (a path stays whole)


# ---- tslice up -------------------------------------------------------------------------


def cluster_table(
    *,
    rows: Sequence[tuple[str, str, int | None, str]],
    orchestrator: str,
    groups: Sequence[str] = (),
) -> RenderableType:
    """``rows`` = (component, address, pid, state dir); ``groups``: those given (--group)."""
    table = Table(title="tslice local cluster", box=box.SIMPLE_HEAD, title_justify="left")
    for column in ("component", "address", "pid", "state dir"):
        table.add_column(column)
    for name, address, pid, state_dir in rows:
        table.add_row(name, address, str(pid or "-"), state_dir)
    example = groups[0] if groups else "sampler"
    which = (
        f"\nGroups: {', '.join(groups)} (no others)"
        if groups
        else "\nA group is created by its first acquire."
    )
    hint = Text.assemble(
        ("Point a job at it:  ", "bold"),
        (f"export TSLICE_ORCHESTRATOR={orchestrator}", "cyan"),
        which,
        f"\nThen e.g.  tslice acquire {example} my-job;  tslice status {example}",
        "\nCtrl-C stops everything.",
    )
    return Group(table, hint)


# ---- tslice demo -----------------------------------------------------------------------


def demo_live(progress: runner.DemoProgress) -> RenderableType:
    """The live view: who holds each pool, each job's step and activity, the last switches."""
    now = time.time()
    scale = progress.time_scale
    header = Text.assemble(
        ("tslice demo  ", "bold"),
        (progress.stage, "cyan"),
        f"   {now - progress.run_started:5.1f} s demo" if progress.run else "",
    )
    bar = ProgressBar(total=max(progress.total_steps, 1), completed=progress.done_steps, width=50)
    steps = Text(f" {progress.done_steps}/{progress.total_steps} steps (both runs)")

    pools = Table(box=box.SIMPLE_HEAD, title="pools", title_justify="left")
    pools.add_column("pool")
    pools.add_column("node")
    pools.add_column("holder")
    pools.add_column("held for", justify="right")
    for pool in progress.pools:
        node = progress.nodes.get(pool, "one per job")
        holder = progress.holders.get(pool)
        if holder is None:
            pools.add_row(pool, node, Text("free", style="dim"), "")
        else:
            job, since = holder
            pools.add_row(
                pool,
                node,
                Text(f"job {job}", style="green"),
                f"{(now - since) * scale / 60:.1f} min",
            )

    jobs = Table(box=box.SIMPLE_HEAD, title="jobs", title_justify="left")
    jobs.add_column("job")
    jobs.add_column("step", justify="right")
    jobs.add_column("doing")
    jobs.add_column("holding")
    for view in progress.jobs.values():
        style = "yellow" if view.activity.startswith("wait") else ""
        jobs.add_row(
            view.job,
            f"{view.step}/{view.steps}",
            Text(view.activity, style=style),
            ", ".join(view.holding) or "-",
        )

    switches = Table(box=box.SIMPLE_HEAD, title="last switches", title_justify="left")
    switches.add_column("ago", justify="right")
    switches.add_column("pool")
    switches.add_column("from -> to")
    switches.add_column("took", justify="right")
    for sw in progress.switches:
        switches.add_row(
            f"{now - sw.t:4.1f} s",
            sw.group,
            f"{sw.from_job or '-'} -> {sw.to_job}",
            f"{sw.duration_s * scale:.1f} s trace",
        )
    made = "   ".join(f"{name}: {span:.1f} s" for name, span in progress.makespans.items())
    parts: list[RenderableType] = [header, Group(bar, steps), pools, jobs, switches]
    if made:
        parts.append(Text(f"makespans so far: {made}", style="dim"))
    return Panel(Group(*parts), expand=False)


def demo_summary(result: runner.DemoResult) -> RenderableType:
    scale = result.config.time_scale
    runs = Table(
        title=f"results (time scale {scale:g}: 1 demo second = {scale:g} trace seconds)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    runs.add_column("run")
    runs.add_column("makespan (trace)", justify="right")
    runs.add_column("makespan (demo)", justify="right")
    for pool in result.model.pools:
        runs.add_column(f"{pool} duty", justify="right")
    runs.add_column("switches", justify="right")
    for name, run in result.runs.items():
        runs.add_row(
            name,
            f"{run.makespan_s * scale / 60:.1f} min",
            f"{run.makespan_s:.1f} s",
            *(f"{run.duty[p]:.0%}" for p in result.model.pools),
            str(run.switches),
        )

    ops = Table(title="device-state moves (median)", box=box.SIMPLE_HEAD, title_justify="left")
    ops.add_column("operation")
    ops.add_column("pool")
    ops.add_column("simulated (trace s)", justify="right")
    ops.add_column("simulated (demo ms)", justify="right")
    ops.add_column("recorded (trace s)", justify="right")
    ops.add_column("count", justify="right")
    for label, table in (("snapshot", result.snapshot), ("restore", result.restore)):
        for pool, op in table.items():
            ops.add_row(
                label,
                pool,
                f"{op.trace_s:.1f}",
                f"{op.demo_ms:.0f}",
                f"{op.recorded_trace_s:.1f}",
                str(op.count),
            )

    lines: list[Text] = []
    speedup = result.speedup
    if speedup is not None:
        lines.append(
            Text.assemble(
                ("speedup ", "bold"),
                (f"{speedup:.2f}x", "bold green" if speedup > 1 else "bold red"),
                "  measured (exclusive makespan / time-sliced makespan); "
                + (
                    f"the recorded run gave {result.model.recorded.speedup}x"
                    if result.model.recorded.speedup
                    else "the trace records no outcome to compare with"
                ),
            )
        )
    else:
        lines.append(Text("one job: nothing to share, exclusive run only"))
    if result.violations:
        lines.append(
            Text(f"mutual exclusion: {len(result.violations)} VIOLATIONS", style="bold red")
        )
        lines.extend(Text(f"  {v}", style="red") for v in result.violations[:10])
    else:
        lines.append(
            Text.assemble(
                ("mutual exclusion: ", "bold"),
                ("0 violations", "bold green"),
                " (device journals of both nodes vs every acquire window)",
            )
        )
    lines.extend(Text(f"job error: {e}", style="red") for e in result.errors)
    lines.append(Text(f"timeline: {result.timeline_path}", style="cyan"))
    return Group(runs, ops, *lines)


def key_values(rows: Mapping[str, str]) -> RenderableType:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, value)
    return table


# ---- tslice events / tslice plan ---------------------------------------------------------


def event_line(event: tsclient.OrchestratorEvent) -> str:
    """One orchestrator event as a line of text (``tslice events`` without ``--json``)."""
    when = event.time.astimezone().strftime("%H:%M:%S.%f")[:-3] if event.time else "-"
    parts = [when, f"{event.kind.value:<14}", event.group_id]
    if event.job_id:
        parts.append(f"job {event.job_id}")
    if event.from_job:
        parts.append(f"from {event.from_job}")
    if event.node:
        parts.append(f"node {event.node}")
    if event.duration_ms:
        parts.append(f"{event.duration_ms} ms")
    if event.detail:
        parts.append(f"({event.detail})")
    return " ".join(parts)


def _seconds(value: float) -> str:
    if value >= 600:
        return f"{value / 60:.1f} min"
    return f"{value:.0f} s" if value >= 10 else f"{value:.2f} s" if value >= 1 else f"{value:.3f} s"


def _grouping(grouping: Sequence[Sequence[str]]) -> str:
    return "  ".join("{" + ", ".join(block) + "}" for block in grouping)


def plan_view(plan: planning.Plan, simulated: simulate.Simulated | None) -> RenderableType:
    """Profiles, the recommendation (predicted vs simulated) and the alternatives."""
    profiles = Table(
        title=f"job profiles ({plan.recording.kind} {plan.recording.path}); medians of "
        "hold, gap (a yield to the job's next request) and wait",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for column in ("job", "group", "windows", "busy", "duty", "hold", "gap (p10-p90)", "wait"):
        profiles.add_column(column, justify="left" if column in ("job", "group") else "right")
    for job in plan.profiles:
        for use in job.groups:
            profiles.add_row(
                job.job,
                use.group,
                str(use.windows),
                _seconds(use.busy_s),
                f"{use.duty:.0%}",
                _seconds(use.hold.median),
                f"{_seconds(use.gap.median)} ({_seconds(use.gap.p10)}-{_seconds(use.gap.p90)})"
                if use.gap.count
                else "-",
                _seconds(use.wait.median),
            )
    costs = Table(title="switch costs (median)", box=box.SIMPLE_HEAD, title_justify="left")
    for column in ("group", "snapshot", "restore", "SWITCH_DONE", "n", "beyond the copies"):
        costs.add_column(column, justify="left" if column == "group" else "right")
    for cost in plan.switch_costs:
        done = cost.switch_done
        costs.add_row(
            cost.group,
            _seconds(cost.snapshot_s),
            _seconds(cost.restore_s),
            _seconds(done.median) if done.count else "-",
            str(done.count),
            _seconds(cost.overhead_s) if done.count else "-",
        )
    best = plan.recommended
    rec = Table(
        title=f"recommended: {_grouping(best.grouping)} on {best.gpus} GPU(s)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for column in (
        "set",
        "jobs",
        "pools",
        "load",
        "hand-overs",
        "makespan predicted",
        "makespan simulated",
    ):
        rec.add_column(column, justify="right" if "makespan" in column else "left")
    for index, block in enumerate(best.blocks, 1):
        name = "+".join(block.jobs)
        measured = simulated.makespan_s.get(name) if simulated is not None else None
        rec.add_row(
            str(index),
            ", ".join(block.jobs),
            ", ".join(block.pools),
            " / ".join(f"{v:.0%}" for v in block.load.values()),
            str(sum(block.switches.values())),
            _seconds(block.makespan_s),
            _seconds(measured) if measured is not None else "-",
        )
    alternatives = Table(
        title=f"groupings considered ({plan.method} search: {plan.considered} scored; "
        "gain: GPU-seconds of the same work on dedicated pools / as grouped)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for column in ("grouping", "GPUs", "predicted gain", ""):
        alternatives.add_column(column, justify="right" if column == "predicted gain" else "left")
    for c in (best, *plan.alternatives):
        alternatives.add_row(_grouping(c.grouping), str(c.gpus), f"{c.gain:.2f}x", c.label)
    lines = [
        Text.assemble(("predicted gain ", "bold"), f"{best.gain:.2f}x", " over dedicated pools")
    ]
    if simulated is not None:
        lines.append(
            Text.assemble(
                ("simulated gain ", "bold"),
                f"{simulated.gain:.2f}x",
                f" (real orchestrator and sim agents at {simulated.time_scale:.3g}x the "
                f"recording's pace, {simulated.wall_s:.1f} s wall)",
            )
        )
        lines.extend(Text(f"error: {e}", style="red") for e in simulated.errors)
    else:
        lines.append(Text("simulated gain: not run (--no-simulate)", style="dim"))
    return Group(profiles, costs, rec, alternatives, *lines)
