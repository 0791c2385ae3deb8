"""What a caller may do: the rule of every RPC of both servers, and the interceptor that
enforces them at the edge (servers only; off unless a server's config has ``auth:``).

Roles, per RPC (:data:`ORCHESTRATOR_RULES`, :data:`AGENT_RULES`): ``job`` may Acquire,
Yield, Hold and open Sessions only as its own job ids (checked per request by
:func:`require_job`); agents take Grant, GrantStream, Snapshot, Restore and ResetJob
only from ``orchestrator``; ClearDegraded, Evict and Drain need ``admin``; reads (ListGroups,
GetGroupStatus, WatchEvents, Status, GetOperation, WaitOperation) need any verified
caller; health checks and reflection are open. A caller that proves nothing gets
UNAUTHENTICATED naming how to authenticate; a role it lacks, PERMISSION_DENIED.

:class:`Interceptor` verifies each caller (``tslice.security.identities``), enforces the
method rules and keeps the caller's principal for the handlers (:func:`principal_of`,
:func:`require_job`, :func:`job_credentials`).
"""

from __future__ import annotations

import contextvars
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from typing import Any

import grpc

from tslice.rpc import refusals
from tslice.security import tls
from tslice.security.identities import (
    ADMIN,
    JOB,
    ORCHESTRATOR,
    Presented,
    Principal,
    Unauthenticated,
    Verifier,
    presented_by,
)

log = logging.getLogger(__name__)

HOW_TO_AUTHENTICATE = (
    "present a client certificate signed by the server's client CA "
    f"(${tls.TLS_CERT_ENV}/${tls.TLS_KEY_ENV}) or a token "
    f"(${tls.TOKEN_ENV} or ${tls.TOKEN_FILE_ENV}; metadata 'authorization: Bearer <token>')"
)


class Rule(enum.Enum):
    """Who may call a method."""

    #: Anyone verified (reads).
    VERIFIED = "any verified caller"
    JOB = "the job role"
    ORCHESTRATOR = "the orchestrator role"
    ADMIN = "the admin role"
    #: A workload: over the Unix socket anyone (the agent binds it by peer credentials);
    #: over TCP the job role (the registration's job id is the channel's to check).
    WORKLOAD = "the job role (over TCP)"


_ORCH = "/timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService/"
_AGENT = "/snapshot_agent.v1alpha1.SnapshotAgentService/"

ORCHESTRATOR_RULES: Mapping[str, Rule] = {
    **{_ORCH + m: Rule.JOB for m in ("Acquire", "AcquireSet", "Yield", "Hold", "Session")},
    **{_ORCH + m: Rule.VERIFIED for m in ("ListGroups", "GetGroupStatus", "WatchEvents")},
    **{_ORCH + m: Rule.ADMIN for m in ("ClearDegraded", "Evict", "Drain")},
}
AGENT_RULES: Mapping[str, Rule] = {
    **{
        _AGENT + m: Rule.ORCHESTRATOR
        for m in ("Snapshot", "Restore", "Grant", "GrantStream", "ResetJob")
    },
    **{_AGENT + m: Rule.VERIFIED for m in ("Status", "GetOperation", "WaitOperation")},
    _AGENT + "WorkloadChannel": Rule.WORKLOAD,
    _AGENT + "ResetLeaderTerm": Rule.ADMIN,
}
_ROLE_OF = {Rule.JOB: JOB, Rule.ORCHESTRATOR: ORCHESTRATOR, Rule.ADMIN: ADMIN}


class _Off:
    """The caller of an RPC on a server without authentication."""


_OFF = _Off()
_CALLER: contextvars.ContextVar[Principal | _Off | None] = contextvars.ContextVar(
    "tslice_caller", default=_OFF
)


def principal_of(context: object | None = None) -> Principal | None:
    """The principal the interceptor verified for the RPC being handled (``context``: its
    ServicerContext, for the reader's sake); None without authentication, or for a caller
    admitted without one (a workload on the Unix socket)."""
    del context
    caller = _CALLER.get()
    return caller if isinstance(caller, Principal) else None


def enforced() -> bool:
    """Whether the RPC being handled passed through an authenticating server."""
    return not isinstance(_CALLER.get(), _Off)


class JobScope(Collection[str]):
    """The job ids a principal may act as (``in`` also matches its grant's prefixes)."""

    def __init__(self, principal: Principal | None) -> None:
        self._principal = principal

    def __contains__(self, job_id: object) -> bool:
        principal = self._principal
        return isinstance(job_id, str) and principal is not None and principal.may_act_as(job_id)

    def __iter__(self) -> Iterator[str]:
        principal = self._principal
        return iter(principal.jobs if principal is not None and JOB in principal.roles else ())

    def __len__(self) -> int:
        return sum(1 for _ in self)


def job_credentials(context: object | None = None) -> JobScope | None:
    """The job ids the caller of the RPC being handled may act as (the workload channel's
    admission hook, ``ChannelHub(credentials=...)``); None where authentication is off."""
    return JobScope(principal_of(context)) if enforced() else None


def require_job(job_id: str) -> None:
    """Refuse (PERMISSION_DENIED) a job-role caller acting as a job it is not. A hot path
    reads :data:`JOB_CHECK` instead (no call where nothing is checked)."""
    caller = _CALLER.get()
    if isinstance(caller, _Off):
        return
    if caller is None or not caller.may_act_as(job_id):
        who = "an unauthenticated caller" if caller is None else f"principal {caller}"
        allowed = f" (its jobs: {', '.join(caller.jobs[:8]) or 'none'})" if caller else ""
        raise refusals.Refused(
            refusals.Code.PERMISSION_DENIED,
            f"{who} may not act as job {job_id!r}{allowed}; use the credential issued "
            f"for job {job_id!r}",
        )


#: The job check of the RPC being handled: :func:`require_job` once the interceptor
#: admitted its caller, None on a server without authentication (nothing to check).
JOB_CHECK: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "tslice_job_check", default=None
)


class Interceptor(grpc.aio.ServerInterceptor):
    """Checks each call against ``rules`` (full method name -> :class:`Rule`); methods of
    other services (health, reflection) are open; a method of a ruled service missing
    from ``rules`` is refused."""

    def __init__(self, verifier: Verifier, rules: Mapping[str, Rule], *, server: str) -> None:
        self._verifier = verifier
        self._rules = dict(rules)
        self._services = {name.rsplit("/", 1)[0] for name in rules}
        self._server = server
        self._wrappers: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.rsplit("/", 1)[0] not in self._services:
            return handler
        # One wrapper per method (the servicer's handlers do not change): no work per call.
        known = self._wrappers.get(method)
        if known is None or known[0] is not handler:
            known = (handler, _wrapped(handler, lambda context: self._admit(method, context)))
            self._wrappers[method] = known
        return known[1]

    async def _admit(self, method: str, context: Any) -> None:
        """Verify the caller of ``method``; abort the call, or keep its principal."""
        try:
            try:
                presented = presented_by(context)
            except Unauthenticated as err:
                raise _Refusal(
                    grpc.StatusCode.UNAUTHENTICATED, f"{err} (refused by the {self._server})"
                ) from None
            principal = self.decide(method, presented)
        except _Refusal as refusal:
            # An audit trail of what was tried (a caller that presented nothing: debug only).
            level = logging.DEBUG if refusal.anonymous else logging.WARNING
            log.log(level, "refused a call from %s: %s", context.peer(), refusal.message)
            await context.abort(refusal.code, refusal.message)
        _CALLER.set(principal)
        JOB_CHECK.set(require_job)

    def decide(self, method: str, presented: Presented) -> Principal | None:
        """The caller's principal (None: admitted without one); raises _Refusal."""
        rule = self._rules.get(method)
        name = method.rsplit("/", 1)[-1]
        if rule is None:
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} is in no authorisation rule of the {self._server}; it is refused",
            )
        if rule is Rule.WORKLOAD and tls.peer_is_unix(presented.peer) and not presented.token:
            return None
        try:
            principal = self._verifier.verify(presented)
        except Unauthenticated as err:
            fix = (
                f": check the token (${tls.TOKEN_ENV} or ${tls.TOKEN_FILE_ENV}), or have its "
                "sha256 added to the server's auth.tokens"
                if presented.token is not None
                else ""
            )
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED, f"{err} (refused by the {self._server}){fix}"
            ) from None
        if principal is None:
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the {self._server} requires authentication for {name}: {HOW_TO_AUTHENTICATE}",
                anonymous=True,
            )
        needed = Rule.JOB if rule is Rule.WORKLOAD else rule
        role = _ROLE_OF.get(needed)
        if role is not None and role not in principal.roles:
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"principal {principal} may not call {name} on the {self._server}: it needs "
                f"{needed.value} (its roles: {', '.join(sorted(principal.roles)) or 'none'})",
            )
        return principal


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, *, anonymous: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        #: The caller presented nothing at all.
        self.anonymous = anonymous


def _wrapped(handler: Any, admit: Callable[[Any], Awaitable[None]]) -> Any:
    """``handler`` with ``admit(context)`` run first (each RPC runs in a task of its own,
    so the principal it keeps is the call's; the tasks a handler spawns inherit it)."""
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request: Any, context: Any) -> Any:
            await admit(context)
            return await inner(request, context)

        make = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary
            else grpc.stream_unary_rpc_method_handler
        )
        return make(unary, handler.request_deserializer, handler.response_serializer)
    inner = handler.unary_stream or handler.stream_stream

    async def streamed(request: Any, context: Any) -> Any:
        await admit(context)
        if inspect.isasyncgenfunction(inner):
            async for reply in inner(request, context):
                yield reply
        else:  # a coroutine handler that writes with context.write()
            await inner(request, context)

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.unary_stream
        else grpc.stream_stream_rpc_method_handler
    )
    return make(streamed, handler.request_deserializer, handler.response_serializer)
