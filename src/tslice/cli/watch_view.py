"""How ``tslice watch`` draws a :class:`~tslice.cli.watch_data.View` with rich: groups,
queues, switches under way, degraded nodes and recent events, each a compact table that
fits an 80-column terminal (long names and reasons are cut with an ellipsis)."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tslice.cli import render, watch_data


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _table(title: str) -> Table:
    return Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
        expand=False,
        show_edge=False,
    )


def _col(table: Table, name: str, *, width: int | None = None, right: bool = False) -> None:
    table.add_column(
        name,
        max_width=width,
        no_wrap=True,
        overflow="ellipsis",
        justify="right" if right else "left",
    )


def view(data: watch_data.View, *, events: int = 8, width: int = 80) -> RenderableType:
    """The whole screen: a header line, then the tables that have rows."""
    parts: list[RenderableType] = [_header(data, width)]
    parts.append(_groups(data))
    if data.waiters:
        parts.append(_queues(data))
    if data.switches:
        parts.append(_switches(data))
    if data.degraded:
        parts.append(_degraded(data, width))
    parts.append(_events(data, events, width))
    return Group(*parts)


def _header(data: watch_data.View, width: int) -> Text:
    text = Text("tslice watch ", style="bold")
    text.append(f"{data.address} ({data.transport})", style="cyan")
    if data.age_s is None:
        text.append("  connecting...", style="yellow")
    else:
        stale = data.age_s > 5
        text.append(f"  updated {_age(data.age_s)} ago", style="yellow" if stale else "dim")
    text.append("  Ctrl-C quits", style="dim")
    if data.problem:
        text.append("\n")
        text.append(data.problem, style="red")
    text.truncate(width * (2 if data.problem else 1), overflow="ellipsis")
    return text


def _groups(data: watch_data.View) -> RenderableType:
    table = _table("Groups")
    _col(table, "group", width=14)
    _col(table, "state", width=12)
    _col(table, "holder", width=12)
    _col(table, "held", width=8, right=True)
    _col(table, "wait", width=4, right=True)
    _col(table, "switches", width=8, right=True)
    _col(table, "detail", width=14)
    if not data.groups:
        return Text("Groups: none yet (a group appears with its first Acquire in local mode)")
    for g in data.groups:
        state = render.state(g.state)
        if g.draining:
            state.append(" drain", style="magenta")
        table.add_row(
            g.group,
            state,
            g.holder or "-",
            _age(g.held_s),
            str(g.waiting),
            str(g.switches),
            Text(g.detail, style="dim"),
        )
    return table


def _queues(data: watch_data.View) -> RenderableType:
    table = _table("Queues")
    _col(table, "group", width=14)
    _col(table, "#", width=3, right=True)
    _col(table, "job", width=16)
    _col(table, "waiting", width=9, right=True)
    _col(table, "policy", width=28)
    policies = {g.group: g.policy for g in data.groups}
    for w in data.waiters:
        waited = Text(_age(w.waited_s))
        if w.waited_s is not None and w.waited_s > 60:
            waited.stylize("yellow")
        table.add_row(w.group, str(w.position), w.job, waited, policies.get(w.group, "") or "-")
    return table


def _switches(data: watch_data.View) -> RenderableType:
    table = _table("Switches in progress")
    _col(table, "group", width=14)
    _col(table, "jobs", width=17)
    _col(table, "node", width=12)
    _col(table, "snapshot", width=9, right=True)
    _col(table, "restore", width=9, right=True)
    _col(table, "for", width=8, right=True)
    for sw in data.switches:
        jobs = f"{sw.from_job or '-'} -> {sw.to_job or '?'}"
        for i, node in enumerate(sw.nodes or (watch_data.NodeProgress("?"),)):
            table.add_row(
                sw.group if i == 0 else "",
                jobs if i == 0 else "",
                node.node,
                _done(node.snapshot_s),
                _done(node.restore_s),
                _age(sw.running_s) if i == 0 else "",
            )
        if sw.detail:
            table.add_row("", Text(sw.detail, style="yellow"), "", "", "", "")
    return table


def _done(seconds: float | None) -> Text:
    if seconds is None:
        return Text("...", style="yellow")
    return Text(f"{seconds * 1000:.0f} ms" if seconds < 10 else _age(seconds), style="green")


def _degraded(data: watch_data.View, width: int) -> RenderableType:
    table = _table("Degraded nodes")
    _col(table, "group", width=14)
    _col(table, "node", width=14)
    # The reason is what the operator acts on: wrapped within the width, not cut.
    table.add_column("reason", max_width=max(width - 34, 20), overflow="fold")
    for d in data.degraded:
        table.add_row(d.group, d.node, Text(d.reason, style="red"))
    return table


def _events(data: watch_data.View, count: int, width: int) -> RenderableType:
    lines = [Text("Recent events", style="bold")]
    for event in list(data.events)[-count:] if count else []:
        line = Text(render.event_line(event), no_wrap=True)
        line.truncate(width, overflow="ellipsis")
        lines.append(line)
    if len(lines) == 1:
        lines.append(Text("none yet", style="dim"))
    return Group(*lines)
