"""``tslice events``: the orchestrator's events, live or from its history.

Without ``--since`` it streams the live events until interrupted (``--count``, ``--for``).
With ``--since 2h`` (or a time) it prints the stored events from then on (to ``--until``),
oldest first, and ends; ``--follow`` goes on with the live ones without a gap. ``--json``
prints an event log (JSON lines, what ``tslice plan`` reads); ``--export FILE`` writes the
events in the recorded-run format of ``shared/traces/`` instead (what ``tslice plan``,
``bench/trace_replay.py`` and ``tslice timeline --from`` read as a trace).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

import tslice.client as tsclient
from tslice.cli import client_cmds, render
from tslice.common import errors

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)\s*$")
_UNIT_S = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}

Since = Annotated[
    str | None,
    typer.Option(
        "--since",
        help="Stored events from this time on: a duration back from now (90s, 30m, 2h, 7d) "
        "or a time (2026-05-01T14:00, local time unless it names its zone).",
    ),
]
Until = Annotated[
    str | None,
    typer.Option("--until", help="With --since: stored events up to this time (same forms)."),
]
GroupOpt = Annotated[
    str | None, typer.Option("--group", help="Only this group's events (default: every group).")
]
JobOpt = Annotated[
    str | None, typer.Option("--job", help="Only events naming this job (as job or from_job).")
]


def register(app: typer.Typer) -> None:
    app.command("events")(events)


def parse_time(
    value: str, *, option: str, now: datetime.datetime | None = None
) -> datetime.datetime:
    """``2h`` (back from ``now``) or an ISO 8601 time; BadParameter naming the forms."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    found = _RELATIVE.match(value)
    if found:
        return now - datetime.timedelta(seconds=float(found.group(1)) * _UNIT_S[found.group(2)])
    try:
        when = datetime.datetime.fromisoformat(value.strip())
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not a time: give a duration back from now (90s, 30m, 2h, 7d) or "
            "an ISO 8601 time (2026-05-01T14:00)",
            param_hint=option,
        ) from None
    return when if when.tzinfo is not None else when.astimezone()


def stored_range(
    since: str | None, until: str | None, *, job: str | None, follow: bool
) -> tsclient.StoredEvents | None:
    """What the orchestrator is asked to replay (None: live events only)."""
    if since is None:
        if until is not None:
            raise typer.BadParameter("--until needs --since", param_hint="--until")
        return None
    start = parse_time(since, option="--since")
    end = parse_time(until, option="--until") if until is not None else None
    if end is not None and end < start:
        raise typer.BadParameter(
            f"--until ({end.isoformat(timespec='seconds')}) is before --since "
            f"({start.isoformat(timespec='seconds')})",
            param_hint="--until",
        )
    if end is not None and follow:
        raise typer.BadParameter("--follow goes on live: drop --until", param_hint="--follow")
    return tsclient.StoredEvents(since=start, until=end, job=job, follow=follow)


def stored_events(
    address: str,
    *,
    group: str | None,
    stored: tsclient.StoredEvents,
    connect_timeout: float | None,
    timeout: float | None = None,
) -> list[tsclient.OrchestratorEvent]:
    """Every stored event of the range (a history read that ends)."""
    with client_cmds.connected(address, connect_timeout=connect_timeout, timeout=timeout) as client:
        stream = client.watch_events(group, timeout=timeout, stored=stored)
        try:
            return list(stream)
        finally:
            stream.close()  # type: ignore[attr-defined]


def events(
    group_arg: Annotated[
        str | None,
        typer.Argument(metavar="[GROUP]", help="Only this group's events (the same as --group)."),
    ] = None,
    *,
    group: GroupOpt = None,
    job: JobOpt = None,
    since: Since = None,
    until: Until = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="With --since: after the stored events, go on with live ones."
        ),
    ] = False,
    kind: Annotated[
        list[str] | None,
        typer.Option(
            "--kind",
            help="Only events of this kind, e.g. GRANTED, SWITCH_DONE (repeat; default: all).",
        ),
    ] = None,
    count: Annotated[
        int | None, typer.Option("--count", min=1, help="Stop after this many events.")
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            "--for", callback=client_cmds.seconds_option, help="Stop after this many seconds."
        ),
    ] = None,
    export: Annotated[
        Path | None,
        typer.Option(
            "--export",
            help="With --since: write the events in the recorded-run format (shared/traces/) "
            "to this file, for `tslice plan`, `tslice timeline --from` and trace replays.",
        ),
    ] = None,
    time_scale: Annotated[
        float,
        typer.Option(
            "--time-scale",
            min=0.000001,
            help="With --export: seconds of the recording per second of the run (1 for a real "
            "run; a time-compressed run's speed-up, e.g. the demo's 750).",
        ),
    ] = 1.0,
    addr: client_cmds.Address = client_cmds.DEFAULT_ADDRESS,
    connect_timeout: client_cmds.ConnectTimeout = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object per event and line: an event log `tslice plan` reads.",
        ),
    ] = False,
) -> None:
    """Print the orchestrator's events: live (until interrupted, --count or --for), or the
    stored ones from --since (then live with --follow).

    Save them for `tslice plan` with `tslice events --since 2h --export run.json` (or
    `tslice events --json > events.jsonl` while jobs run).
    """
    if group and group_arg and group != group_arg:
        raise typer.BadParameter(
            f"two groups given ({group_arg!r} and --group {group!r}); give one"
        )
    group = group or group_arg
    stored = stored_range(since, until, job=job, follow=follow)
    if export is not None:
        if stored is None or follow:
            raise typer.BadParameter(
                "--export writes stored events: give --since (and no --follow)",
                param_hint="--export",
            )
        _export(
            addr,
            group=group,
            stored=stored,
            path=export,
            time_scale=time_scale,
            connect_timeout=connect_timeout,
        )
        return
    kinds = [_event_kind(k) for k in kind or ()]
    seen = 0
    with client_cmds.connected(addr, connect_timeout=connect_timeout, timeout=duration) as client:
        stream = client.watch_events(group, kinds=kinds, timeout=duration, stored=stored)
        try:
            # Live only: the job is filtered here (the server filters a replay).
            for event in _of_job(stream, job if stored is None else None):
                if as_json:
                    render.print_json(render.jsonable(event))
                else:
                    render.stdout().print(render.event_line(event), highlight=False)
                seen += 1
                if count is not None and seen >= count:
                    break
        except errors.DeadlineExceeded:
            pass  # --for ran out: that is the end asked for
        finally:
            stream.close()  # type: ignore[attr-defined]


def _of_job(
    stream: Iterator[tsclient.OrchestratorEvent], job: str | None
) -> Iterator[tsclient.OrchestratorEvent]:
    for event in stream:
        if not job or job in (event.job_id, event.from_job):
            yield event


def history_document(
    address: str,
    *,
    group: str | None,
    stored: tsclient.StoredEvents,
    time_scale: float,
    connect_timeout: float | None,
) -> tuple[dict[str, Any], int]:
    """The stored events of the range in the recorded-run format, from the first event
    (``--since`` may be long before it) to ``until`` or the last; and how many there were.
    TsliceError when there is none."""
    from tslice.timeline import export

    found = stored_events(address, group=group, stored=stored, connect_timeout=connect_timeout)
    if not found:
        raise errors.TsliceError(
            f"no stored event from {stored.since.isoformat(timespec='seconds')} on"
            + (f" of group {group!r}" if group else "")
            + (f" naming job {stored.job!r}" if stored.job else "")
            + " (`tslice events --since 7d` lists what is kept)"
        )
    doc = export.document(
        [export.record(e) for e in found],
        time_scale=time_scale,
        label=f"tslice run from {stored.since.astimezone().isoformat(timespec='seconds')}",
        end=stored.until.timestamp() if stored.until is not None else None,
    )
    return doc, len(found)


def _export(
    address: str,
    *,
    group: str | None,
    stored: tsclient.StoredEvents,
    path: Path,
    time_scale: float,
    connect_timeout: float | None,
) -> None:
    doc, count = history_document(
        address, group=group, stored=stored, time_scale=time_scale, connect_timeout=connect_timeout
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    windows = sum(len(w) for w in doc["timeslice"]["windows"].values())
    render.stdout().print(
        f"wrote {path}: {count} events, {windows} lock windows, "
        f"{doc['summary'].get('swaps', 0)} switches",
        highlight=False,
        soft_wrap=True,  # a path stays whole however narrow the terminal
    )


def _event_kind(name: str) -> tsclient.EventKind:
    try:
        return tsclient.EventKind(name.strip().upper())
    except ValueError:
        known = ", ".join(
            k.value for k in tsclient.EventKind if k != tsclient.EventKind.UNSPECIFIED
        )
        raise typer.BadParameter(f"unknown event kind {name!r}; one of {known}") from None
