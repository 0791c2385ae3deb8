"""Orchestrator process: wiring, graceful shutdown, ready file.

``serve()`` runs everything in the current event loop until ``stop`` is set (so
``tslice up``, the demo and tests can run it in-process); ``run()`` is the
blocking entry point of ``tslice orchestrator`` with signal handling.

Shutdown order: health NOT_SERVING, then each group stops (new RPCs get
UNAVAILABLE, an in-flight switch may finish within ``shutdown_grace_s``, waiters
get UNAVAILABLE "orchestrator shutting down; retry" while their queue entries
stay persisted so they keep their place after a restart), then the gRPC server
stops with the same grace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import prometheus_client as prom
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import auth, errors, ids, logs, serving, undecodable
from tslice.common import metrics_http as common_metrics_http
from tslice.orchestrator import agents, config, events, group, manager, metrics, server, store

if TYPE_CHECKING:
    from tslice.orchestrator.kube import discovery as kube_discovery

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
) -> None:
    """Serve until ``stop`` is set (forever if None); ``ready(address)`` once listening.

    The state directory stays locked meanwhile: a second orchestrator on it is refused.
    """
    with serving.locked_state_dir(cfg.state_dir, what="orchestrator"):
        await _serve_locked(cfg, ready=ready, stop=stop)


async def _serve_locked(
    cfg: config.OrchestratorConfig,
    *,
    ready: Callable[[str], None] | None,
    stop: asyncio.Event | None,
) -> None:
    # First: an unreadable tokens file stops the start before anything is opened.
    interceptors = [
        *serving.auth_interceptors(cfg.auth, auth.ORCHESTRATOR_RULES, "orchestrator"),
        # Inside authentication: a caller is verified before its bytes are parsed.
        undecodable.UndecodableRequests(),
    ]
    db = await store.Store.open(cfg.state_dir, synchronous=cfg.sqlite_synchronous)
    pool = agents.AgentPool(
        rpc_timeout_s=cfg.agent_rpc_timeout_s,
        operation_timeout_s=cfg.operation_timeout_s,
        wait_chunk_s=cfg.wait_chunk_s,
        security=cfg.agent_client,
    )
    bus = events.EventBus()
    m = metrics.OrchestratorMetrics()
    bus.on_drop = m.events_dropped.inc
    grpc_server = grpc.aio.server(
        options=[*_SERVER_OPTIONS, *serving.SERVER_OPTIONS],
        interceptors=interceptors,
    )
    health_servicer = health.aio.HealthServicer()
    metrics_http: Any = None
    groups: manager.GroupManager | None = None
    servicer: server.OrchestratorServicer | None = None
    discovery: kube_discovery.Discovery | None = None
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
        if cfg.kubernetes is not None:
            discovery = _discovery(cfg.kubernetes)
            found = await discovery.start(stop)
            if found is None:
                return  # stopped while the API server had not answered yet
            cfg = dataclasses.replace(cfg, topology=config.Topology(groups=found))
        groups = manager.GroupManager(group.Services(cfg=cfg, db=db, pool=pool, bus=bus, metrics=m))
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
        await groups.start()
        if discovery is not None:
            discovery.follow(groups)
        servicer = server.OrchestratorServicer(groups=groups, bus=bus)
        opb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(servicer, grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server
        )
        await grpc_server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        address = _public_address(cfg.host, port)
        log.info(
            "orchestrator serving on %s (%s mode, %d groups, %s)",
            address,
            _mode(cfg),
            len(groups.ids()),
            serving.transport_name(cfg.tls),
            extra={"address": address, "state_dir": str(cfg.state_dir)},
        )
        if ready is not None:
            ready(address)
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await health_servicer.enter_graceful_shutdown()
        if discovery is not None:
            await discovery.close()
        if groups is not None:
            await groups.stop(grace_s=cfg.shutdown_grace_s)
        if servicer is not None:
            servicer.close()
        bus.close()
        await grpc_server.stop(cfg.shutdown_grace_s)
        await pool.close()
        await db.close()
        if metrics_http is not None:
            metrics_http.stop()
        log.info("orchestrator stopped")


def _mode(cfg: config.OrchestratorConfig) -> str:
    if cfg.kubernetes is not None:
        return "kubernetes"
    return "local" if cfg.topology.local else "static"


def _discovery(settings: config.KubeSettings) -> kube_discovery.Discovery:
    """Kubernetes mode's discovery, imported only here: lightkube is an optional extra."""
    try:
        from tslice.orchestrator.kube import discovery
    except ImportError as err:
        raise errors.ConfigError(
            f"--kubernetes needs the kubernetes extra (cannot import {err.name or err}): "
            "pip install 'tslice[kubernetes]'"
        ) from err
    return discovery.Discovery(settings)


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
            names[node.address] = ids.check_id("node name", reply.node)
        except ids.InvalidIdError:
            continue
        taken.add(reply.node)
    named = tuple(config.NodeRef(names.get(n.address, n.name), n.address) for n in nodes)
    return dataclasses.replace(cfg, topology=config.Topology(local_nodes=named))


def run(cfg: config.OrchestratorConfig, *, ready_file: pathlib.Path | None = None) -> None:
    """Blocking entry point: SIGTERM/SIGINT stop gracefully."""
    logs.setup(cfg.log_level)
    serving.run_until_signalled(
        lambda ready, stop: serve(cfg, ready=ready, stop=stop), ready_file=ready_file
    )
