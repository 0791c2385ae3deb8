"""A group's switches, from the group's side: start one, follow it, report how it ended.

The switch itself (``tslice.orchestrator.switch.step``) runs in its own task so that
Acquire, Yield and cancellations keep flowing meanwhile. :class:`SwitchRunner` is
its :class:`~tslice.orchestrator.switch.step.SwitchHooks`: progress (a node failing and
retrying, a node back) and the outcome (done, refused, a node degraded, abandoned)
are posted to the group's inbox, where the worker applies them to the lock and the
group's :class:`~tslice.orchestrator.group.status.Health`; events and metrics go out from
here directly. What a completed switch took feeds the group's scheduling policy
(``tslice.orchestrator.policy``: the cost-aware one prefers cheap switches). The
per-node views are the switch's cache: the running switch owns
them, and the worker drops them only when no switch runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import tasks
from tslice.orchestrator import config, metrics, tracing_hooks
from tslice.orchestrator.events import bus as events
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import inbox, lock, overlap, status
from tslice.orchestrator.switch import plan as steps
from tslice.orchestrator.switch import pool as agents
from tslice.orchestrator.switch import step as switch
from tslice.server import logs, tracing

log = logging.getLogger(__name__)

Kind = opb.OrchestratorEvent


class Group(Protocol):
    """What the runner uses of its group's driver."""

    group_id: str
    nodes: tuple[config.NodeRef, ...]
    lock: lock.GroupLock
    events: events.GroupEvents
    health: status.Health
    views: dict[str, steps.NodeView]

    @property
    def stopping(self) -> bool: ...

    def post(self, command: inbox.Command) -> None: ...

    def bind(self, actions: list[decisions.Action]) -> list[inbox.Effect]: ...

    def release_deferred(self) -> None:
        """Run the effects held back until the switch's first calls were sent."""


class SwitchRunner:
    """Runs one group's switches (one at a time) and implements ``switch.SwitchHooks``."""

    def __init__(
        self,
        group: Group,
        *,
        cfg: config.OrchestratorConfig,
        pool: agents.AgentPool,
        series: metrics.OrchestratorMetrics,
        arbiter: overlap.DeviceArbiter,
    ) -> None:
        self._group = group
        self._gid = group.group_id
        self._cfg = cfg
        self._pool = pool
        self._metrics = series
        self._arbiter = arbiter
        self.backoff = switch.Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self.task: asyncio.Task[None] | None = None
        # Labelled children, looked up once (labels() costs more than observe()).
        self._durations: dict[tuple[str, str], Any] = {}
        self._completed = series.switches.labels(group_id=self._gid, outcome="completed")
        self._duration = series.switch_duration.labels(group_id=self._gid)

    def start(self, s: decisions.StartSwitch) -> None:
        """Start the switch ``s`` (from the worker, once its intent is persisted)."""
        self._group.events.hold()
        run = self._run(s)
        if tracing.ENABLED:  # (off: not even a call)
            run = tracing_hooks.handover(run, group=self._gid, switch=s, nodes=self._group.nodes)
        self.task = tasks.spawn(run, name=f"group:{self._gid}:switch:{s.epoch}")

    async def finish(self, *, grace_s: float) -> None:
        """Let a switch in flight finish within the grace."""
        if self.task is not None and not self.task.done():
            await asyncio.wait({self.task}, timeout=grace_s)

    # ---- switch.SwitchHooks ----------------------------------------------------------------

    def wants(self, kind: opb.OrchestratorEvent.Kind) -> bool:
        return self._group.events.wants(kind)

    def publish(self, event: opb.OrchestratorEvent) -> None:
        self._group.events.publish(event)

    def observe(self, node: str, operation: str, seconds: float) -> None:
        series = self._durations.get((node, operation))
        if series is None:
            series = self._metrics.agent_operation.labels(
                group_id=self._gid, node=node, operation=operation
            )
            self._durations[(node, operation)] = series
        series.observe(seconds)

    def node_ok(self, node: str) -> None:
        health = self._group.health
        if node in health.unreachable:  # read here, changed by the worker
            self._group.post(inbox.change(lambda: health.unreachable.pop(node, None)))

    def node_failed(
        self, node: str, operation: str, detail: str, *, unreachable: bool, retry_in: float
    ) -> None:
        self._metrics.switch_step_failures.labels(
            group_id=self._gid, node=node, operation=operation
        ).inc()
        why = f"{node}: {operation} failed: {detail}; retrying in {retry_in:.2f} s"
        sw = self._group.lock.switching
        self._group.events.emit(
            Kind.KIND_SWITCH_FAILED,
            job_id=sw.to_job if sw else "",
            from_job=(sw.from_job or "") if sw else "",
            node=node,
            grant_epoch=sw.epoch if sw else 0,
            detail=why,
        )
        log.warning("group %s: %s", self._gid, why)
        health = self._group.health

        def failed(now: float) -> list[inbox.Effect]:
            health.switch_detail = why
            if unreachable:
                health.unreachable[node] = detail
            else:
                health.unreachable.pop(node, None)
            return []

        self._group.post(failed)

    def should_continue(self) -> bool:
        group = self._group
        return not group.stopping and group.lock.wants_switch(now=time.monotonic())

    # ---- one switch ------------------------------------------------------------------------

    def _give_way(self) -> dict[str, frozenset[str]]:
        """Per node, the overlapping groups whose residents may give way to this switch.

        While this group holds the device claim, none of them has a holder.
        """
        by_node: dict[str, set[str]] = {}
        for other in self._arbiter.released(self._gid):
            for node in self._arbiter.shared_nodes(self._gid, other):
                by_node.setdefault(node, set()).add(other)
        return {node: frozenset(groups) for node, groups in by_node.items()}

    async def _run(self, s: decisions.StartSwitch) -> None:
        # Every log line of the switch's task names it (a C call: no work to speak of).
        logs.IDS.set(
            {
                "group_id": self._gid,
                "job_id": s.to_job,
                "from_job": s.from_job or "",
                "grant_epoch": s.epoch,
            }
        )
        group = self._group
        plan = steps.SwitchPlan(
            self._gid,
            s.from_job,
            s.to_job,
            s.epoch,
            s.footprint_bytes,
            self._give_way(),
            stray=self._arbiter.stray,
        )
        fields = {"job_id": s.to_job, "from_job": s.from_job or "", "grant_epoch": s.epoch}

        def announce() -> None:
            # Every node's first call is on its way: what waited for that may run now.
            group.release_deferred()
            detail = "recovered" if s.recovered else ""
            group.events.emit(Kind.KIND_SWITCH_STARTED, **fields, detail=detail)

        started = time.monotonic()
        try:
            restored = await switch.run_switch(
                plan=plan,
                nodes=group.nodes,
                pool=self._pool,
                views=group.views,
                hooks=self,
                backoff=self.backoff,
                started=announce,
                max_refusals=self._cfg.max_refusals,
                max_operation_failures=self._cfg.max_operation_failures,
            )
        except asyncio.CancelledError:
            raise
        except switch.JobRefused as refused:
            code, why = refused.code, refused.detail
            self._failed(s, f"refused: {why}", "refused")
            self._ended(
                lambda now: group.lock.on_switch_refused(
                    epoch=s.epoch, code=code, detail=why, now=now
                )
            )
            return
        except switch.StaleEpoch as stale:
            mark = stale.mark
            why = (
                f"grant epoch {s.epoch} is behind node {stale.node}'s mark {mark} (this "
                "orchestrator's state was lost or truncated); granting again past it"
            )
            log.warning("group %s: %s", self._gid, why, extra={"group_id": self._gid})
            self._failed(s, why, "stale_epoch")
            self._ended(lambda now: group.lock.on_stale_epoch(epoch=s.epoch, mark=mark, now=now))
            return
        except switch.Deposed as deposed:
            # The group's state is the new leader's: nothing is recorded here (this
            # replica steps down and its groups stop).
            log.warning(
                "group %s: switch to %s stopped, this leader was deposed: %s",
                self._gid,
                s.to_job,
                deposed,
                extra={"group_id": self._gid},
            )
            return
        except switch.NodeDegraded as degraded:
            self._failed(s, str(degraded), "degraded")
            self._ended(self._degrade(s, degraded.node, degraded.reason))
            return
        except Exception as err:
            if not isinstance(err, switch.GiveUp):
                log.exception("group %s: switch to %s crashed", self._gid, s.to_job)
            detail = str(err)
            self._failed(s, f"abandoned (nobody waits any more): {detail}", "abandoned")
            self._ended(
                lambda now: group.lock.on_switch_failed(epoch=s.epoch, detail=detail, now=now)
            )
            return
        finally:
            group.release_deferred()  # in case the switch ended before its first calls
        elapsed = time.monotonic() - started
        log.info(
            "group %s: switch %s -> %s done in %.1f ms%s",
            self._gid,
            s.from_job or "-",
            s.to_job,
            elapsed * 1000,
            " (restored)" if restored else "",
            extra={"group_id": self._gid, "job_id": s.to_job, "grant_epoch": s.epoch},
        )
        self._completed.inc()
        self._duration.observe(elapsed)

        def announce_done() -> None:
            detail = "restored" if restored else ""
            duration_ms = int(elapsed * 1000)
            group.events.emit(
                Kind.KIND_SWITCH_DONE, **fields, duration_ms=duration_ms, detail=detail
            )

        def done(now: float) -> list[inbox.Effect]:
            # Persisted, then the Acquire is answered (urgent); then SWITCH_DONE and
            # GRANTED go out and the held events follow, in that order.
            group.health.switch_detail = ""
            if not s.recovered:  # a recovered switch's time is only part of one
                group.lock.on_switch_measured(s.from_job, s.to_job, seconds=elapsed)
            granted = group.bind(
                group.lock.on_switch_done(epoch=s.epoch, restored=restored, now=now)
            )
            return [announce_done, *granted, group.events.release]

        group.post(done)

    def _failed(self, s: decisions.StartSwitch, detail: str, outcome: str) -> None:
        """The switch ended without a grant (``outcome``: refused, stale_epoch, degraded,
        abandoned): say so (events, metrics) at once."""
        self._metrics.switches.labels(group_id=self._gid, outcome=outcome).inc()
        if tracing.ENABLED:
            tracing_hooks.failed(outcome, detail)
        self._group.events.emit(
            Kind.KIND_SWITCH_FAILED,
            job_id=s.to_job,
            from_job=s.from_job or "",
            grant_epoch=s.epoch,
            detail=detail,
        )
        self._group.events.release()

    def _ended(self, decide: Callable[[float], list[decisions.Action]]) -> None:
        """Post the end of a failed switch: the lock decides what comes next."""
        group = self._group

        def ended(now: float) -> list[inbox.Effect]:
            group.health.switch_detail = ""
            group.views.clear()
            return group.bind(decide(now))

        group.post(ended)

    def _degrade(
        self, s: decisions.StartSwitch, node: str, cause: str
    ) -> Callable[[float], list[decisions.Action]]:
        reason = (
            f"group {self._gid}: node {node} is degraded ({cause}); fix the cause, "
            f"then clear it: tslice clear-degraded {self._gid} --node {node}"
        )
        log.error("%s", reason, extra={"group_id": self._gid})
        group = self._group

        def degrade(now: float) -> list[decisions.Action]:
            group.health.degraded[node] = cause
            return group.lock.on_degraded(epoch=s.epoch, cause=cause, reason=reason, now=now)

        return degrade
