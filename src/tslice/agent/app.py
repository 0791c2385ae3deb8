"""Assembles and runs the node agent: backends, store, core, gRPC server, health, metrics.

``serve`` runs in any event loop until ``stop`` is set (``tslice up`` and the demo run
agents in-process this way); ``run`` is the blocking entry point of ``tslice agent``
that handles SIGTERM/SIGINT and writes the ready file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tslice.agent import channel, metrics, server, traced
from tslice.agent import config as agent_config
from tslice.agent.backends import base, registry, services
from tslice.agent.channel import registration
from tslice.agent.moves import parking, runner
from tslice.agent.state import store
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.common import errors, tasks
from tslice.rpc import undecodable
from tslice.security import fencing, roles
from tslice.server import logs, serving, tracing

log = logging.getLogger(__name__)

_PRUNE_INTERVAL_MAX_S = 3600.0


async def build_backends(
    config: agent_config.AgentConfig,
    *,
    hub: channel.ChannelHub,
    processes: registration.ProcessRegistry | None = None,
    instances: Mapping[str, base.Backend] | None = None,
    names: Mapping[str, str] | None = None,
) -> dict[str, base.Backend]:
    """Enabled backends by name; ``instances`` are used as given (tests, embedding).

    Every other backend is built with the node's services, and takes what it uses.
    """
    node_services = services.NodeServices(
        node=config.node_name,
        state_dir=config.state_dir,
        hub=hub,
        processes=processes if processes is not None else registration.default_registry(),
    )
    built: dict[str, base.Backend] = dict(instances or {})
    try:
        for name in config.enabled_backends:
            if name not in built:
                built[name] = registry.create(
                    name,
                    settings=config.settings_for(name),
                    node_services=node_services,
                    registry=names if names is not None else registry.BUILTIN,
                )
    except BaseException:
        for backend in built.values():
            if instances is None or backend not in instances.values():
                await backend.close()
        raise
    return built


def _reachable(host: str) -> str:
    """The address clients on this machine use for a server bound to ``host``."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def _bind(grpc_server: grpc.aio.Server, address: str, what: str) -> int:
    try:
        port = int(grpc_server.add_insecure_port(address))
    except RuntimeError as err:
        raise errors.ConfigError(f"cannot listen on {address} ({err}); {what}") from err
    if port == 0 and not address.startswith("unix:"):
        raise errors.ConfigError(f"cannot listen on {address}; {what}")
    return port


def _clear_stale_socket(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise errors.ConfigError(
            f"unix_socket {path} exists and is not a socket; choose another path"
        )
    path.unlink()


async def serve(
    config: agent_config.AgentConfig,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    backends: Mapping[str, base.Backend] | None = None,
    backend_registry: Mapping[str, str] | None = None,
) -> None:
    """Run the agent until ``stop`` is set; ``ready(address)`` once it accepts calls.

    ``backends`` injects ready-made backend instances by name (they are enabled too);
    ``backend_registry`` replaces the name -> "module:Class" mapping.
    """
    stop = stop if stop is not None else asyncio.Event()
    agent_metrics = metrics.AgentMetrics()
    processes = _process_registry(config)
    # Workloads on the Unix socket are bound to their process through the register socket
    # (processes); with authentication on, a TCP registration needs a credential of its job.
    hub = channel.ChannelHub(
        processes=processes, credentials=roles.job_credentials if config.auth else None
    )
    async with contextlib.AsyncExitStack() as stack:
        # Before anything touches the state: a second agent on it is refused.
        stack.enter_context(serving.locked_state_dir(config.state_dir, what="agent"))
        stack.push_async_callback(hub.close)
        if config.kubernetes:
            await _watch_pods(config, hub, processes, stack, stop)
        built = await build_backends(
            config, hub=hub, processes=processes, instances=backends, names=backend_registry
        )
        stack.push_async_callback(_close_backends, built)
        try:
            state = await store.Store.open(
                config.state_dir,
                node=config.node_name,
                retention_s=config.operation_retention_s,
                max_operations=config.max_operations,
            )
        except (OSError, RuntimeError, sqlite3.Error) as err:
            raise errors.ConfigError(
                f"cannot open the agent state in {config.state_dir} ({err}); fix it or choose "
                "another --state-dir"
            ) from err
        stack.push_async_callback(state.close)
        # The highest leader term seen, kept in the same store: see tslice.security.fencing.
        fence = await fencing.TermFence.open(state)

        health_servicer = health.aio.HealthServicer()
        monitor = server.HealthMonitor(
            servicer=health_servicer, backends=built, default_backend=config.default_backend
        )
        core = runner.AgentCore(
            node=config.node_name,
            backends=built,
            default_backend=config.default_backend,
            store=state,
            agent_metrics=agent_metrics,
            operation_timeout_s=config.operation_timeout_s,
            channel_registered=hub.is_registered,
            on_backend_error=monitor.mark_unavailable,
            host_budget=parking.HostBudget(
                budget_bytes=config.host_budget_bytes, reserve_bytes=config.host_reserve_bytes
            ),
        )
        await core.start()
        hub.add_listener(core.on_workload_event)
        await monitor.check_all()

        grpc_server = grpc.aio.server(
            options=serving.SERVER_OPTIONS,
            interceptors=[
                *serving.auth_interceptors(config.auth, roles.AGENT_RULES, "agent"),
                # Inside authentication: a caller is verified before its bytes are parsed.
                undecodable.UndecodableRequests(),
            ],
        )
        servicer = server.SnapshotAgentServicer(core=core, hub=hub, fence=fence)
        traced.install(servicer, core.guarded, node=config.node_name)  # tracing on only
        pb_grpc.add_SnapshotAgentServiceServicer_to_server(servicer, grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        reflection.enable_server_reflection(
            (
                pb.DESCRIPTOR.services_by_name["SnapshotAgentService"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            grpc_server,
        )
        port = serving.bind_grpc(
            grpc_server,
            host=config.host or "0.0.0.0",
            port=config.port,
            what="agent",
            server_tls=config.tls,
            insecure=config.insecure,
        )
        if config.unix_socket is not None:
            config.unix_socket.parent.mkdir(parents=True, exist_ok=True)
            _clear_stale_socket(config.unix_socket)
            _bind(grpc_server, f"unix:{config.unix_socket}", "choose another --unix-socket")
            # Not the umask's: the node's job users (the socket's group) may connect, as to
            # the register socket next to it; others may not.
            os.chmod(config.unix_socket, 0o660)
        await grpc_server.start()
        stack.push_async_callback(
            _stop_server, grpc_server, servicer, core, monitor, config.grace_period_s
        )
        if config.unix_socket is not None:
            stack.callback(_remove_quietly, config.unix_socket)
        register_path = config.register_path
        announcements = registration.RegistrationServer(path=register_path, registry=processes)
        try:
            await announcements.start()
        except OSError as err:
            raise errors.ConfigError(
                f"cannot listen for process registrations on {register_path} ({err}); set "
                "register_socket to a writable path"
            ) from err
        stack.push_async_callback(announcements.close)
        if config.metrics_port:
            agent_metrics.serve(
                port=config.metrics_port,
                host=config.host or "0.0.0.0",
                server_tls=config.tls,
                auth_settings=config.auth,
                insecure=config.insecure,
            )
            stack.callback(agent_metrics.stop)

        loops = [
            tasks.spawn(
                monitor.run(interval_s=config.health_interval_s, stop=stop), name="agent-health"
            ),
            tasks.spawn(_prune_loop(core, stop=stop), name="agent-prune"),
        ]
        stack.push_async_callback(tasks.cancel_all, loops)

        address = serving.host_port(_reachable(config.host), port)
        log.info(
            "agent %s serving on %s (backends: %s, default %s; %s)",
            config.node_name,
            address,
            ", ".join(built),
            config.default_backend,
            serving.transport_name(config.tls),
            extra={"node": config.node_name},
        )
        if ready is not None:
            ready(address)
        await stop.wait()
        log.info("agent %s stopping", config.node_name)


def _process_registry(config: agent_config.AgentConfig) -> registration.ProcessRegistry:
    if not config.kubernetes:
        return registration.ProcessRegistry()
    from tslice.agent.kube import pod_registry  # Kubernetes mode's (no client import)

    return pod_registry.PodCheckedRegistry()


async def _watch_pods(
    config: agent_config.AgentConfig,
    hub: channel.ChannelHub,
    processes: registration.ProcessRegistry,
    stack: contextlib.AsyncExitStack,
    stop: asyncio.Event,
) -> None:
    """Kubernetes mode: follow this node's job pods (listed once before serving) and admit
    a workload on the Unix socket only from a pod of the job it claims."""
    from tslice.agent.kube import pod_registry

    try:  # the kubernetes extra, in this mode only
        from tslice.agent.kube import pods
    except ImportError as err:
        raise errors.ConfigError(
            f"--kubernetes needs the kubernetes extra (cannot import {err.name or err}): "
            "pip install 'tslice[kubernetes]'"
        ) from err

    watcher = pods.PodWatcher(config.node_name, kubeconfig=config.kubeconfig)
    stack.push_async_callback(watcher.close)
    watcher.start()
    synced = asyncio.ensure_future(watcher.synced())
    stopped = asyncio.ensure_future(stop.wait())
    try:  # an API server that does not answer must not keep a SIGTERM waiting
        await asyncio.wait({synced, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        synced.cancel()
        stopped.cancel()
    found = watcher.pods.jobs()
    log.info(
        "Kubernetes: %d job pod(s) of %d job(s) on node %s",
        sum(len(p) for p in found.values()),
        len(found),
        config.node_name,
    )

    def check(pid: int, job: str, group: str) -> str | None:
        return pod_registry.refusal(pid, job, group, watcher.pods, proc_root=config.proc_root)

    # Both ways a process claims a job: its workload channel and its announcement.
    hub.admission.pod_check = check
    if isinstance(processes, pod_registry.PodCheckedRegistry):
        processes.check = check
        processes.pods, processes.proc_root = watcher.pods, config.proc_root


async def _stop_server(
    grpc_server: grpc.aio.Server,
    servicer: server.SnapshotAgentServicer,
    core: runner.AgentCore,
    monitor: server.HealthMonitor,
    grace_s: float,
) -> None:
    await monitor.shutdown()
    servicer.close()  # long-lived GrantStreams must not hold the shutdown
    # New calls are refused at once; in-flight calls and operations share the grace period.
    await asyncio.gather(grpc_server.stop(grace_s), core.close(grace_s=grace_s))


async def _close_backends(built: Mapping[str, base.Backend]) -> None:
    for name, backend in built.items():
        try:
            await backend.close()
        except Exception:
            log.exception("backend %s failed to close", name)


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


async def _prune_loop(core: runner.AgentCore, *, stop: asyncio.Event) -> None:
    interval = min(core.store.retention_s / 10, _PRUNE_INTERVAL_MAX_S)
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)
        if not stop.is_set():
            await core.prune_operations()


def run(config: agent_config.AgentConfig, *, ready_file: Path | None = None) -> None:
    """Blocking entry point: serve until SIGTERM/SIGINT, then stop gracefully."""
    logs.setup(config.log_level, static={"node": config.node_name})
    try:
        tracing.from_env("tslice-agent")
    except tracing.TracingUnavailable as err:
        raise errors.ConfigError(str(err)) from err
    try:
        serving.run_until_signalled(
            lambda ready, stop: serve(config, ready=ready, stop=stop), ready_file=ready_file
        )
    finally:
        tracing.shutdown()
