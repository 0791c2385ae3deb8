"""``tslice admin ...``: operator commands (with authentication on: the admin role).

- ``evict GROUP JOB [--reason TEXT]``: take JOB out of GROUP now (a holder loses the
  lock and the group moves on to its next waiter; a waiter's Acquire ends ABORTED);
- ``drain GROUP [--wait]``: GROUP grants no new turn; with ``--wait``, return once its
  holder has yielded (or was evicted) and no switch is in flight, showing who still
  holds it on a terminal;
- ``resume GROUP``: GROUP grants turns again;
- ``reset-fault GROUP [--node NODE]``: ClearDegraded under its operator's name;
- ``reset-term --agent HOST:PORT [--term N]``: set a node agent's leader-term fence
  (``tslice.cli.term_cmd``).

Credentials come as for every client (``$TSLICE_TLS_*``, ``$TSLICE_TOKEN*``). Exit codes:
0 done, 1 refused or failed (one line on stderr saying why), 2 bad input; ``drain
--wait`` exits 1 if the group is still busy when ``--timeout`` runs out (it stays drained).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Annotated

import typer
from rich.text import Text

import tslice.client as tsclient
from tslice.cli import client_cmds, render, term_cmd
from tslice.client import _admin
from tslice.common import errors

#: How often ``drain --wait`` reads the group.
_WAIT_POLL_S = 0.5
#: The bound of each read of ``drain --wait`` (its own ``--timeout`` bounds the whole wait).
_READ_TIMEOUT_S = 10.0

Reason = Annotated[
    str,
    typer.Option("--reason", help="Why (the evicted job is told; it is logged)."),
]


def register(app: typer.Typer) -> None:
    """Add ``tslice admin`` and its commands to ``app``."""
    admin = typer.Typer(
        name="admin",
        help="Operator commands (with authentication on: the admin role).",
        no_args_is_help=True,
    )
    admin.command("evict")(evict)
    admin.command("drain")(drain)
    admin.command("resume")(resume)
    admin.command("reset-fault")(client_cmds.clear_degraded)
    admin.command("reset-term")(term_cmd.reset_term)
    app.add_typer(admin)


@contextlib.contextmanager
def _admin_client(
    address: str, *, connect_timeout: float | None, timeout: float | None
) -> Iterator[tsclient.Client]:
    """The client commands' client; a NOT_FOUND here already says where to look."""
    with client_cmds._client(address, connect_timeout=connect_timeout, timeout=timeout) as client:
        try:
            yield client
        except errors.NotFound as err:
            raise errors.TsliceError(err.message) from err


def evict(
    group: client_cmds.GroupArg,
    job: client_cmds.JobArg,
    *,
    reason: Reason = "",
    addr: client_cmds.Address = client_cmds.DEFAULT_ADDRESS,
    timeout: client_cmds.Timeout = 10.0,
    connect_timeout: client_cmds.ConnectTimeout = None,
    as_json: client_cmds.AsJson = False,
) -> None:
    """Take JOB out of GROUP now.

    If it holds GROUP, the lock is taken from it and the next waiter is switched in; if
    it waits, its Acquire ends (ABORTED, with the reason).
    """
    with _admin_client(addr, connect_timeout=connect_timeout, timeout=timeout) as client:
        evictions = client.evict(group, job, reason=reason, timeout=timeout)
    render.show(
        {
            "group_id": group,
            "job_id": job,
            "reason": reason,
            "evictions": [render.jsonable(e) for e in evictions],
        },
        evicted_view(job, evictions),
        as_json=as_json,
    )


def evicted_view(job: str, evictions: Sequence[_admin.Eviction]) -> Text:
    lines = []
    for e in evictions:
        if e.role is _admin.EvictedRole.WAITER:
            what = "it was waiting; its Acquire ended"
        elif e.next_job:
            what = f"it held it; {e.next_job} is next"
        else:
            what = "it held it; nobody waits, its state stays resident until needed"
        lines.append(f"job {job} evicted from group {e.group_id} ({what})")
    return Text("\n".join(lines))


def drain(
    group: client_cmds.GroupArg,
    *,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Return once GROUP has no holder and no switch in flight."),
    ] = False,
    addr: client_cmds.Address = client_cmds.DEFAULT_ADDRESS,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            callback=client_cmds._seconds,
            help="Give up after this many seconds (default: 10; with --wait: no limit).",
        ),
    ] = None,
    connect_timeout: client_cmds.ConnectTimeout = None,
    as_json: client_cmds.AsJson = False,
) -> None:
    """Stop GROUP granting new turns.

    Its holder keeps its turn until it yields (or is evicted), waiters stay queued, new
    Acquires are queued. Survives a restart of the orchestrator; `tslice admin resume
    GROUP` undoes it.
    """
    started = time.monotonic()
    # Each call's bound; with --wait, --timeout bounds the whole wait instead.
    bound = _READ_TIMEOUT_S if wait or timeout is None else timeout
    with _admin_client(addr, connect_timeout=connect_timeout, timeout=bound) as client:
        state = client.drain(group, timeout=bound)
        if wait and _is_busy(state):
            with _waiting_line(group) as line:
                state = _wait_idle(client, state, started=started, timeout=timeout, line=line)
    document = {"group_id": group, "idle": not _is_busy(state), **render.jsonable(state)}
    if wait and _is_busy(state):
        if as_json:
            render.print_json(document)
        raise errors.TsliceError(
            f"group {group} is drained but still {_busy(state)} after {timeout:g} s; "
            "it stays drained (wait longer, or `tslice admin evict` the holder)"
        )
    render.show(document, drained_view(group, state, waited=wait), as_json=as_json)


def _is_busy(state: _admin.DrainState) -> bool:
    return bool(state.locking_job) or state.switching


def _busy(state: _admin.DrainState) -> str:
    if state.locking_job:
        return f"held by {state.locking_job}"
    return "switching" if state.switching else "idle"


def drained_view(group: str, state: _admin.DrainState, *, waited: bool) -> Text:
    waiting = f"{state.waiter_queue_depth} job(s) waiting"
    if not _is_busy(state):
        busy = "no holder, no switch in flight" + (" (drained)" if waited else "")
        return Text(f"group {group} drained: grants no new turn; {busy}; {waiting}")
    return Text(
        f"group {group} drained: grants no new turn; {_busy(state)} until it yields; "
        f"{waiting} (`--wait` waits for it)"
    )


class _Line:
    """The latest status read by ``drain --wait`` (None: none yet), and its live line."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.latest: tsclient.GroupStatus | None = None
        self._started = time.monotonic()

    def view(self) -> Text:
        waited = f"waited {time.monotonic() - self._started:.1f} s"
        status = self.latest
        if status is None:
            return Text(f"group {self.group} draining; {waited}", style="yellow")
        busy = (
            f"held by {status.locking_job}"
            if status.locking_job
            else status.group_state.value.lower()
        )
        waiting = f"{status.waiter_queue_depth} job(s) waiting"
        return Text(f"group {self.group} draining: {busy}; {waiting}; {waited}", style="yellow")


@contextlib.contextmanager
def _waiting_line(group: str) -> Iterator[_Line]:
    """On a terminal, a live line on stderr with who still holds the group."""
    line = _Line(group)
    console = render.stderr()
    if not console.is_terminal:
        yield line
        return
    from rich.live import Live

    with Live(get_renderable=line.view, console=console, refresh_per_second=4, transient=True):
        yield line


def _wait_idle(
    client: tsclient.Client,
    state: _admin.DrainState,
    *,
    started: float,
    timeout: float | None,
    line: _Line,
) -> _admin.DrainState:
    """Read the group until it has no holder and no switch in flight, or until ``timeout``
    (from ``started``) runs out; ``state`` as the last read found it."""
    group = line.group
    while True:
        status = line.latest = client.status(group, timeout=_READ_TIMEOUT_S)
        state = dataclasses.replace(
            state,
            locking_job=status.locking_job,
            switching=status.group_state is tsclient.GroupState.SWITCHING,
            waiter_queue_depth=status.waiter_queue_depth,
        )
        left = None if timeout is None else timeout - (time.monotonic() - started)
        if not _is_busy(state) or (left is not None and left <= 0):
            return state
        time.sleep(_WAIT_POLL_S if left is None else min(_WAIT_POLL_S, left))


def resume(
    group: client_cmds.GroupArg,
    *,
    addr: client_cmds.Address = client_cmds.DEFAULT_ADDRESS,
    timeout: client_cmds.Timeout = 10.0,
    connect_timeout: client_cmds.ConnectTimeout = None,
    as_json: client_cmds.AsJson = False,
) -> None:
    """Let a drained GROUP grant turns again (the head of its queue first)."""
    with _admin_client(addr, connect_timeout=connect_timeout, timeout=timeout) as client:
        state = client.resume(group, timeout=timeout)
    if state.was_draining:
        holder = f"held by {state.locking_job}" if state.locking_job else "free"
        waiting = f"{state.waiter_queue_depth} job(s) waiting"
        view = Text(f"group {group} resumed: grants turns again ({holder}; {waiting})")
    else:
        view = Text(f"group {group} was not drained; nothing changed")
    render.show({"group_id": group, **render.jsonable(state)}, view, as_json=as_json)
