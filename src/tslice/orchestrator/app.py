"""Orchestrator process: wiring, graceful shutdown, ready file.

``serve()`` runs everything in the current event loop until ``stop`` is set (so
``tslice up``, the demo and tests can run it in-process); ``run()`` is the
blocking entry point of ``tslice orchestrator`` with signal handling.

Health is NOT_SERVING while the state cannot be written (a full disk, a corrupt database:
see ``store_health``), the reason logged, and SERVING again once a save goes through.

Shutdown order: health NOT_SERVING, then each group stops (new RPCs get
UNAVAILABLE, an in-flight switch may finish within ``shutdown_grace_s``, waiters
get UNAVAILABLE "orchestrator shutting down; retry" while their queue entries
stay persisted so they keep their place after a restart), then the gRPC server
stops with the same grace.

In Kubernetes HA mode (``ha``) the process serves at once as a follower (every call of
the orchestrator service redirected to the leader, ``kube.leadership``) and campaigns
for the Lease; each term it wins, it leads as above over the state in the API server
(``kube.ha``), until it loses the Lease, is deposed, or is stopped (then the groups
stop first and the Lease is released, so the next leader starts at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
import prometheus_client as prom
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import errors, tasks, validation
from tslice.orchestrator import config, metrics, server
from tslice.orchestrator.events import bus, tap
from tslice.orchestrator.group import discovered, manager
from tslice.orchestrator.group import driver as group
from tslice.orchestrator.persistence import health as store_health
from tslice.orchestrator.persistence import history, store
from tslice.orchestrator.switch import check as agent_check
from tslice.orchestrator.switch import pool as agents
from tslice.rpc import undecodable
from tslice.security import leader_term, roles
from tslice.server import logs, serving, tracing
from tslice.server import metrics_http as common_metrics_http

if TYPE_CHECKING:
    from tslice.orchestrator.kube import leadership as kube_leadership
    from tslice.orchestrator.kube.leadership import HaSettings

log = logging.getLogger(__name__)

SERVICE_NAME = opb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"].full_name

# Clients (tslice.client) keep their channel alive with pings; accept them.
_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
]


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _public_address(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return _bind_address(host, port)


async def serve(
    cfg: config.OrchestratorConfig,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    ha: HaSettings | None = None,
) -> None:
    """Serve until ``stop`` is set (forever if None); ``ready(address)`` once listening.

    The state directory stays locked meanwhile: a second orchestrator on it is refused.
    With ``ha`` (Kubernetes mode only) this is one replica of several: it leads while it
    holds the Lease, with its state in the API server (``tslice.orchestrator.kube``).
    """
    with serving.locked_state_dir(cfg.state_dir, what="orchestrator"):
        await _serve_locked(cfg, ready=ready, stop=stop or asyncio.Event(), ha=ha)


async def _serve_locked(
    cfg: config.OrchestratorConfig,
    *,
    ready: Callable[[str], None] | None,
    stop: asyncio.Event,
    ha: HaSettings | None,
) -> None:
    # First: an unreadable tokens file stops the start before anything is opened.
    interceptors = [
        *serving.auth_interceptors(cfg.auth, roles.ORCHESTRATOR_RULES, "orchestrator"),
        # Inside authentication: a caller is verified before its bytes are parsed.
        undecodable.UndecodableRequests(),
    ]
    role: kube_leadership.Leadership | None = None
    if ha is not None:
        if cfg.kubernetes is None:
            raise errors.ConfigError(
                "--ha elects a leader among Kubernetes-mode replicas: add --kubernetes"
            )
        leadership = _kube_module("leadership")
        role = leadership.Leadership(SERVICE_NAME, ha.identity)
        # Innermost: a follower refuses only callers that are allowed to call at all.
        interceptors.append(leadership.FollowerGate(role))
    db = (
        await store.Store.open(cfg.state_dir, synchronous=cfg.sqlite_synchronous)
        if ha is None
        else None
    )
    term = leader_term.Term(leader=ha.identity if ha is not None else "")
    pool = agents.AgentPool(
        rpc_timeout_s=cfg.agent_rpc_timeout_s,
        operation_timeout_s=cfg.operation_timeout_s,
        wait_chunk_s=cfg.wait_chunk_s,
        security=cfg.agent_client,
        term=term,
    )
    m = metrics.OrchestratorMetrics()
    # The event history (beside the state, in every mode) and the metrics derived from
    # events: one tap for the whole process, across leaderships.
    kept = cfg.history
    event_tap = tap.EventTap(
        series=m,
        store=await history.History.open(cfg.state_dir, kept) if kept.enabled else None,
        flush_interval_s=kept.flush_interval_s,
    )
    event_tap.start()
    grpc_server = grpc.aio.server(
        options=[*_SERVER_OPTIONS, *serving.SERVER_OPTIONS],
        interceptors=interceptors,
    )
    health_servicer = health.aio.HealthServicer()
    metrics_http: Any = None
    try:
        # Bound first: a port in use fails the start before anything else happens.
        port = serving.bind_grpc(
            grpc_server,
            host=cfg.host,
            port=cfg.port,
            what="orchestrator",
            server_tls=cfg.tls,
            insecure=cfg.insecure,
        )
        cfg = await _name_local_agents(cfg, pool)
        if cfg.metrics_port:
            metrics_http = common_metrics_http.serve(
                prom.make_wsgi_app(m.registry),
                host=cfg.host,
                port=cfg.metrics_port,
                server="orchestrator",
                server_tls=cfg.tls,
                auth_settings=cfg.auth,
                insecure=cfg.insecure,
            )
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server
        )
        address = _public_address(cfg.host, port)
        leader = _Leader(cfg, pool=pool, metrics=m, stop=stop, event_tap=event_tap)

        async def serving_now(groups: int, role_name: str = "") -> None:
            await grpc_server.start()
            for name in ("", SERVICE_NAME):
                # HA mode: the orchestrator service is SERVING on the leader only (kube.ha).
                up = name == "" or role is None
                await health_servicer.set(
                    name,
                    health_pb2.HealthCheckResponse.SERVING
                    if up
                    else health_pb2.HealthCheckResponse.NOT_SERVING,
                )
            log.info(
                "orchestrator serving on %s (%s mode%s, %d groups, %s)",
                address,
                _mode(cfg),
                role_name,
                groups,
                serving.transport_name(cfg.tls),
                extra={"address": address, "state_dir": str(cfg.state_dir)},
            )
            if ready is not None:
                ready(address)

        if ha is None or role is None:  # the embedded mode: it leads, once
            assert db is not None
            async with leader.lead(db, grace_s=lambda: cfg.shutdown_grace_s) as servicer:
                if servicer is None:
                    return  # stopped while the API server had not answered yet
                opb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(servicer, grpc_server)
                await serving_now(len(leader.group_ids()))
                _report_store_health(leader.store_health, health_servicer)
                await stop.wait()
                await health_servicer.enter_graceful_shutdown()
        else:
            if not ha.address:
                ha = dataclasses.replace(ha, address=_advertised(cfg.host, port))
            forwarding = _kube_module("leadership").forwarding(
                server.OrchestratorServicer, _METHODS, role
            )
            opb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(forwarding, grpc_server)
            await serving_now(0, ", HA: a follower until it holds the Lease")
            await _kube_module("ha").run_terms(
                cfg, ha, role=role, term=term, leader=leader, health=health_servicer, stop=stop
            )
    finally:
        await health_servicer.enter_graceful_shutdown()
        await grpc_server.stop(cfg.shutdown_grace_s)
        await event_tap.close()  # after the groups stopped: their last events are written
        await pool.close()
        if db is not None:
            await db.close()
        if metrics_http is not None:
            metrics_http.stop()
        log.info("orchestrator stopped")


_METHODS = [m.name for m in opb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"].methods]


class _Leader:
    """What leading is: the groups over a store, the topology followed, the servicer.

    The embedded mode leads once, for the whole process; HA mode once per term won.
    """

    def __init__(
        self,
        cfg: config.OrchestratorConfig,
        *,
        pool: agents.AgentPool,
        metrics: metrics.OrchestratorMetrics,
        stop: asyncio.Event,
        event_tap: tap.EventTap,
    ) -> None:
        self.cfg, self._pool, self._metrics, self._stop = cfg, pool, metrics, stop
        self._tap = event_tap
        self._groups: manager.GroupManager | None = None
        #: Whether this leadership's store takes writes (see store_health).
        self.store_health = store_health.StoreHealth()

    def group_ids(self) -> list[str]:
        return self._groups.ids() if self._groups is not None else []

    @contextlib.asynccontextmanager
    async def lead(
        self, db: store.LockStore, *, grace_s: Callable[[], float]
    ) -> AsyncIterator[server.OrchestratorServicer | None]:
        """The servicer of this leadership (None: stopped before the topology was known);
        on the way out the groups stop, an in-flight switch given ``grace_s()``."""
        cfg = self.cfg
        events = bus.EventBus(caps=cfg.limits)
        events.on_drop = self._metrics.events_dropped.inc
        self._tap.attach(events)
        # A new leadership reads every node again before it moves anything there.
        await self._pool.new_term()
        groups: manager.GroupManager | None = None
        servicer: server.OrchestratorServicer | None = None
        discovery = _discovery(cfg)
        checking: asyncio.Task[None] | None = None
        try:
            if discovery is not None:
                found = await discovery.start(self._stop)
                if found is None:
                    yield None
                    return
                cfg = dataclasses.replace(cfg, topology=config.Topology(groups=found))
            services = group.Services(
                cfg=cfg,
                db=db,
                pool=self._pool,
                bus=events,
                metrics=self._metrics,
                store_health=self.store_health,
            )
            groups = self._groups = manager.GroupManager(services)
            await groups.start()
            # Each agent asked once: one that does not answer (or whose TLS does not
            # match agent_client) is a warning now, not a group silently UNKNOWN.
            checking = tasks.spawn(agent_check.warn_at_start(cfg, self._pool), name="agents:check")
            if discovery is not None:
                discovery.follow(groups)
            self._metrics.health.read = functools.partial(_readings, groups, self.store_health)
            servicer = server.OrchestratorServicer(
                groups=groups, events=events, store=self.store_health, event_tap=self._tap
            )
            yield servicer
        finally:
            if checking is not None:
                await tasks.cancel_all([checking])
            if discovery is not None:
                await discovery.close()
            if groups is not None:
                self._metrics.health.read = dict
                await groups.stop(grace_s=grace_s())
                self._groups = None
            if servicer is not None:
                servicer.close()
            events.close()


def _readings(
    groups: manager.GroupManager, store: store_health.StoreHealth
) -> dict[str, metrics.GroupReading]:
    """Each group's state, queue and nodes, for a scrape. It reads them in the HTTP thread
    while the loop may change them: a read that raced a change is tried again."""
    for _ in range(3):
        try:
            drivers = [d for d in map(groups.get, groups.ids()) if d is not None]
            return {
                d.group_id: metrics.GroupReading(
                    state=d.reported_state()[0],
                    queue_depth=len(d.lock.queue),
                    reserved=d.lock.reserved_for is not None,
                    degraded=len(dict(d.health.degraded)),
                    unreachable=len(dict(d.health.unreachable)),
                )
                for d in drivers
            }
        except RuntimeError:  # a dict changed size while it was copied
            continue
    return {}


def _report_store_health(
    state: store_health.StoreHealth, health_servicer: health.aio.HealthServicer
) -> None:
    """Health NOT_SERVING (logged with the reason) while the state cannot be written, so
    that a supervisor sees it; SERVING again once a save goes through (embedded mode: in
    HA mode the leadership sets health)."""
    pending: set[asyncio.Task[None]] = set()

    async def set_all(serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    def changed(problem: str) -> None:
        if problem:
            log.error("orchestrator NOT_SERVING: %s", problem)
        else:
            log.warning("orchestrator SERVING again: no group waits for its state to be written")
        task = tasks.spawn(set_all(not problem), name="health:store")
        pending.add(task)
        task.add_done_callback(pending.discard)

    state.watch(changed)
    if state.problem:  # it failed before serving began
        changed(state.problem)


def _advertised(host: str, port: int) -> str:
    """Where clients reach this replica: the pod's IP (``$POD_IP``, the downward API) on a
    wildcard host, else the host served on."""
    pod_ip = os.environ.get("POD_IP", "")
    if host in ("", "0.0.0.0", "::", "[::]") and pod_ip:
        return _bind_address(pod_ip, port)
    return _public_address(host, port)


def _mode(cfg: config.OrchestratorConfig) -> str:
    if cfg.kubernetes is not None:
        return "kubernetes"
    if cfg.slurm is not None:
        return "slurm"
    return "local" if cfg.topology.local else "static"


def _kube_module(name: str) -> Any:
    """A module of Kubernetes mode, imported only when used: lightkube is an optional extra."""
    try:
        return importlib.import_module(f"tslice.orchestrator.kube.{name}")
    except ImportError as err:
        raise errors.ConfigError(
            f"--kubernetes needs the kubernetes extra (cannot import {err.name or err}): "
            "pip install 'tslice[kubernetes]'"
        ) from err


def _discovery(cfg: config.OrchestratorConfig) -> discovered.Source | None:
    """Where a discovered mode's topology comes from (None: a topology of the config)."""
    if cfg.slurm is not None:
        from tslice.orchestrator.slurm import discovery as slurm_discovery

        return slurm_discovery.Discovery(cfg.slurm)
    if cfg.kubernetes is None:
        return None
    found: discovered.Source = _kube_module("discovery").Discovery(cfg.kubernetes)
    return found


async def _name_local_agents(
    cfg: config.OrchestratorConfig, pool: agents.AgentPool
) -> config.OrchestratorConfig:
    """Local agents given without a name take the name they report (else their address)."""
    nodes = cfg.topology.local_nodes
    unnamed = [n for n in nodes if n.name == n.address]
    if not unnamed:
        return cfg
    replies = await asyncio.gather(
        *(pool.get(n.address).status(timeout_s=min(1.0, cfg.status_timeout_s)) for n in unnamed),
        return_exceptions=True,
    )
    taken = {n.name for n in nodes if n.name != n.address}
    names: dict[str, str] = {}
    for node, reply in zip(unnamed, replies, strict=True):
        if isinstance(reply, BaseException) or not reply.node or reply.node in taken:
            continue
        try:
            names[node.address] = validation.check_id("node name", reply.node)
        except validation.InvalidIdError:
            continue
        taken.add(reply.node)
    named = tuple(config.NodeRef(names.get(n.address, n.name), n.address) for n in nodes)
    return dataclasses.replace(cfg, topology=config.Topology(local_nodes=named))


def run(
    cfg: config.OrchestratorConfig,
    *,
    ready_file: pathlib.Path | None = None,
    ha: HaSettings | None = None,
) -> None:
    """Blocking entry point: SIGTERM/SIGINT stop gracefully (a leader hands over)."""
    logs.setup(cfg.log_level, static={"component": "orchestrator"})
    try:
        tracing.from_env("tslice-orchestrator")
    except tracing.TracingUnavailable as err:
        raise errors.ConfigError(str(err)) from err
    try:
        serving.run_until_signalled(
            lambda ready, stop: serve(cfg, ready=ready, stop=stop, ha=ha), ready_file=ready_file
        )
    finally:
        tracing.shutdown()
