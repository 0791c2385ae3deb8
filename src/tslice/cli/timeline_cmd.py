"""``tslice timeline``: a picture of a run, as a self-contained HTML page and a PNG.

From the orchestrator's event history (``--since 2h``, ``--until``, ``--group``, ``--job``)
or from a file (``--from``): a recorded run (``shared/traces/*.json``, ``tslice events
--export``) or an event log (``tslice events --json``, ``tslice demo --events``). The same
drawing as the demo's (:mod:`tslice.timeline`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from tslice.cli import client_cmds, events_cmd, render
from tslice.common import errors

_FROM_FIX = (
    "give a recorded run (a JSON object with 'timeslice': shared/traces/*.json or `tslice "
    "events --since 2h --export FILE`) or an event log (JSON lines of `tslice events --json`)"
)


def register(app: typer.Typer) -> None:
    app.command("timeline")(timeline)


def timeline(
    *,
    source: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="A saved run instead of the orchestrator's history: a recorded run "
            "(shared/traces/*.json, `tslice events --export`) or an event log (JSON lines).",
        ),
    ] = None,
    since: events_cmd.Since = None,
    until: events_cmd.Until = None,
    group: events_cmd.GroupOpt = None,
    job: events_cmd.JobOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Where the HTML page goes.")] = Path(
        "timeline.html"
    ),
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Where the PNG goes (default: beside --out, .png)."),
    ] = None,
    no_png: Annotated[bool, typer.Option("--no-png", help="Write the HTML page only.")] = False,
    title: Annotated[str | None, typer.Option("--title", help="The page's title.")] = None,
    time_scale: Annotated[
        float,
        typer.Option(
            "--time-scale",
            min=0.000001,
            help="For events: seconds drawn per second of the run (a time-compressed run's "
            "speed-up, e.g. the demo's 750); 1 = the run's own clock.",
        ),
    ] = 1.0,
    addr: client_cmds.Address = client_cmds.DEFAULT_ADDRESS,
    connect_timeout: client_cmds.ConnectTimeout = None,
    as_json: client_cmds.AsJson = False,
) -> None:
    """Draw a run: lock windows per pool, switches with their durations, duty per GPU and
    a summary, as an HTML page (no network needed to open it) and a PNG."""
    from tslice.timeline import html as timeline_html
    from tslice.timeline import png as timeline_png
    from tslice.timeline import recorded

    if source is not None:
        if since is not None or until is not None:
            raise typer.BadParameter(
                "--from draws a saved run; --since/--until read the orchestrator's history: "
                "give one of them",
                param_hint="--from",
            )
        doc = _load(source, time_scale=time_scale)
    else:
        if since is None:
            raise typer.BadParameter(
                "say which run: --since 2h (the orchestrator's history) or --from FILE",
                param_hint="--since",
            )
        stored = events_cmd.stored_range(since, until, job=job, follow=False)
        assert stored is not None
        doc, _ = events_cmd.history_document(
            addr, group=group, stored=stored, time_scale=time_scale, connect_timeout=connect_timeout
        )
    drawn = recorded.timeline(doc, title=title)
    written = [timeline_html.write(out, timeline_html.render(drawn))]
    if not no_png:
        written.append(timeline_png.write(png or out.with_suffix(".png"), drawn))
    runs = {r.name: {"windows": len(r.windows), "switches": len(r.switches)} for r in drawn.runs}
    document = {"files": [str(p) for p in written], "runs": runs, "summary": dict(drawn.summary)}
    view = "\n".join(f"wrote {p}" for p in written)
    render.show(document, view, as_json=as_json)


def _load(path: Path, *, time_scale: float) -> dict[str, Any]:
    from tslice.timeline import export

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise errors.ConfigError(f"{path} does not exist: {_FROM_FIX}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise errors.ConfigError(f"{path} cannot be read ({err}): {_FROM_FIX}") from None
    try:
        whole: Any = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, Mapping) and "timeslice" in whole:
        return dict(whole)
    records: list[Mapping[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise errors.ConfigError(f"{path} line {number} is not JSON: {_FROM_FIX}") from None
        if not isinstance(record, Mapping) or not {"kind", "group_id", "time"} <= set(record):
            raise errors.ConfigError(
                f"{path} line {number} is not an orchestrator event: {_FROM_FIX}"
            )
        records.append(record)
    if not records:
        raise errors.ConfigError(f"{path} is empty: {_FROM_FIX}")
    return export.document(records, time_scale=time_scale, label=path.stem)
