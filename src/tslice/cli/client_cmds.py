"""Client commands: ``tslice list``, ``status``, ``acquire``, ``yield``, ``clear-degraded``
(``tslice events`` is :mod:`tslice.cli.events_cmd`).

Each parses its options, calls :class:`tslice.client.Client` and hands the result to
:mod:`tslice.cli.render`. Errors become one line and exit code 1 (2 for bad input).
The CLI never retries: a command answers now or says why it cannot.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Annotated

import typer

import tslice.client as tsclient
from tslice.cli import render
from tslice.common import errors

DEFAULT_ADDRESS = "127.0.0.1:50051"

Address = Annotated[
    str,
    typer.Option(
        "--addr",
        envvar="TSLICE_ORCHESTRATOR",
        help="Orchestrator address host:port.",
        show_envvar=True,
    ),
]


def _seconds(value: float | None) -> float | None:
    """Seconds > 0: 0 would be a deadline already passed."""
    if value is not None and value <= 0:
        raise typer.BadParameter(f"must be more than 0 seconds (got {value:g})")
    return value


#: For the other command modules: a seconds option's check.
seconds_option = _seconds

Timeout = Annotated[
    float,
    typer.Option("--timeout", callback=_seconds, help="Give up after this many seconds."),
]
ConnectTimeout = Annotated[
    float | None,
    typer.Option(
        "--connect-timeout",
        callback=_seconds,
        help="How long to wait for the orchestrator to answer at all, s "
        "(default: $TSLICE_CONNECT_TIMEOUT_S if set, else 1).",
    ),
]
AsJson = Annotated[
    bool,
    typer.Option("--json", help="Print one JSON document on stdout (for scripts)."),
]
GroupArg = Annotated[str, typer.Argument(help="Group id.")]
JobArg = Annotated[str, typer.Argument(help="Job id.")]

#: The CLI's bound on reaching the orchestrator: a command answers now or says why, and
#: nobody typing a command waits for an orchestrator that is only starting up. Longer
#: with --connect-timeout or $TSLICE_CONNECT_TIMEOUT_S (which the client reads itself).
CONNECT_TIMEOUT_S = 1.0
_CONNECT_TIMEOUT_ENV = "TSLICE_CONNECT_TIMEOUT_S"

#: How often a waiting `tslice acquire` on a terminal reads its queue position.
_POSITION_POLL_S = 0.5

_UNREACHABLE_HINTS = ("failed to connect", "connection refused", "dns resolution", "unreachable")


def register(app: typer.Typer) -> None:
    app.command("list")(list_groups)
    app.command("status")(status)
    app.command("acquire")(acquire)
    app.command("yield")(yield_)
    app.command("clear-degraded")(clear_degraded)


def _within(*bounds: float | None) -> str:
    """ " within N s" for the shortest of the bounds that apply, "" when none does."""
    given = [b for b in bounds if b is not None]
    return f" within {min(given):g} s" if given else ""


@contextlib.contextmanager
def _client(
    address: str,
    *,
    connect_timeout: float | None,
    timeout: float | None,
    job_id: str | None = None,
) -> Iterator[tsclient.Client]:
    bound = (
        connect_timeout
        if connect_timeout is not None
        else tsclient.USE_CLIENT_DEFAULT
        if os.environ.get(_CONNECT_TIMEOUT_ENV)
        else CONNECT_TIMEOUT_S
    )
    # No lease: `tslice acquire` exits while the job keeps the group until `tslice yield`.
    client = tsclient.Client(
        address, job_id=job_id, retry=tsclient.NO_RETRY, lease_s=None, connect_timeout=bound
    )
    try:
        yield client
    except errors.Unavailable as err:
        text = err.message.lower()
        if text.startswith("group "):
            # The orchestrator's own answer (an Acquire that a fault holds back names the
            # unreachable agents): it is reachable, and the message says what to do.
            raise errors.TsliceError(err.message) from err
        if any(hint in text for hint in _UNREACHABLE_HINTS):
            waited = _within(client.config.connect_timeout, timeout)
            # Nothing listens there: whether it would serve TLS is not the question.
            refused = "connection refused" in text
            tls_hint = "" if refused else f" {client.config.security.connect_hint()};"
            raise errors.TsliceError(
                f"orchestrator at {address} is not reachable{waited} (is `tslice up` "
                f"running?{tls_hint} --connect-timeout waits longer)"
            ) from err
        raise errors.TsliceError(
            f"orchestrator at {address} is unavailable: {err.message}"
        ) from err
    except errors.NotFound as err:
        # An unknown group, or a node not in the group: `tslice list` shows both.
        raise errors.TsliceError(f"{err.message} (see `tslice list`)") from err
    except errors.NotHolder as err:
        raise errors.TsliceError(err.message) from err
    except errors.InvalidArgument as err:
        render.error(err.message)
        raise typer.Exit(2) from err
    except errors.RPCError as err:
        raise errors.TsliceError(f"{err.status.name.lower()}: {err.message}") from err
    finally:
        client.close()


#: For the other command modules: a client whose errors become one line (see _client).
connected = _client


def list_groups(
    *,
    addr: Address = DEFAULT_ADDRESS,
    timeout: Timeout = 10.0,
    connect_timeout: ConnectTimeout = None,
    as_json: AsJson = False,
) -> None:
    """List the groups the orchestrator knows, with their state."""
    with _client(addr, connect_timeout=connect_timeout, timeout=timeout) as client:
        statuses = [client.status(g, timeout=timeout) for g in client.list_groups(timeout=timeout)]
    render.show(
        {"groups": [render.jsonable(s) for s in statuses]},
        render.groups_table(statuses),
        as_json=as_json,
    )


def status(
    group: GroupArg,
    *,
    addr: Address = DEFAULT_ADDRESS,
    timeout: Timeout = 10.0,
    connect_timeout: ConnectTimeout = None,
    as_json: AsJson = False,
) -> None:
    """Show a group: state, holder, active/loaded job, queue, degraded nodes, and each
    node's job states."""
    with _client(addr, connect_timeout=connect_timeout, timeout=timeout) as client:
        result = client.status(group, timeout=timeout)
    render.show(render.jsonable(result), render.group_status(result), as_json=as_json)


def acquire(
    group: Annotated[
        str,
        typer.Argument(
            help="Group id; several, comma-separated (sampler,trainer), are acquired "
            "together: all or nothing (AcquireSet)."
        ),
    ],
    job: JobArg,
    *,
    addr: Address = DEFAULT_ADDRESS,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", callback=_seconds, help="Give up waiting after this many seconds."
        ),
    ] = None,
    connect_timeout: ConnectTimeout = None,
    footprint: Annotated[
        int | None,
        typer.Option("--footprint", min=0, help="Device bytes per node (simulated devices)."),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Wait until JOB holds GROUP (its state resident on every node), then return.

    While it waits on a terminal, a status line shows its place in the queue (of the
    first group of a set).
    """
    groups = [g.strip() for g in group.split(",")]
    with (
        _client(addr, connect_timeout=connect_timeout, timeout=timeout, job_id=job) as client,
        _waiting_line(client, group=groups[0], job=job),
    ):
        if len(groups) > 1:
            results = client.acquire_set(groups, timeout=timeout, footprint_bytes=footprint)
        else:
            result = client.acquire(group, timeout=timeout, footprint_bytes=footprint)
    if len(groups) > 1:
        render.show(
            {"job_id": job, "groups": {g: render.jsonable(r) for g, r in results.items()}},
            render.acquire_set_result(job=job, results=results),
            as_json=as_json,
        )
        return
    render.show(
        {"group_id": group, "job_id": job, **render.jsonable(result)},
        render.acquire_result(group=group, job=job, result=result),
        as_json=as_json,
    )


def yield_(
    group: GroupArg,
    job: JobArg,
    *,
    addr: Address = DEFAULT_ADDRESS,
    timeout: Timeout = 10.0,
    connect_timeout: ConnectTimeout = None,
    as_json: AsJson = False,
) -> None:
    """Release GROUP held by JOB; returns at once (the switch happens in the background).

    A job that did not hold GROUP is told so (the orchestrator answers such a yield with
    success when nobody holds the group, as llm-d's does).
    """
    with _client(addr, connect_timeout=connect_timeout, timeout=timeout, job_id=job) as client:
        # Read first: the Yield reply alone does not tell whether JOB held the group.
        held = client.status(group, timeout=timeout).locking_job == job
        result = client.yield_(group, timeout=timeout)
    render.show(
        {"group_id": group, "job_id": job, "held": held, **render.jsonable(result)},
        render.yield_result(group=group, job=job, result=result, held=held),
        as_json=as_json,
    )


def clear_degraded(
    group: GroupArg,
    *,
    node: Annotated[
        str | None,
        typer.Option("--node", help="The node to clear (default: every degraded node of GROUP)."),
    ] = None,
    addr: Address = DEFAULT_ADDRESS,
    timeout: Timeout = 10.0,
    connect_timeout: ConnectTimeout = None,
    as_json: AsJson = False,
) -> None:
    """Let GROUP switch on its degraded nodes again, once their cause is fixed.

    A node that kept refusing the group's switch is degraded: the group starts no switch
    and its Acquires fail with the reason (`tslice status GROUP` shows it) until cleared.
    """
    with _client(addr, connect_timeout=connect_timeout, timeout=timeout) as client:
        cleared = client.clear_degraded(group, node=node, timeout=timeout)
    render.show(
        {"group_id": group, "node": node or "", "cleared": list(cleared)},
        render.cleared_degraded(group=group, node=node, cleared=cleared),
        as_json=as_json,
    )


@contextlib.contextmanager
def _waiting_line(client: tsclient.Client, *, group: str, job: str) -> Iterator[None]:
    """On a terminal, a live line on stderr with the queue position and the time waited."""
    console = render.stderr()
    if not console.is_terminal:
        yield
        return
    from rich.live import Live

    started = time.monotonic()
    latest: list[tsclient.GroupStatus | None] = [None]
    done = threading.Event()

    def poll() -> None:
        # Its own client: the main thread's one is blocked in Acquire. Only a display:
        # a failure here must never disturb the acquire, so it just ends the updates.
        try:
            with tsclient.Client(
                client.address,
                job_id=None,
                retry=tsclient.NO_RETRY,
                lease_s=None,
                connect_timeout=client.config.connect_timeout,
            ) as reader:
                while not done.is_set():
                    with contextlib.suppress(errors.TsliceError):
                        latest[0] = reader.status(group, timeout=_POSITION_POLL_S * 4)
                    done.wait(_POSITION_POLL_S)
        except Exception:
            return

    poller = threading.Thread(target=poll, name="tslice-acquire-position", daemon=True)
    with Live(
        get_renderable=lambda: render.acquire_waiting(
            group=group, job=job, status=latest[0], waited_s=time.monotonic() - started
        ),
        console=console,
        refresh_per_second=4,
        transient=True,
    ):
        poller.start()
        try:
            yield
        finally:
            done.set()
            poller.join(timeout=_POSITION_POLL_S * 8)
