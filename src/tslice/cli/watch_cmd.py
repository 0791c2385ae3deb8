"""``tslice watch``: a live view of the orchestrator in the terminal, until Ctrl-C (not on a
terminal, e.g. piped: one screen, then it ends).

A background thread runs an :class:`~tslice.client.AsyncClient` (TLS and tokens from the
environment, as every command): it polls every group's status at once each ``--refresh``
seconds and follows the event stream (the last ``--history`` of stored events first). The
terminal is redrawn from what it gathered (:mod:`tslice.cli.watch_data`) four times a
second, so a slow or stalled link never freezes the screen: the header says how old the
data is, and why the last poll failed. Ctrl-C ends it with exit code 0 and the terminal
as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
from typing import Annotated

import typer

import tslice.client as tsclient
from tslice.cli import client_cmds, events_cmd, render, watch_data, watch_view
from tslice.common import errors

#: A poll or a stream that fails is tried again this long after.
_RETRY_S = 2.0
#: The first connection's bound without --connect-timeout: longer than a command's (1 s),
#: since a watch is meant to work over a slow link (a TLS handshake is several round trips).
CONNECT_TIMEOUT_S = 10.0


def register(app: typer.Typer) -> None:
    app.command("watch")(watch)


def watch(
    *,
    addr: client_cmds.Address = client_cmds.DEFAULT_ADDRESS,
    refresh: Annotated[
        float,
        typer.Option(
            "--refresh", callback=client_cmds.seconds_option, help="Seconds between status polls."
        ),
    ] = 1.0,
    history: Annotated[
        str,
        typer.Option(
            "--history",
            help="Stored events to start with, as far back as this (e.g. 10m; 0s = none).",
        ),
    ] = "10m",
    events: Annotated[int, typer.Option("--events", min=0, help="Recent events shown.")] = 8,
    connect_timeout: client_cmds.ConnectTimeout = None,
) -> None:
    """A live view: groups (state, holder, hold time), queues (wait times, policy),
    switches in progress per node, degraded nodes and recent events. Ctrl-C quits."""
    since = events_cmd.parse_time(history, option="--history")
    if connect_timeout is None:
        connect_timeout = CONNECT_TIMEOUT_S
    with client_cmds.connected(addr, connect_timeout=connect_timeout, timeout=None) as probe:
        transport = "TLS" if probe.config.security.tls is not None else "plaintext"
        probe.list_groups(timeout=max(refresh * 4, 5.0))  # fails now, with its reason
    data = watch_data.WatchData(address=addr, transport=transport)
    feeder = _Feeder(addr, data, refresh=refresh, since=since, connect=connect_timeout)
    feeder.start()
    console = render.stdout()
    if not console.is_terminal:
        # Not a terminal (a pipe, a file): one screen, once the first poll is in.
        try:
            feeder.wait_polled(timeout=max(refresh * 4, 5.0) + (connect_timeout or 0))
        finally:
            feeder.stop()
        console.print(watch_view.view(data.view(), events=events, width=console.width))
        return
    from rich.live import Live

    try:
        with Live(
            get_renderable=lambda: watch_view.view(data.view(), events=events, width=console.width),
            console=console,
            refresh_per_second=4,
            screen=console.is_terminal,
            redirect_stdout=False,
            redirect_stderr=False,
        ):
            while feeder.alive():
                time.sleep(0.25)  # the subject: the screen is redrawn by Live meanwhile
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends
    finally:
        feeder.stop()
    if feeder.failure is not None:
        raise feeder.failure


class _Feeder:
    """The background thread: its own event loop, client, poll and event tasks."""

    def __init__(
        self,
        address: str,
        data: watch_data.WatchData,
        *,
        refresh: float,
        since: datetime.datetime,
        connect: float | None,
    ) -> None:
        self._address, self._data, self._refresh = address, data, refresh
        self._since, self._connect = since, connect
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="tslice-watch", daemon=True)
        #: An error that ends the watch (raised in the main thread).
        self.failure: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_polled(self, *, timeout: float) -> None:
        """Until the first status poll is in (or ``timeout`` s, or the thread ended)."""
        deadline = time.monotonic() + timeout
        while self.alive() and self._data.view().age_s is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a poll of the data the thread fills; bounded

    def stop(self) -> None:
        stop = self._stop
        if stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=5)

    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as err:
            self.failure = err
        finally:
            self._loop.close()

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        client = tsclient.AsyncClient(
            self._address,
            job_id=None,
            retry=tsclient.NO_RETRY,
            lease_s=None,
            connect_timeout=self._connect if self._connect is not None else CONNECT_TIMEOUT_S,
        )
        try:
            tasks = [
                asyncio.create_task(self._poll(client), name="watch-poll"),
                asyncio.create_task(self._follow(client), name="watch-events"),
            ]
            await self._stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await client.close()

    async def _poll(self, client: tsclient.AsyncClient) -> None:
        deadline = max(self._refresh * 4, 5.0)
        while True:
            try:
                groups = await client.list_groups(timeout=deadline)
                statuses = await asyncio.gather(
                    *(client.status(g, timeout=deadline) for g in groups),
                    return_exceptions=True,
                )
                found = [s for s in statuses if isinstance(s, tsclient.GroupStatus)]
                self._data.polled(found, at=time.time())
            except errors.TsliceError as err:
                self._data.poll_problem = f"status poll failed: {_short(err)}; retrying"
            await asyncio.sleep(self._refresh)

    async def _follow(self, client: tsclient.AsyncClient) -> None:
        since = self._since
        while True:
            last = since
            try:
                stored = tsclient.StoredEvents(since=since) if since < _now() else None
                stream = client.watch_events(stored=stored)
                try:
                    async for event in stream:
                        self._data.stream_problem = ""
                        self._data.event(event)
                        if event.time is not None:
                            last = event.time
                finally:
                    await stream.aclose()
            except errors.FailedPrecondition:
                since = _now()  # no history kept: live events only
                continue
            except errors.TsliceError as err:
                self._data.stream_problem = f"event stream: {_short(err)}; reconnecting"
            # Reconnected, the stream starts just after the last event seen.
            since = last + datetime.timedelta(microseconds=1)
            await asyncio.sleep(_RETRY_S)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _short(err: BaseException) -> str:
    text = getattr(err, "message", "") or str(err)
    return " ".join(text.split())[:160]
