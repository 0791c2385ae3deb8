"""The ``app-endpoint`` backend: suspend and resume inference engines over their HTTP admin API.

The engine (vLLM started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``, or SGLang
with ``--enable-memory-saver``) moves its own memory; this backend only asks it to, using the
exact requests of WIRE.md "Engine HTTP dialects"
(:mod:`~tslice.agent.backends.app_endpoint_dialects`).

What it does better than the llm-d agent it replaces:

* **Allow-list** (:mod:`~tslice.agent.backends.app_endpoint_hosts`). The agent is privileged
  and reachable over the network, so it must not become a proxy to arbitrary URLs. Every
  endpoint's host *and port* must match ``allowed_hosts`` (default: loopback ports 8000 and
  30000) *before* any socket is opened. Matching is on the URL text, never on a DNS answer,
  so ``http://2130706433/`` is not mistaken for ``127.0.0.1``. An endpoint is a base URL
  without a path: every path called is the dialect's own. Redirects are not followed and
  proxy environment variables are ignored, for the same reason. An engine's answer never
  reaches the caller beyond its status line (``HTTP 403 Forbidden``), so the agent cannot
  be used to read another service.
* **Concurrent endpoints with compensation.** All endpoints of a job (e.g. one per TP/DP rank
  server) are driven at once. If some fail, the ones that changed (or may have changed) are
  moved back, so the job is left consistently in its previous state and the error is transient.
  Only if moving back fails too is the state called inconsistent (:class:`FatalBackendError`).
* **Configurable timeouts.** A level-1 sleep of a large model can take minutes; the default read
  timeout is 300 s, not 30 s.
* **Reconciliation.** ``recover`` asks vLLM engines ``GET /is_sleeping``.

Real engines report no byte counts, so ``OpResult`` bytes are 0 unless an answer is a JSON
object carrying ``freed_bytes`` / ``restored_bytes`` / ``host_bytes`` numbers, as the shipped
dialect server ``tslice.sim.engine_server`` sends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import http
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

import httpx

from tslice.agent.backends import app_endpoint_dialects as dialects
from tslice.agent.backends import app_endpoint_hosts as hosts
from tslice.agent.backends import base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Statuses an engine (or a proxy in front of it) uses for "not now"; retrying may help.
_RETRYABLE_STATUSES = frozenset({408, 425, 429, 503})
#: Statuses after which the engine may well have done the work (a gateway gave up waiting,
#: or the handler raised half-way), so the call is compensated like a timeout.
_UNCERTAIN_STATUSES = frozenset({500, 502, 504})
#: Endpoints checked on the event loop; a longer list is checked in a thread (about
#: 70 us each: 1,024 endpoints would hold the loop for some 70 ms).
_PLAN_INLINE = 32
#: Engine calls in flight at once for one job (below httpx's pool of 100 connections).
_CONCURRENT_CALLS = 64
#: Seconds before the agent retries after a compensated failure (engines are busy or restarting).
_RETRY_AFTER_S = 1.0


class EngineRejectedError(base.TransientBackendError):
    """Every endpoint is back where it was, but an engine failed the call (worth retrying)."""


class EngineRefusedError(base.RefusedBackendError):
    """Every endpoint is back where it was, and an engine refused in a way that waiting will
    not fix (e.g. 404 because the server was started without sleep mode)."""


# --------------------------------------------------------------------------- outcomes


class _Outcome(enum.Enum):
    DONE = "done"
    #: The engine answered "no" or was never reached: it did not change.
    REFUSED = "refused"
    #: No usable answer after the request may have arrived: the engine may have changed.
    UNCERTAIN = "uncertain"


@dataclasses.dataclass(frozen=True)
class _CallResult:
    endpoint: str
    request: dialects.EngineRequest
    outcome: _Outcome
    error: str = ""
    retryable: bool = True
    #: Parsed JSON object of a successful answer (empty when there was none).
    payload: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def reported_bytes(self, key: str) -> int:
        value = self.payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        return 0


#: Failed endpoints named in an operation error (the others are counted).
_SUMMARISED = 8


def _summarise(results: Sequence[_CallResult]) -> str:
    named = "; ".join(f"{r.endpoint}: {r.error}" for r in results[:_SUMMARISED])
    more = len(results) - _SUMMARISED
    return f"{named}; and {more} more" if more > 0 else named


# --------------------------------------------------------------------------- backend


class AppEndpointBackend(base.Backend):
    """Suspends/resumes the engines listed in the request's ``AppEndpointConfig``.

    Build it with :meth:`create` from the agent config section (``allowed_hosts``,
    ``timeout_s``, ``connect_timeout_s``) or directly with an :class:`hosts.AppEndpointSettings`.
    Call :meth:`validate` before accepting a request: it raises
    :class:`~.app_endpoint_dialects.InvalidEndpointConfigError` (or its subclass
    ``EndpointNotAllowedError``) without any I/O.
    """

    name: ClassVar[str] = "app-endpoint"

    def __init__(self, *, settings: hosts.AppEndpointSettings | None = None) -> None:
        self.settings = settings or hosts.AppEndpointSettings()
        self._client: httpx.AsyncClient | None = None

    @classmethod
    def create(cls, settings: Mapping[str, Any]) -> Self:
        return cls(settings=hosts.AppEndpointSettings.from_mapping(settings))

    # -- public contract

    async def validate(self, job: base.JobContext) -> None:
        """Raise ``InvalidEndpointConfigError`` (or its subclass ``EndpointNotAllowedError``)
        if ``job.config`` cannot be served; no I/O."""
        await self._planned(job)

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        """Suspend every endpoint at once; on partial failure resume the ones that went down.

        Mode: ``mode`` if given, else ``app_endpoint.mode``, else OFFLOAD (vLLM level 1).
        SGLang ignores the mode (fixed at its launch) and receives ``app_endpoint.tags``.
        """
        engines = await self._planned(job)
        resolved = mode if mode != pb.SUSPEND_MODE_UNSPECIFIED else engines.mode
        level = dialects.sleep_level(resolved)
        # vLLM ignores /sleep while any tag still sleeps: a job stopped half-way through a
        # staged wake is woken fully first, or its woken tags would stay on the device.
        finish_wake = engines.dialect is dialects.Dialect.VLLM and _awake_tags(job) is not None
        forward = [
            [
                *([dialects.resume_request(engines.dialect, b, tags=())] if finish_wake else []),
                dialects.suspend_request(engines.dialect, b, level=level, tags=engines.tags),
            ]
            for b in engines.bases
        ]
        results = await self._call_all(job, engines.endpoints, forward)
        if all(r.outcome is _Outcome.DONE for r in results):
            return base.OpResult(
                device_bytes=sum(r.reported_bytes("freed_bytes") for r in results),
                host_bytes=sum(r.reported_bytes("host_bytes") for r in results),
                state=self._state(engines, level=level),
            )
        # vLLM sleeps whole (it takes no tags on sleep), so it wakes whole; SGLang released
        # exactly ``tags`` and resumes exactly those.
        wake_tags = engines.tags if engines.dialect is dialects.Dialect.SGLANG else ()
        await self._compensate(
            job,
            results,
            engines,
            kind="snapshot",
            verb="suspend",
            undone="resumed",
            undo=lambda url: [dialects.resume_request(engines.dialect, url, tags=wake_tags)],
        )

    async def restore(self, job: base.JobContext) -> base.OpResult:
        """Resume every endpoint at once with ``app_endpoint.tags`` (staged wake when given).

        On partial failure the endpoints that woke are put back to sleep, leaving the job
        SAVED; if that fails too the error is fatal and names what is awake.
        """
        engines = await self._planned(job)
        recorded_level = job.state.get("level")
        level = recorded_level if recorded_level in (1, 2) else dialects.sleep_level(engines.mode)
        forward = [
            [dialects.resume_request(engines.dialect, b, tags=engines.tags)] for b in engines.bases
        ]
        results = await self._call_all(job, engines.endpoints, forward)
        if all(r.outcome is _Outcome.DONE for r in results):
            state = self._state(engines, level=level)
            if engines.tags:
                # A staged wake: remember what is up so far (see missing_tags).
                earlier = _awake_tags(job) or []
                state["awake_tags"] = [*earlier, *(t for t in engines.tags if t not in earlier)]
            return base.OpResult(
                device_bytes=sum(r.reported_bytes("restored_bytes") for r in results),
                host_bytes=sum(r.reported_bytes("host_bytes") for r in results),
                state=state,
            )

        def back_to_sleep(url: httpx.URL) -> list[dialects.EngineRequest]:
            suspend = dialects.suspend_request(engines.dialect, url, level=level, tags=engines.tags)
            if engines.dialect is dialects.Dialect.VLLM:
                # vLLM ignores /sleep while any tag still sleeps, so a partly woken engine
                # must finish waking before it can be put back to sleep.
                return [dialects.resume_request(engines.dialect, url, tags=()), suspend]
            return [suspend]

        await self._compensate(
            job,
            results,
            engines,
            kind="restore",
            verb="resume",
            undone="suspended again",
            undo=back_to_sleep,
        )

    async def missing_tags(self, job: base.JobContext, tags: Sequence[str]) -> list[str]:
        """Agent hook for staged wake: which of ``tags`` a RUNNING job has not woken yet.

        Known only after a restore with tags (weights first, kv_cache after the weight
        sync); after a full restore nothing is missing. No I/O.
        """
        awake = _awake_tags(job)
        return [] if awake is None else [t for t in tags if t not in awake]

    async def recover(self, job: base.JobContext) -> pb.JobState | None:
        """vLLM: ``GET /is_sleeping`` on every endpoint; all asleep → SAVED, all awake →
        RUNNING, anything else (mixed, unreachable, SGLang) → ``None`` (cannot tell)."""
        try:
            engines = await self._planned(job)
        except dialects.InvalidEndpointConfigError:
            return None
        if engines.dialect is not dialects.Dialect.VLLM:
            return None
        probes = [
            [dialects.EngineRequest("GET", dialects.join(b, "is_sleeping"))] for b in engines.bases
        ]
        results = await self._call_all(job, engines.endpoints, probes)
        sleeping = {r.payload.get("is_sleeping") for r in results if r.outcome is _Outcome.DONE}
        if any(r.outcome is not _Outcome.DONE for r in results) or len(sleeping) != 1:
            return None
        state = sleeping.pop()
        if state is True:
            return pb.JOB_STATE_SAVED
        if state is False:
            return pb.JOB_STATE_RUNNING
        return None

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # -- internals

    async def _planned(self, job: base.JobContext) -> dialects.EnginePlan:
        """The job's engines, checked; a long list is checked off the event loop (health
        checks and SIGTERM are answered meanwhile)."""
        config = job.config
        many = (
            config is not None
            and config.WhichOneof("backend") == "app_endpoint"
            and len(config.app_endpoint.endpoints) > _PLAN_INLINE
        )
        if not many:
            return self._plan(job)
        return await asyncio.to_thread(self._plan, job)

    def _plan(self, job: base.JobContext) -> dialects.EnginePlan:
        return dialects.plan(
            job.config, allowed_hosts=self.settings.allowed_hosts, job_id=job.job_id
        )

    @staticmethod
    def _state(engines: dialects.EnginePlan, *, level: int) -> dict[str, Any]:
        # Persisted by the agent: restore re-suspends at the level the job was suspended with.
        return {"app": engines.dialect.value, "endpoints": list(engines.endpoints), "level": level}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout = httpx.Timeout(
                self.settings.timeout_s,
                connect=self.settings.connect_timeout_s,
                pool=self.settings.connect_timeout_s,
            )
            # No redirects and no proxy from the environment: the allow-list must decide
            # every host the privileged agent talks to.
            self._client = httpx.AsyncClient(
                timeout=timeout, follow_redirects=False, trust_env=False
            )
        return self._client

    async def _call_all(
        self,
        job: base.JobContext,
        endpoints: Sequence[str],
        chains: Sequence[Sequence[dialects.EngineRequest]],
    ) -> list[_CallResult]:
        """Run one chain of requests per endpoint, all endpoints at once."""
        # Wait for every call even if one fails early: cancelling an in-flight sleep would
        # leave that engine in an unknown state.
        return list(
            await _gather_bounded(
                [
                    functools.partial(self._call_chain, job, e, c)
                    for e, c in zip(endpoints, chains, strict=True)
                ]
            )
        )

    async def _call_chain(
        self, job: base.JobContext, endpoint: str, requests: Sequence[dialects.EngineRequest]
    ) -> _CallResult:
        result: _CallResult | None = None
        for request in requests:
            result = await self._call(job, endpoint, request)
            if result.outcome is not _Outcome.DONE:
                return result
        assert result is not None
        return result

    async def _call(
        self, job: base.JobContext, endpoint: str, request: dialects.EngineRequest
    ) -> _CallResult:
        what = request.describe()
        headers = {"Content-Type": request.content_type} if request.content_type else None
        try:
            response = await self._http().request(
                request.method,
                request.url,
                params=list(request.params) or None,
                content=request.content,
                headers=headers,
            )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            return _CallResult(
                endpoint, request, _Outcome.REFUSED, f"{what}: cannot connect ({_describe(exc)})"
            )
        except httpx.TimeoutException as exc:
            return _CallResult(
                endpoint,
                request,
                _Outcome.UNCERTAIN,
                f"{what}: no answer within {self.settings.timeout_s:g} s ({_describe(exc)})",
            )
        except httpx.HTTPError as exc:
            return _CallResult(endpoint, request, _Outcome.UNCERTAIN, f"{what}: {_describe(exc)}")
        status = response.status_code
        log.info(
            "engine call",
            extra={
                "job_id": job.job_id,
                "group_id": job.group,
                "endpoint": endpoint,
                "request": what,
                "status": status,
            },
        )
        if 200 <= status < 300:
            return _CallResult(endpoint, request, _Outcome.DONE, payload=_json_object(response))
        # Only a status line goes back to the caller, never the body (nor the server's own
        # reason phrase): whatever answered may be another service, and its words its secrets.
        error = f"{what} returned HTTP {_status_line(status)}"
        if status in _UNCERTAIN_STATUSES:
            return _CallResult(endpoint, request, _Outcome.UNCERTAIN, error)
        return _CallResult(
            endpoint, request, _Outcome.REFUSED, error, retryable=status in _RETRYABLE_STATUSES
        )

    async def _compensate(
        self,
        job: base.JobContext,
        results: Sequence[_CallResult],
        engines: dialects.EnginePlan,
        *,
        kind: str,
        verb: str,
        undone: str,
        undo: Callable[[httpx.URL], Sequence[dialects.EngineRequest]],
    ) -> NoReturn:
        """Undo the calls that took (or may have taken) effect, then raise the right error."""
        failed = [r for r in results if r.outcome is not _Outcome.DONE]
        to_undo = [
            (e, url)
            for r, e, url in zip(results, engines.endpoints, engines.bases, strict=True)
            if r.outcome is not _Outcome.REFUSED
        ]
        message = (
            f"{kind} of job {job.job_id!r} failed: could not {verb} {len(failed)} of "
            f"{len(results)} {engines.dialect.value} endpoint(s): {_summarise(failed)}"
        )
        undo_results = list(
            await _gather_bounded(
                [functools.partial(self._call_chain, job, e, undo(url)) for e, url in to_undo]
            )
        )
        broken = [r for r in undo_results if r.outcome is not _Outcome.DONE]
        if broken:
            raise base.FatalBackendError(
                f"{message}; then {len(broken)} endpoint(s) could not be {undone}, so the "
                f"engines are in a mixed state: {_summarise(broken)}. Check the engines, then "
                "reset the job"
            )
        if to_undo:
            changed = ", ".join(e for e, _ in to_undo[:_SUMMARISED])
            if len(to_undo) > _SUMMARISED:
                changed += f", … ({len(to_undo)} in all)"
            message += f"; {undone} {len(to_undo)} endpoint(s) that had (or may have) changed: "
            message += changed
        message += "; the job is unchanged"
        log.warning(
            "%s", message, extra={"job_id": job.job_id, "group_id": job.group, "kind": kind}
        )
        if not all(r.retryable for r in failed):
            raise EngineRefusedError(message)
        raise EngineRejectedError(message, retry_after=_RETRY_AFTER_S)


async def _gather_bounded(calls: Sequence[Callable[[], Awaitable[_T]]]) -> list[_T]:
    """Every call, at most ``_CONCURRENT_CALLS`` at a time (all at once below that):
    httpx's pool slows down quadratically with requests queued for a connection (1,024
    at once took 36 s to fail to connect; 64 at a time, under 2 s). A call is started
    only once it passes the gate (a cancelled wait leaves no coroutine behind)."""
    gate = asyncio.Semaphore(_CONCURRENT_CALLS)

    async def gated(call: Callable[[], Awaitable[_T]]) -> _T:
        async with gate:
            return await call()

    return list(await asyncio.gather(*(gated(c) for c in calls)))


def _awake_tags(job: base.JobContext) -> list[str] | None:
    """Tags woken by a staged wake since the last snapshot; ``None`` = fully awake/unknown."""
    awake = job.state.get("awake_tags")
    return [str(t) for t in awake] if isinstance(awake, list) else None


def _status_line(status: int) -> str:
    """``403 Forbidden``: the number and the standard phrase (none for an unknown number)."""
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def _describe(exc: Exception) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _json_object(response: httpx.Response) -> Mapping[str, Any]:
    if not response.content:
        return {}
    try:
        payload = json.loads(response.content)
    except (ValueError, UnicodeDecodeError):
        return {}
    return payload if isinstance(payload, dict) else {}
