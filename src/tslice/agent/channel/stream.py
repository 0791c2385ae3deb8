"""One ``WorkloadChannel`` call as the agent serves it, from the first message to the last.

:func:`serve` checks the registration the stream must open with (and who sent it, by
:mod:`tslice.security.admission`), hands the new session to the hub that owns the
sessions, then runs the stream's three parts: the reader (results routed to their
commands by id, late ones too; pings answered; a second ``register`` refused), the
keepalive (only for a workload that declared it) and the writer, which yields the
session's commands and, when the workload's requests end, finds out whether it
half-closed (it left) or is gone (lost). A command's round trip is :func:`send` (a new
id and its deadline, on the stream) and :func:`answered` (its result, or a timeout).

The stream reaches the hub only through :class:`Owner`: which sessions exist, which
registration conflicts with one, and what a session's end means stay with the hub
(:mod:`tslice.agent.channel`, whose module docstring has the rules of the channel as a
whole). The rules of the stream itself:

- The first message must be ``register``; a bad one ends the stream with
  INVALID_ARGUMENT and a message that says what to fix. A second ``register`` on
  the same stream is refused the same way.
- Keepalive (``features.keepalive``): right after accepting the registration the
  hub sends a ``Ping`` (the workload library treats it as the registration
  acknowledgement), pings every ``ping_interval_s`` and closes the session after
  ``missed_pings`` intervals of silence. A workload without it is never pinged and
  never closed for silence (llm-d's runs commands on its reading thread and would
  look dead during a long offload); a ping it sends itself is still answered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc

from tslice.agent.channel import departures, rules, sessions
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import tasks
from tslice.security import admission

log = logging.getLogger(__name__)

#: The servicer context of a ``WorkloadChannel`` call.
Context = grpc.aio.ServicerContext[pb.WorkloadMessage, pb.AgentCommand]


@dataclasses.dataclass(frozen=True)
class Owner:
    """What a stream needs of the hub that owns its session (``channel.ChannelHub``)."""

    #: Who may register.
    admission: admission.Admission
    #: Why a registration of a (job, group) by an instance token is refused ('' = it is not).
    conflict: Callable[[departures.SessionKey, str], str]
    #: Take an accepted session (it supersedes a live one of the same workload).
    admit: Callable[[sessions.Session], None]
    #: End a session with a status and why; the hub decides what the end means.
    end: Callable[[sessions.Session, grpc.StatusCode, str], None]
    ping_interval_s: float
    missed_pings: int


async def serve(
    request_iterator: AsyncIterator[pb.WorkloadMessage],
    context: Context,
    owner: Owner,
) -> AsyncIterator[pb.AgentCommand]:
    """Serve one ``WorkloadChannel`` call (an async generator of commands)."""
    session = await _accept(owner, request_iterator, context)
    suffix = f"{session.job_id}/{session.group}" if session.group else session.job_id
    reader = tasks.spawn(_read(owner, session, request_iterator), name=f"channel-read-{suffix}")
    keeper = tasks.spawn(_keepalive(owner, session), name=f"channel-keepalive-{suffix}")
    # However the call ends (a failed write stops grpc from resuming this generator),
    # a session still open when it is done was lost, not closed.
    add_done_callback = getattr(context, "add_done_callback", None)
    if add_done_callback is not None:
        add_done_callback(
            lambda _ctx: owner.end(session, grpc.StatusCode.CANCELLED, "the stream was lost")
        )
    close: sessions.Close | None = None
    wrote = False
    try:
        while True:
            item = await session.outbox.get()
            if isinstance(item, sessions.Close):
                close = item
                break
            if isinstance(item, sessions.Probe):
                # The requests ended. A half-close leaves the call open, so a write
                # still goes through; a gone peer (its process exited, the call was
                # cancelled) fails it and this generator is not resumed (or raises).
                if session.keepalive:
                    yield _probe_ping(session)
                elif not wrote:
                    try:
                        await context.send_initial_metadata(())
                    except Exception:
                        owner.end(session, grpc.StatusCode.CANCELLED, "the stream was lost")
                        return
                else:
                    # Nothing this workload declared can be sent to tell: treat it as
                    # lost (the grace applies).
                    owner.end(
                        session,
                        grpc.StatusCode.UNAVAILABLE,
                        "the stream ended (a workload without keepalive cannot be "
                        "told apart from a lost one)",
                    )
                    continue
                owner.end(session, grpc.StatusCode.OK, "the workload closed the channel")
                continue
            yield item
            wrote = True
    finally:
        owner.end(session, grpc.StatusCode.CANCELLED, "the stream was cancelled")
        await tasks.cancel_all([reader, keeper])
    if close is not None and close.code != grpc.StatusCode.OK:
        await context.abort(close.code, close.details)


async def _accept(
    owner: Owner,
    request_iterator: AsyncIterator[pb.WorkloadMessage],
    context: Context,
) -> sessions.Session:
    try:
        first = await request_iterator.__anext__()
    except StopAsyncIteration:
        await _refuse(context, "the workload closed the channel before sending RegisterWorkload")
    kind = first.WhichOneof("message")
    if kind != "register":
        await _refuse(
            context,
            f"the first WorkloadChannel message must be a RegisterWorkload, got "
            f"{kind or 'an empty message'}; use tslice.workload.register_workload(...)",
        )
    problem = rules.registration_problem(first.register)
    if problem:
        await _refuse(context, problem)
    instance = _metadata(context, rules.INSTANCE_METADATA)
    problem = rules.instance_problem(instance)
    if problem:
        await _refuse(context, problem)
    pid = await owner.admission.identify(first.register, instance, context)
    key = (first.register.job_id, first.register.group, first.register.rank)
    conflict = owner.conflict(key, instance)
    if conflict:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, conflict)
    session = sessions.Session(first.register, instance=instance, pid=pid)
    owner.admit(session)
    return session


async def _read(
    owner: Owner,
    session: sessions.Session,
    request_iterator: AsyncIterator[pb.WorkloadMessage],
) -> None:
    try:
        async for message in request_iterator:
            session.heard()
            kind = message.WhichOneof("message")
            if kind == "result":
                _on_result(session, message.result)
            elif kind == "ping":
                # Answered even undeclared: the peer that pings speaks pong.
                session.send(pb.AgentCommand(pong=pb.Ping(nonce=message.ping.nonce)))
            elif kind == "pong":
                session.pongs_received += 1
            elif kind == "register":
                owner.end(
                    session,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{session.label} is already registered on this stream; "
                    "open a new stream to register again",
                )
                return
            else:
                log.debug("ignoring empty workload message", extra={"job_id": session.job_id})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the transport broke; the stream is gone either way
        owner.end(session, grpc.StatusCode.UNAVAILABLE, f"the stream broke: {exc}")
        return
    # The requests ended: a half-close (the workload closed its channel), or a peer
    # that is gone (grpc reports both so); the writer finds out which.
    if not session.closed.is_set():
        session.outbox.put_nowait(sessions.Probe())


async def _keepalive(owner: Owner, session: sessions.Session) -> None:
    loop = asyncio.get_running_loop()
    if session.closed.is_set() or not session.keepalive:
        return
    session.ping()  # the registration acknowledgement
    while not session.closed.is_set():
        try:
            await asyncio.wait_for(session.closed.wait(), owner.ping_interval_s)
            return
        except asyncio.TimeoutError:
            pass
        silent = loop.time() - session.last_heard
        if silent > owner.ping_interval_s * owner.missed_pings:
            owner.end(
                session,
                grpc.StatusCode.UNAVAILABLE,
                f"no message from workload of {session.label} for {silent:.1f} s "
                f"(keepalive every {owner.ping_interval_s:g} s, {owner.missed_pings} missed)",
            )
            return
        session.ping()


def send(
    session: sessions.Session,
    command: pb.AgentCommand,
    *,
    kind: str,
    tags: tuple[str, ...],
    timeout_s: float,
) -> asyncio.Future[pb.CommandResult]:
    """Put ``command`` on the session's stream with a new id and its deadline; the
    workload's answer comes to the future returned (:func:`answered` waits for it)."""
    if timeout_s <= 0:
        raise ValueError("timeout_s must be > 0")
    command_id = str(uuid.uuid4())
    command.command_id = command_id
    command.deadline_ms = max(1, int(timeout_s * 1000))
    future: asyncio.Future[pb.CommandResult] = asyncio.get_running_loop().create_future()
    session.pending[command_id] = sessions.Pending(kind=kind, tags=tags, future=future)
    session.send(command)
    session.commands_sent += 1
    log.info(
        "command sent",
        extra={"job_id": session.job_id, "command_id": command_id, "kind": kind, "tags": tags},
    )
    return future


async def answered(
    session: sessions.Session,
    command: pb.AgentCommand,
    answer: asyncio.Future[pb.CommandResult],
    *,
    kind: str,
    timeout_s: float,
) -> pb.CommandResult:
    """The workload's answer to a command :func:`send` sent; ``CommandTimeoutError`` after
    ``timeout_s`` (a late success still updates the session's state, see the reader)."""
    command_id = command.command_id
    try:
        return await asyncio.wait_for(answer, timeout_s)
    except asyncio.TimeoutError:
        session.expire(command_id)
        raise rules.CommandTimeoutError(
            f"the workload of {session.label} did not answer {kind} command {command_id} "
            f"within {timeout_s:g} s"
        ) from None
    except asyncio.CancelledError:
        session.expire(command_id)
        raise


def _on_result(session: sessions.Session, result: pb.CommandResult) -> None:
    pending = session.pending.pop(result.command_id, None)
    if pending is not None:
        session.apply(pending, result)
        if pending.future is not None and not pending.future.done():
            pending.future.set_result(result)
        return
    late = session.expired.pop(result.command_id, None)
    if late is not None:
        session.apply(late, result)
        log.info(
            "late result applied to the workload's state",
            extra={
                "job_id": session.job_id,
                "command_id": result.command_id,
                "ok": result.ok,
                "residency": session.tracker.residency,
            },
        )
        return
    log.debug(
        "dropping result for unknown command",
        extra={"job_id": session.job_id, "command_id": result.command_id},
    )


def _probe_ping(session: sessions.Session) -> pb.AgentCommand:
    session.pings_sent += 1
    return pb.AgentCommand(ping=pb.Ping(nonce=session.pings_sent))


def _metadata(context: Context, key: str) -> str:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return ""


async def _refuse(context: Context, message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    raise AssertionError("context.abort() returned")  # it always raises
