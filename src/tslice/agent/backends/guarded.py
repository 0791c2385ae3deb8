"""The backend adapter: every call the agent makes into a backend, under one set of rules.

Backends are plug-ins: they may hang, raise anything, or refuse. The agent never
calls one directly; it goes through :class:`GuardedBackends`, which owns

- the deadlines: ``operation_timeout_s`` for a snapshot, restore or activation (with
  :class:`~tslice.agent.backends.base.TransientBackendError` retried with back-off
  inside it); ``QUERY_TIMEOUT_S``, never beyond the operation deadline, for every
  question asked while a request is planned (validate, recover, fits, missing tags);
  ``STATUS_TIMEOUT_S`` for the accelerators a Status reply lists;
- the translation of what a backend raises: a refused or invalid config becomes a
  :class:`refusals.Refused` with its status code before anything changed; an operation's
  failure becomes a :class:`model.Outcome` that says whether anything moved;
- what a question answers when the backend cannot tell (``None``, logged).

The pure rules decide and the runner (``tslice.agent.moves.runner``) applies them; this
module only calls. It also knows what each backend declares (overlapping moves,
prefetching, parked states in host memory), read once. On the hand-over path it comes
between the runner and the backend (``backends.base.Backend``: ``snapshot``,
``restore``, ``activate``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from tslice.agent.backends import base
from tslice.agent.jobs import model
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.rpc import refusals
from tslice.server import logs

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: How long a question to a backend (validate, recover, fits, missing tags) may take.
QUERY_TIMEOUT_S = 30.0
#: ...except the accelerators listed in a Status reply, which must come back quickly.
STATUS_TIMEOUT_S = 5.0
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 5.0


async def _within(call: Coroutine[Any, Any, _T], *, timeout_s: float) -> _T:
    """``call`` under a deadline, run in the calling task where the loop allows it.

    ``asyncio.timeout`` (3.11+) needs no extra task: a backend call that finishes
    without suspending (noop, a refusal) costs no trip through the event loop.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await call
    return await asyncio.wait_for(call, timeout=timeout_s)


def mode_of(config: pb.BackendConfig | None) -> pb.SuspendMode:
    if config is not None:
        arm = config.WhichOneof("backend")
        if arm == "app_endpoint":
            return config.app_endpoint.mode
        if arm == "app_channel":
            return config.app_channel.mode
    return pb.SUSPEND_MODE_UNSPECIFIED


def tags_of(config: pb.BackendConfig | None) -> list[str]:
    if config is not None:
        arm = config.WhichOneof("backend")
        if arm == "app_endpoint":
            return list(config.app_endpoint.tags)
        if arm == "app_channel":
            return list(config.app_channel.tags)
    return []


class GuardedBackends:
    """The node's backends, called only under the rules of the module docstring."""

    def __init__(
        self,
        backends: Mapping[str, base.Backend],
        *,
        operation_timeout_s: float,
        on_unavailable: Callable[[str, base.BackendError], None] | None = None,
    ) -> None:
        self.backends = dict(backends)
        self.operation_timeout_s = operation_timeout_s
        #: A question never waits longer than an operation would.
        self.query_timeout_s = min(QUERY_TIMEOUT_S, operation_timeout_s)
        self._on_unavailable = on_unavailable or (lambda _name, _err: None)
        #: The device indices of this node each group uses, as the orchestrator's Grants
        #: say (absent: all of them); every context of a job's state for the group has them.
        self.devices: dict[str, tuple[int, ...]] = {}
        # What each backend declares, looked up once (backends do not change).
        named = self.backends.items()
        #: The backends that run a snapshot and a restore at once (``overlaps_moves``).
        self.overlapping = frozenset(n for n, b in named if b.overlaps_moves)
        #: ... that bring saved states in ahead of their grant (``prefetches``).
        self.prefetching = frozenset(n for n, b in named if b.prefetches)
        #: ... whose parked states hold the node's host memory (``holds_host_memory``).
        self.parking = frozenset(n for n, b in named if b.holds_host_memory)
        #: ... that check a request (the others spare a hand-over a timer).
        self._validating = frozenset(
            n for n, b in named if type(b).validate is not base.Backend.validate
        )

    def use_devices(self, group: str, devices: Sequence[int]) -> None:
        """The device indices of this node ``group`` uses from now on (none: all)."""
        if devices:
            self.devices[group] = tuple(devices)
        else:
            self.devices.pop(group, None)

    def _context(self, job: model.Job, config: pb.BackendConfig | None) -> base.JobContext:
        """What a backend is told about the job's state for one group."""
        return base.JobContext(
            job_id=job.job_id,
            group=job.group,
            config=config,
            footprint_bytes=job.footprint_bytes,
            state=dict(job.backend_state),
            devices=self.devices.get(job.group, ()),
        )

    def __contains__(self, name: object) -> bool:
        return name in self.backends

    async def prefetch(self, name: str, job: model.Job) -> int:
        """Backend ``name``'s prefetch of the job, under the operation deadline; 0 if it
        fails (logged): a prefetch is a hint, the later restore is the operation."""
        ctx = self._context(job, job.backend_config())
        landed = await self._ask(
            name,
            self.backends[name].prefetch(ctx),
            f"prefetch job {job.job_id}",
            timeout_s=self.operation_timeout_s,
        )
        return landed or 0

    # ---- questions, asked while a request is planned -----------------------------------

    async def validate(self, route: model.Route, job: model.Job) -> None:
        """Let the backend refuse the config before anything is created or changed."""
        name = route.backend
        if name not in self._validating:
            return  # the backend checks nothing
        backend, ctx = self.backends[name], self._context(job, route.config)
        try:
            await _within(backend.validate(ctx), timeout_s=self.query_timeout_s)
        except base.NeverFitsError as err:
            raise refusals.Refused(refusals.Code.RESOURCE_EXHAUSTED, str(err)) from err
        except base.BackendConfigRefusedError as err:
            raise refusals.Refused(refusals.Code.FAILED_PRECONDITION, str(err)) from err
        except base.InvalidBackendConfigError as err:
            raise refusals.Refused(refusals.Code.INVALID_ARGUMENT, str(err)) from err
        except Exception as err:
            log.exception("backend %s failed to validate a request", name)
            raise refusals.Refused(
                refusals.Code.INTERNAL,
                f"backend {name} could not check the request for job {ctx.job_id} "
                f"({type(err).__name__}: {err}); nothing was changed",
            ) from err

    async def host_bytes_needed(self, route: model.Route, job: model.Job) -> int | None:
        """The backend's estimate of what a snapshot of the job would park; None if it
        cannot tell or fails (logged)."""
        question = self.backends[route.backend].host_bytes_needed(self._context(job, route.config))
        return await self._ask(route.backend, question, f"estimate job {job.job_id}'s state")

    async def recover(self, name: str, job: model.Job) -> model.State | None:
        """What backend ``name`` reports for the job; ``None`` if it cannot tell or fails."""
        ctx = self._context(job, job.backend_config())
        reported = await self._ask(
            name, self.backends[name].recover(ctx), f"recover job {job.job_id}"
        )
        return model.from_pb(reported)

    async def fits(self, route: model.Route, job: model.Job) -> bool:
        """Whether the job's state would fit on the devices now; ``False`` if unknown."""
        question = self.backends[route.backend].fits(self._context(job, route.config))
        return bool(await self._ask(route.backend, question, f"tell whether job {job.job_id} fits"))

    async def missing_tags(self, route: model.Route, job: model.Job) -> bool:
        """Staged wake: whether tags the request names are not resident although the job
        runs (``Backend.missing_tags``); ``False`` when it names none."""
        tags = tags_of(route.config)
        if job.state is not model.State.RUNNING or not tags:
            return False
        question = self.backends[route.backend].missing_tags(self._context(job, route.config), tags)
        return bool(await self._ask(route.backend, question, "report missing tags"))

    async def accelerators(self) -> list[base.Accelerator]:
        found: list[base.Accelerator] = []
        for name, backend in self.backends.items():
            listed = await self._ask(
                name, backend.accelerators(), "list accelerators", timeout_s=STATUS_TIMEOUT_S
            )
            found.extend(listed or [])
        return found

    async def _ask(
        self,
        name: str,
        question: Coroutine[Any, Any, _T],
        what: str,
        *,
        timeout_s: float | None = None,
    ) -> _T | None:
        """The backend's answer; ``None`` (logged) if it fails or outlives its deadline."""
        try:
            return await _within(question, timeout_s=timeout_s or self.query_timeout_s)
        except Exception as err:
            log.warning("backend %s could not %s: %s", name, what, err)
            return None

    # ---- operations ------------------------------------------------------------------------

    async def run(
        self, op: model.Operation, job: model.Job, config: pb.BackendConfig | None
    ) -> model.Outcome:
        """Run the operation's backend call under its deadline, retrying transient failures."""
        # Every log line of the operation's task names it (a C call: no work to speak of).
        logs.IDS.set({"job_id": job.job_id, "group_id": job.group, "operation_id": op.op_id})
        backend, ctx = self.backends[op.backend], self._context(job, config)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.operation_timeout_s
        what = f"{op.kind.value} of job {ctx.job_id} by backend {backend.name}"
        delay = _BACKOFF_MIN_S
        while True:
            remaining = deadline - loop.time()
            try:
                result = await _within(
                    _invoke(backend, op.kind, ctx, config), timeout_s=max(remaining, 0.0)
                )
                return model.Outcome(result=result)
            except base.TransientBackendError as err:
                delay = min(max(err.retry_after, delay), _BACKOFF_MAX_S)
                if loop.time() + delay >= deadline:
                    return model.Outcome(
                        error=f"{what} kept failing until its {self.operation_timeout_s:g} s "
                        f"deadline; nothing was changed: {err}",
                        state_changed=False,
                    )
                log.info("%s: transient failure, retrying in %.2fs: %s", what, delay, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
            except asyncio.TimeoutError:
                if loop.time() < deadline:
                    return model.Outcome(error=f"{what} failed: the backend timed out internally")
                return model.Outcome(
                    error=f"{what} did not finish within {self.operation_timeout_s:g} s "
                    "(operation_timeout_s); check the backend, then ResetJob"
                )
            except base.RefusedBackendError as err:
                return model.Outcome(
                    error=f"{what} was refused; nothing was changed: {err}", state_changed=False
                )
            except base.BackendError as err:
                if isinstance(err, base.BackendUnavailableError):
                    self._on_unavailable(backend.name, err)
                return model.Outcome(error=f"{what} failed: {err}")
            except Exception as err:
                log.exception("%s crashed", what)
                return model.Outcome(error=f"{what} crashed: {type(err).__name__}: {err}")


async def _invoke(
    backend: base.Backend, kind: model.Kind, ctx: base.JobContext, config: pb.BackendConfig | None
) -> base.OpResult:
    if kind is model.Kind.SNAPSHOT:
        return await backend.snapshot(ctx, mode_of(config))
    if kind is model.Kind.RESTORE:
        return await backend.restore(ctx)
    return await backend.activate(ctx)
