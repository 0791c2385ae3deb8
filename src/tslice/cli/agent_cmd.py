"""``tslice agent``: run the snapshot agent of this node."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tslice.cli import options


def register(app: typer.Typer) -> None:
    """Add the ``agent`` command to ``app``."""
    app.command("agent")(agent)


def agent(
    *,
    config: Annotated[Path | None, options.CONFIG_FILE] = None,
    node_name: Annotated[
        str | None, typer.Option("--node-name", help="This node's name (default: hostname).")
    ] = None,
    host: Annotated[str | None, options.HOST] = None,
    port: Annotated[int | None, options.port("gRPC", 9001)] = None,
    state_dir: Annotated[
        Path | None, options.state_dir("Where jobs, operations and sim devices persist", "agent")
    ] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend",
            metavar="NAME",
            help="Default backend (noop, sim, cuda, app-endpoint, app-channel); repeat to "
            "enable more, the first is the default.",
        ),
    ] = None,
    unix_socket: Annotated[
        Path | None,
        typer.Option("--unix-socket", help="Also listen on this Unix socket (node-local)."),
    ] = None,
    register_socket: Annotated[
        Path | None,
        typer.Option(
            "--register-socket",
            help="Unix socket where GPU processes announce themselves "
            "(default: register.sock next to --unix-socket, else <state-dir>/register.sock).",
        ),
    ] = None,
    kubernetes: Annotated[
        bool,
        typer.Option(
            "--kubernetes",
            help="Kubernetes mode: watch the job pods of this node (--node-name) and admit a "
            "workload on the Unix socket only from a pod of the job it claims.",
        ),
    ] = False,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            "--kubeconfig",
            help="Kubernetes credentials (default: in-cluster, then $KUBECONFIG, ~/.kube/config).",
        ),
    ] = None,
    operation_timeout: Annotated[
        float | None,
        typer.Option("--operation-timeout", help="Deadline of one operation, s (default 600)."),
    ] = None,
    sim_devices: Annotated[int | None, options.SIM_DEVICES] = None,
    sim_capacity: Annotated[str | None, options.SIM_CAPACITY] = None,
    sim_bandwidth: Annotated[str | None, options.SIM_BANDWIDTH] = None,
    sim_restore_bandwidth: Annotated[str | None, options.SIM_RESTORE_BANDWIDTH] = None,
    sim_latency: Annotated[float | None, options.SIM_LATENCY] = None,
    sim_footprint: Annotated[
        str | None,
        options.in_panel(
            options.SIM_PANEL,
            "--sim-footprint",
            "Footprint of jobs that declare none (default 60% of capacity).",
        ),
    ] = None,
    sim_fail_prob: Annotated[float | None, options.SIM_FAIL_PROB] = None,
    sim_hang_prob: Annotated[float | None, options.SIM_HANG_PROB] = None,
    sim_extra_latency: Annotated[float | None, options.SIM_EXTRA_LATENCY] = None,
    sim_seed: Annotated[int | None, options.SIM_SEED] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Prometheus port (0 = off, default).")
    ] = None,
    ready_file: Annotated[Path | None, options.READY_FILE] = None,
    log_level: Annotated[str | None, options.LOG_LEVEL] = None,
    tls_cert: Annotated[Path | None, options.TLS_CERT] = None,
    tls_key: Annotated[Path | None, options.TLS_KEY] = None,
    tls_client_ca: Annotated[Path | None, options.TLS_CLIENT_CA] = None,
    insecure: Annotated[bool, options.INSECURE] = False,
) -> None:
    """Run the snapshot agent of this node (SIGTERM/SIGINT stop it gracefully)."""
    # Imported here so that `tslice --help` does not pay for grpc servers and backends.
    from tslice.agent import app as agent_app
    from tslice.agent import config as agent_config

    overrides: dict[str, Any] = {
        "node_name": node_name,
        "host": host,
        "port": port,
        "state_dir": state_dir,
        "unix_socket": unix_socket,
        "register_socket": register_socket,
        "kubernetes": kubernetes or None,
        "kubeconfig": kubeconfig,
        "operation_timeout_s": operation_timeout,
        "metrics_port": metrics_port,
        "log_level": log_level,
        **options.tls_overrides(tls_cert, tls_key, tls_client_ca, insecure),
        "sim": {
            "devices": sim_devices,
            "capacity": sim_capacity,
            "bandwidth": sim_bandwidth,
            "restore_bandwidth": sim_restore_bandwidth,
            "latency_s": sim_latency,
            "default_footprint": sim_footprint,
            "fail_probability": sim_fail_prob,
            "hang_probability": sim_hang_prob,
            "extra_latency_s": sim_extra_latency,
            "seed": sim_seed,
        },
    }
    if backend:
        overrides["default_backend"] = backend[0]
        if len(backend) > 1:
            overrides["backends"] = list(backend[1:])
    with options.config_errors_exit_2():
        settings = agent_config.load(path=config, overrides=overrides)
        agent_app.run(settings, ready_file=ready_file)
