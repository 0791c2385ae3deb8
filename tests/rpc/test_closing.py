"""A stopping server ends every stream it serves at once, with no task per stream waiting
for it (rpc/multiplex.Closing; the end-to-end case is
tests/client/test_client_session.py::test_open_streams_do_not_hold_a_shutdown)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tslice.rpc import multiplex


def test_set_ends_the_registered_streams_once_and_a_late_one_at_once() -> None:
    closing = multiplex.Closing()
    ended: list[str] = []

    def a() -> None:
        ended.append("a")

    def b() -> None:
        ended.append("b")

    closing.add(a)
    closing.add(b)
    closing.discard(b)  # b's stream ended by itself
    closing.set()
    closing.set()
    assert ended == ["a"] and closing.is_set()
    closing.add(b)  # a stream opened as the server stops
    assert ended == ["a", "b"]


async def test_an_idle_stream_keeps_no_task_waiting_for_the_server_to_stop() -> None:
    closing = multiplex.Closing()
    never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    reading = asyncio.Event()

    async def requests() -> AsyncIterator[int]:
        reading.set()
        await never  # an idle caller: it sends nothing and stays
        yield 0

    async def handle(request: int) -> int:
        return request

    replies = multiplex.serve(
        requests(), handle, request_id=int, duplicate=int, name="idle", closing=closing
    )
    served = asyncio.ensure_future(replies.__anext__())
    await reading.wait()  # the stream is served: its reader waits for the caller
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert "idle:reader" in names
    assert not any(name.startswith("idle:") and name != "idle:reader" for name in names)
    closing.set()
    [ended] = await asyncio.gather(served, return_exceptions=True)
    assert isinstance(ended, StopAsyncIteration)  # the stream ended, with no reply
    assert not any(t.get_name().startswith("idle:") for t in asyncio.all_tasks() if not t.done())
