"""HA mode's terms: campaign, lead over the API-server state, step down, campaign again.

Each Lease won (``kube.lease``) is a term: the process's leader term is advanced to it
(every agent call carries it from then on, ``tslice.security.leader_term``), the state
ConfigMaps are claimed (``kube.state``), and the replica leads as the embedded mode does
(groups resumed through the crash-recovery path: each group reads its agents before it
grants anything, a switch in progress is rolled forward or back). The term ends when

- the Lease is lost (not renewed within the renew deadline, or another's): the groups
  stop at once (no grace: another replica may be leading already);
- the replica is deposed: a state write refused because a newer term wrote it, or an
  agent refusing a directive because it has seen a newer term: the same;
- the process is stopped (SIGTERM): the groups stop with the shutdown grace (an
  in-flight switch may finish), then the Lease is released so that a follower takes
  over at its next read instead of waiting for it to expire.

From the moment the term ends the replica answers as a follower; then it campaigns again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from grpc_health.v1 import health_pb2

from tslice.common import errors, tasks
from tslice.orchestrator import config
from tslice.orchestrator.kube import leadership, lease, state
from tslice.orchestrator.persistence import store
from tslice.security import leader_term
from tslice.server import kube_watch

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Leader(Protocol):
    """What leading one term is (``tslice.orchestrator.app``)."""

    def lead(
        self, db: store.LockStore, *, grace_s: Any
    ) -> contextlib.AbstractAsyncContextManager[Any]: ...

    def group_ids(self) -> list[str]: ...


async def _unless_stopped(work: Awaitable[_T], stop: asyncio.Event) -> _T | None:
    """``work``'s result, or None (``work`` cancelled) if ``stop`` is set first."""
    job = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({job, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in (job, stopped):
            if not waiting.done():
                waiting.cancel()
    if job.done() and not job.cancelled():
        return job.result()
    await asyncio.gather(job, return_exceptions=True)
    return None


class _Ending:
    """Why the current term ends (the first reason wins)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.why = ""

    def end(self, why: str) -> None:
        if not self.event.is_set():
            self.why = why
            self.event.set()

    def reset(self) -> None:
        self.event.clear()
        self.why = ""


async def run_terms(
    cfg: config.OrchestratorConfig,
    ha: leadership.HaSettings,
    *,
    role: leadership.Leadership,
    term: leader_term.Term,
    leader: Leader,
    health: Any,
    stop: asyncio.Event,
) -> None:
    """Campaign and lead, term after term, until ``stop`` is set."""
    assert cfg.kubernetes is not None
    # The client logs every request at info: renewals would flood the log.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        client = kube_watch.connect(cfg.kubernetes.kubeconfig)
    except Exception as err:
        raise errors.ConfigError(
            f"cannot load Kubernetes credentials for leader election: {err}; give "
            "--kubeconfig FILE or run in a pod with a ServiceAccount"
        ) from err
    terms = _Terms(cfg, ha, client, role=role, term=term, leader=leader, health=health)
    try:
        await terms.run(stop)
    finally:
        await client.close()


class _Terms:
    def __init__(
        self,
        cfg: config.OrchestratorConfig,
        ha: leadership.HaSettings,
        client: Any,
        *,
        role: leadership.Leadership,
        term: leader_term.Term,
        leader: Leader,
        health: Any,
    ) -> None:
        self._cfg, self._ha, self._client = cfg, ha, client
        self._role, self._term, self._leader, self._health = role, term, leader, health
        self._elector = lease.Elector(
            client,
            ha,
            on_seen=role.saw_leader,
            known_terms=lambda: state.highest_term(client, ha.namespace),
        )
        self._ending = _Ending()
        term.on_deposed(self._agent_deposed)

    def _agent_deposed(self, newer: int) -> None:
        # The next win is above it (the Lease may have been created again, its count lower).
        self._elector.raise_floor(newer)
        mine = self._term.value
        self._ending.end(
            f"an agent refused a directive: it has seen leader term {newer}, newer than "
            f"this replica's {mine}"
            if newer > mine
            else f"an agent refused a directive: it has seen this replica's leader term {mine} "
            "from another replica (two replicas elected in one term)"
        )

    def _state_deposed(self, why: str, term: int) -> None:
        self._elector.raise_floor(term)  # the next win is above the ConfigMap's writer
        self._ending.end(why)

    async def run(self, stop: asyncio.Event) -> None:
        elector, term = self._elector, self._term
        while not stop.is_set():
            won = await _unless_stopped(elector.acquire(), stop)
            if won is None:
                return
            if won <= term.value:  # never: every win is above the floor, ours included
                elector.raise_floor(term.value)
                await elector.release()
                continue
            term.advance(won)
            self._role.elected()
            self._ending.reset()
            # Renewed from the take on: claiming many ConfigMaps may outlast the Lease.
            holding = tasks.spawn(elector.hold(), name="ha:lease")
            holding.add_done_callback(self._held_until)
            ending = self._ending
            try:
                db = await self._claim(won)
                if db is not None and not ending.event.is_set():
                    await self._lead(won, db, stop)
                elif db is not None:
                    log.warning("leader term %d ended before leading: %s", won, ending.why)
                    await db.close()
            finally:
                await tasks.cancel_all([holding])
            await elector.release()

    def _held_until(self, holding: asyncio.Task[str]) -> None:
        if not holding.cancelled():
            self._ending.end(_lost(holding))

    async def _claim(self, won: int) -> state.ConfigMapStore | None:
        """The term's state, claimed; None (the Lease given up) if it cannot be."""
        ha = self._ha
        db = state.ConfigMapStore(
            self._client,
            namespace=ha.namespace,
            term=won,
            identity=ha.identity,
            on_deposed=self._state_deposed,
        )
        try:
            await db.claim()
            return db
        except state.NewerTerm as err:
            log.error("leader term %d: %s; campaigning again above it", won, err)
            self._elector.raise_floor(err.term)
            self._role.follow(f"deposed while claiming the state: {err}")
        except store.StoreError as err:
            log.error("leader term %d: %s; giving the Lease up", won, err)
            self._role.follow(f"could not read the state: {err}")
            await asyncio.sleep(ha.renew_interval_s)  # not at once: the next read may work
        return None

    async def _lead(self, won: int, db: state.ConfigMapStore, stop: asyncio.Event) -> None:
        role, ending = self._role, self._ending
        graceful = False
        try:
            async with self._leader.lead(
                db, grace_s=lambda: self._cfg.shutdown_grace_s if graceful else 0.0
            ) as servicer:
                if servicer is None:
                    return  # stopped before the topology was known
                role.lead(servicer)
                await self._health.set(role.service, health_pb2.HealthCheckResponse.SERVING)
                log.info(
                    "leading as %s (leader term %d, %d groups)",
                    self._ha.identity,
                    won,
                    len(self._leader.group_ids()),
                )
                waits = {
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(ending.event.wait()),
                }
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in waits:
                        waiting.cancel()
                graceful = not ending.event.is_set()
                why = "stopping (SIGTERM)" if graceful else ending.why
                # Refuse from now on, before the groups stop: nothing new starts here.
                role.follow(why)
                await self._health.set(role.service, health_pb2.HealthCheckResponse.NOT_SERVING)
                log.warning("stepping down as leader (term %d): %s; its groups stop", won, why)
        finally:
            role.follow()
            await db.close()
        log.info("leader term %d ended; following", won)


def _lost(holding: asyncio.Task[str]) -> str:
    error = holding.exception()
    if error is not None:  # a bug: without renewals this replica must not lead
        return f"renewing the Lease failed ({type(error).__name__}: {error})"
    return holding.result()
