"""Request/reply calls multiplexed over one long-lived bidirectional gRPC stream.

A message on an open stream costs about half a unary call (no new HTTP/2 stream, no
headers and trailers, no call object on either side); tslice uses this for the two
legs of every hand-over: Acquire/Yield (client -> orchestrator, ``Session``) and Grant
(orchestrator -> agent, ``GrantStream``). Both sides are here, once:

* :class:`Caller` sends requests tagged with an id and hands each reply to the future of
  its request. It opens the stream on first use and again after it broke; a break fails
  the calls in flight with :class:`Broken` (callers retry them as a failed unary call).
  A peer without the RPC answers ``UNIMPLEMENTED`` (or a stream that never worked fails
  for another reason than a lost connection): :class:`Unsupported`, for good.
  :class:`ThreadCaller` is its blocking twin (a ``grpc.Channel`` stream read by a daemon
  thread); both keep their bookkeeping in one I/O-free :class:`Pending`.
* :func:`serve` starts each incoming request as it arrives (a future the server
  resolves is answered from its callback, without a task; a coroutine gets a task) and
  streams the replies back as they finish; a cancel message, or the end of the stream,
  cancels the requests still running (as a cancelled unary call would be). Request ids
  are unique among the requests in flight: a second request with the id of one still
  running is answered at once with the caller's refusal and never run. Given ``parse``,
  it reads a request as bytes and parses it itself (see :mod:`tslice.rpc.undecodable`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf import message

from tslice.common import tasks
from tslice.rpc import undecodable

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")
_Rep_contra = TypeVar("_Rep_contra", contravariant=True)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
#: How a stream to a peer that is down or going away ends: worth re-opening.
_TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def status_code(number: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of a status number carried in a reply message."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def unusable(code: grpc.StatusCode, *, worked: bool | None) -> bool:
    """Whether a stream that ended with ``code`` is not worth opening again: it never
    worked, and not for want of a connection (UNIMPLEMENTED: no such RPC, or a peer that
    mishandles it). The unary calls always work."""
    return not worked and code not in _TRANSIENT


class Unsupported(Exception):
    """The peer has no such streaming RPC (UNIMPLEMENTED)."""


class Broken(Exception):
    """The stream ended or failed before the reply came; ``code`` says how."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail


class Waiter(Protocol[_Rep_contra]):
    """Where a reply goes: an ``asyncio.Future`` or a ``concurrent.futures.Future``."""

    def done(self) -> bool: ...

    def set_result(self, result: _Rep_contra, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


class Pending(Generic[Rep]):
    """What both callers decide without I/O: request ids, the replies still awaited, and
    what the end of a stream means for them (:class:`Broken`, or :class:`Unsupported`
    for good). Not thread-safe: :class:`ThreadCaller` calls it under its lock."""

    def __init__(self, *, reply_id: Callable[[Rep], int], name: str) -> None:
        self.name = name
        #: None until the peer answered (or refused the RPC) once.
        self.supported: bool | None = None
        self._reply_id = reply_id
        self._waiting: dict[int, Waiter[Rep]] = {}
        self._ids = itertools.count(1)

    def add(self, waiter: Waiter[Rep]) -> int:
        """Await a reply in ``waiter``; returns the id to send the request with."""
        if self.supported is False:
            raise Unsupported(self.name)
        request_id = next(self._ids)
        self._waiting[request_id] = waiter
        return request_id

    def forget(self, request_id: int) -> None:
        self._waiting.pop(request_id, None)

    def deliver(self, reply: Rep) -> None:
        """A reply arrived: the peer has the RPC; the waiter of its id gets it."""
        self.supported = True
        waiter = self._waiting.get(self._reply_id(reply))
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    def ended(self, code: grpc.StatusCode, detail: str) -> None:
        """The stream ended with ``code``: fail every call still waiting, with the reason."""
        failure: Exception
        if unusable(code, worked=self.supported):
            self.supported = False
            log.info(
                "%s: no usable stream (%s: %s); using unary calls", self.name, code.name, detail
            )
            failure = Unsupported(self.name)
        else:
            failure = Broken(code, detail)
        self.fail(failure)

    def fail(self, err: Exception) -> None:
        for waiter in list(self._waiting.values()):
            if not waiter.done():
                waiter.set_exception(err)


class _Callers(Generic[Req, Rep]):
    """What the async and the blocking caller share: the stream's name, the requests
    waiting for their replies and the open call."""

    def __init__(self, *, reply_id: Callable[[Rep], int], name: str) -> None:
        self._name = name
        self._pending: Pending[Rep] = Pending(reply_id=reply_id, name=name)
        self._call: Any = None

    @property
    def supported(self) -> bool | None:
        """None until the peer answered (or refused the RPC) once."""
        return self._pending.supported

    @supported.setter
    def supported(self, value: bool | None) -> None:
        self._pending.supported = value

    def _ended_by(self, err: grpc.RpcError | None) -> tuple[grpc.StatusCode, str]:
        """Why the stream ended: the error it failed with, else the peer closed it."""
        if err is None:
            return grpc.StatusCode.UNAVAILABLE, f"{self._name} closed the stream"
        code: grpc.StatusCode = err.code()
        return code, err.details() or code.name.lower()

    @contextlib.contextmanager
    def _unanswered(self, call: Any, abandon: Callable[[], None] | None) -> Iterator[None]:
        """Around the wait for one reply: when it ends without one (timeout, cancellation,
        an interrupt) while ``call`` is still the stream, ``abandon()`` tells the peer to
        drop the request. Not after :class:`Broken`: the stream, and the request, are gone."""
        try:
            yield
        except Broken:
            raise
        except BaseException:
            if abandon is not None and self._call is call:
                abandon()
            raise


class Caller(_Callers[Req, Rep]):
    """Client side: ``call()`` sends one request and waits for the reply with its id.

    ``failed(err)``, when given, hears how a stream failed before the calls waiting on it
    do (a client moves on to another address there)."""

    def __init__(
        self,
        open_call: Callable[[], Any],
        *,
        reply_id: Callable[[Rep], int],
        name: str,
        failed: Callable[[grpc.RpcError], None] | None = None,
    ) -> None:
        super().__init__(reply_id=reply_id, name=name)
        self._open_call = open_call
        self._failed = failed
        self._reader: asyncio.Task[None] | None = None
        # One write at a time on a stream (asyncio binds it to the loop at first use).
        self._writing = asyncio.Lock()
        #: Writes under way, each in a task (see call()), and abandons to send.
        self._writes: set[asyncio.Task[None]] = set()

    async def call(
        self,
        request: Callable[[int], Req],
        *,
        timeout_s: float | None,
        issued: Callable[[], None] | None = None,
        abandon: Callable[[int], Req] | None = None,
    ) -> Rep:
        """Send ``request(id)``; raise Unsupported, Broken or TimeoutError.

        ``abandon(id)`` is the message that tells the peer to drop the request when the
        caller stops waiting (timeout, cancellation).
        """
        if self._pending.supported is False:
            raise Unsupported(self._name)
        call = self._call if self._call is not None else self._open()
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Rep] = loop.create_future()
        request_id = self._pending.add(reply)
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, reply, timeout_s)
        message = request(request_id)
        try:
            await self._writing.acquire()
            # In a task of its own, shielded: gRPC cancels the whole stream when a write on
            # it is cancelled, so a caller that gives up mid-write must not cut off every
            # other call on it. The write lets go of the lock when it ends (_written).
            write = asyncio.ensure_future(call.write(message))
            self._writes.add(write)
            write.add_done_callback(self._written)
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
                await asyncio.shield(write)  # (the stream is over: its reader fails the reply)
            if issued is not None:
                issued()
            return await reply
        except Broken:
            raise  # the stream, and the request, are gone: nothing to take back
        except BaseException:
            # Timed out, cancelled or interrupted: the peer drops the request.
            if abandon is not None and self._call is call:
                self._send_later(call, abandon(request_id))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.forget(request_id)

    async def close(self) -> None:
        call, reader = self._call, self._reader
        self._call = self._reader = None
        if call is not None:
            call.cancel()
        await tasks.cancel_all([t for t in (reader, *self._writes) if t is not None])
        self._pending.fail(Broken(grpc.StatusCode.CANCELLED, "the stream was closed"))

    async def _write(self, call: Any, message: Req) -> None:
        async with self._writing:
            try:
                await call.write(message)
            except (grpc.RpcError, asyncio.InvalidStateError) as err:
                log.debug("stream %s: write failed: %s", self._name, err)

    def _written(self, write: asyncio.Task[None]) -> None:
        self._writes.discard(write)
        self._writing.release()
        if not write.cancelled() and write.exception() is not None:
            log.debug("stream %s: write failed: %s", self._name, write.exception())

    def _send_later(self, call: Any, message: Req) -> None:
        task = tasks.spawn(self._write(call, message), name=f"abandon:{self._name}")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _open(self) -> Any:
        self._call = call = self._open_call()
        self._reader = tasks.spawn(self._read(call), name=f"stream:{self._name}")
        return call

    async def _read(self, call: Any) -> None:
        failure: grpc.RpcError | None = None
        deliver = self._pending.deliver
        try:
            async for reply in call:
                deliver(reply)
        except grpc.RpcError as err:
            failure = err
            if self._failed is not None:
                self._failed(err)
        except asyncio.CancelledError:
            # The stream was cancelled on this side (close(), or a cancelled write): the
            # calls waiting on it hear it, and the next call opens a new one.
            self._over(call, grpc.StatusCode.CANCELLED, f"the stream to {self._name} was cancelled")
            raise
        self._over(call, *self._ended_by(failure))

    def _over(self, call: Any, code: grpc.StatusCode, details: str) -> None:
        if self._call is call:
            self._call = self._reader = None
        self._pending.ended(code, details)


#: Longest single wait of a blocked ThreadCaller.call (see there).
_INTERRUPTIBLE_S = 0.05


class ThreadCaller(_Callers[Req, Rep]):
    """Blocking twin of :class:`Caller` for a ``grpc.Channel``: requests are queued to
    the stream's request iterator and a daemon thread reads the replies (one per stream,
    not one per call), so no event loop hides behind a sync client.
    ``open_call(requests)`` starts the stream."""

    def __init__(
        self,
        open_call: Callable[[Iterator[Req]], Any],
        *,
        reply_id: Callable[[Rep], int],
        name: str,
        failed: Callable[[grpc.RpcError], None] | None = None,
    ) -> None:
        super().__init__(reply_id=reply_id, name=name)
        self._open_call = open_call
        self._failed = failed
        self._guard = threading.Lock()
        self._outbox: queue.SimpleQueue[Req | None] | None = None

    def call(
        self,
        request: Callable[[int], Req],
        *,
        timeout_s: float | None,
        abandon: Callable[[int], Req] | None = None,
    ) -> Rep:
        """See :meth:`Caller.call`; an interrupt (Ctrl-C) abandons the request too."""
        reply: concurrent.futures.Future[Rep] = concurrent.futures.Future()
        with self._guard:
            request_id = self._pending.add(reply)
            call, outbox = self._ensure_open()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # Abandoned first, lock-free: an interrupt (delivered at any bytecode) that lands
        # in the bookkeeping after it must not cost the peer its cancel.
        drop = None if abandon is None else lambda: outbox.put(abandon(request_id))
        try:
            with self._unanswered(call, drop):
                # Sent inside: an interrupt anywhere after the send is abandoned (a cancel
                # for a request the peer never got is ignored by `serve`).
                outbox.put(request(request_id))
                while True:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no reply within {timeout_s:g} s")
                    # Waited in slices: an unbounded wait blocks in C, where an interrupt
                    # (Ctrl-C in this thread) is held back and then lands anywhere, maybe
                    # past the abandon; between slices it lands here, in the try.
                    slice_s = _INTERRUPTIBLE_S if left is None else min(left, _INTERRUPTIBLE_S)
                    try:
                        return reply.result(slice_s)
                    except concurrent.futures.TimeoutError:  # not TimeoutError before 3.11
                        continue
        finally:
            with self._guard:
                self._pending.forget(request_id)

    def close(self) -> None:
        with self._guard:
            call, self._call, self._outbox = self._call, None, None
            self._pending.fail(Broken(grpc.StatusCode.CANCELLED, "the stream was closed"))
        if call is not None:
            call.cancel()  # the peer drops what this caller still waits for

    def _ensure_open(self) -> tuple[Any, queue.SimpleQueue[Req | None]]:
        if self._call is None or self._outbox is None:
            outbox: queue.SimpleQueue[Req | None] = queue.SimpleQueue()
            self._call = self._open_call(_drain(outbox))
            self._outbox = outbox
            threading.Thread(
                target=self._read,
                args=(self._call, outbox),
                name=f"stream:{self._name}",
                daemon=True,
            ).start()
        return self._call, self._outbox

    def _read(self, call: Any, outbox: queue.SimpleQueue[Req | None]) -> None:
        failure: grpc.RpcError | None = None
        try:
            for reply in call:
                with self._guard:
                    self._pending.deliver(reply)
        except grpc.RpcError as err:
            failure = err
            if self._failed is not None:
                self._failed(err)
        outbox.put(None)  # ends the request iterator
        with self._guard:
            if self._call is call:
                self._call = self._outbox = None
            self._pending.ended(*self._ended_by(failure))


def _drain(outbox: queue.SimpleQueue[Req | None]) -> Iterator[Req]:
    while (request := outbox.get()) is not None:
        yield request


def _expire(reply: asyncio.Future[Any], timeout_s: float) -> None:
    if not reply.done():
        reply.set_exception(TimeoutError(f"no reply within {timeout_s:g} s"))


async def serve(
    requests: AsyncIterator[Any],
    handle: Callable[[Req], Awaitable[Any]],
    *,
    request_id: Callable[[Req], int],
    duplicate: Callable[[Req], Rep],
    answer: Callable[[Req, asyncio.Future[Any]], Rep] | None = None,
    is_cancel: Callable[[Req], bool] = lambda _request: False,
    name: str,
    closing: Closing | None = None,
    parse: Callable[[bytes], Req] | None = None,
    context: Any = None,
) -> AsyncIterator[Rep]:
    """Server side: the reply to each request, in the order they finish.

    ``handle(request)`` starts it: a future (something resolves it: no task waits for
    it) or a coroutine (it runs in a task of its own). ``answer(request, done)`` makes the
    reply from the finished future or task (default: its result). A request for which
    ``is_cancel`` holds cancels the running request with its id (no reply). A request
    whose id is in flight gets ``duplicate(request)`` at once and is never run: else the
    first would be unreachable (its cancel, and the end of the stream, would reach only
    the second), and an Acquire could outlive its stream as a ghost waiter. When the
    caller half-closes, the running requests are answered first; when it goes away, or
    when ``closing`` is set (the server is stopping: a long-lived stream must not hold
    its shutdown for the whole grace period), they are cancelled and the stream ends; the
    caller's requests in flight then fail as UNAVAILABLE.

    ``parse`` (with the call's ``context``) reads each request that arrives as bytes (the
    method is marked :func:`tslice.rpc.undecodable.parses_own_requests`): one that does
    not parse ends the reading as a half-close would, and once the requests before it
    are answered the call ends INVALID_ARGUMENT, saying what to send.
    """
    if parse is not None and context is None:
        raise ValueError(f"{name}: serve(parse=...) needs the call's context to refuse with")
    replies: asyncio.Queue[Rep | None] = asyncio.Queue()
    running: dict[int, asyncio.Future[Any]] = {}
    done_reading = False
    refused = ""

    def finished(request: Req, rid: int, done: asyncio.Future[Any]) -> None:
        if running.get(rid) is done:
            del running[rid]
        if not done.cancelled():
            try:
                replies.put_nowait(done.result() if answer is None else answer(request, done))
            except Exception:
                log.exception("%s: request %d failed", name, rid)
        if done_reading and not running:
            replies.put_nowait(None)

    async def read() -> None:
        nonlocal done_reading, refused
        try:
            async for item in requests:
                request = item
                if parse is not None and isinstance(item, bytes):
                    try:
                        request = parse(item)
                    except message.DecodeError as err:
                        refused = undecodable.refusal(parse, name, err)
                        break
                rid = request_id(request)
                started = running.get(rid)
                if is_cancel(request):
                    if started is not None:
                        started.cancel()
                    continue
                if started is not None:
                    replies.put_nowait(duplicate(request))
                    continue
                future = _started(handle, request, f"{name}:{rid}")
                running[rid] = future
                future.add_done_callback(functools.partial(finished, request, rid))
        except grpc.RpcError as err:
            log.debug("%s: the caller ended the stream: %s", name, err)
            for future in list(running.values()):
                future.cancel()
            running.clear()
        finally:
            done_reading = True
            if not running:  # half-closed: the last answer ends the stream
                replies.put_nowait(None)

    reader = tasks.spawn(read(), name=f"{name}:reader")

    def end_now() -> None:
        reader.cancel()
        for future in list(running.values()):
            future.cancel()
        replies.put_nowait(None)

    if closing is not None:
        closing.add(end_now)
    try:
        while (reply := await replies.get()) is not None:
            yield reply
        if refused:  # sent from the handler's task, once its replies are written
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
    finally:
        if closing is not None:
            closing.discard(end_now)
        # The caller is gone (or the server stops): what it asked for stops at a safe point.
        for future in list(running.values()):
            future.cancel()
        await tasks.cancel_all(
            [reader, *(f for f in running.values() if isinstance(f, asyncio.Task))]
        )


class Closing:
    """Set once, when a server stops: every stream :func:`serve` is serving ends at once.

    The streams register how they end, rather than each keeping a task that waits for an
    event: a server with 1,000 idle Session streams kept 1,000 such tasks alive."""

    def __init__(self) -> None:
        self._ends: set[Callable[[], None]] = set()
        self._set = False

    def set(self) -> None:
        self._set = True
        for end in list(self._ends):
            end()
        self._ends.clear()

    def is_set(self) -> bool:
        return self._set

    def add(self, end: Callable[[], None]) -> None:
        """Call ``end`` when set (at once if it is)."""
        if self._set:
            end()
        else:
            self._ends.add(end)

    def discard(self, end: Callable[[], None]) -> None:
        self._ends.discard(end)


def _started(
    handle: Callable[[Req], Awaitable[Any]], request: Req, name: str
) -> asyncio.Future[Any]:
    """The request under way as a future: the one ``handle`` gave, a task for its
    coroutine, or a future failed with what it raised at once."""
    try:
        work = handle(request)
    except Exception as err:
        failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        failed.set_exception(err)
        return failed
    if isinstance(work, asyncio.Future):
        return work
    # A plain task: its outcome, a refusal included, is the reply's to tell (``answer``).
    return asyncio.get_running_loop().create_task(work, name=name)  # type: ignore[arg-type]


def duplicate_message(request_id: int) -> str:
    return (
        f"request_id {request_id} is already in flight on this stream; give every request "
        "a new id (an id may be used again once its request was answered)"
    )
