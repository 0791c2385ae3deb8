"""``tslice orchestrator``: run the cluster-layer orchestrator."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tslice.cli import options, sizes


def _timeout(flag: str, help: str) -> Any:
    return options.in_panel("Timeouts", flag, help)


def _kube(flag: str, help: str, metavar: str) -> Any:
    return typer.Option(flag, help=help, metavar=metavar, rich_help_panel="Kubernetes")


def _ha(flag: str, help: str, metavar: str) -> Any:
    return typer.Option(flag, help=help, metavar=metavar, rich_help_panel="High availability")


def register(app: typer.Typer) -> None:
    """Add the ``orchestrator`` command to ``app``."""
    app.command("orchestrator")(orchestrator)


def orchestrator(
    *,
    config: Annotated[Path | None, options.CONFIG_FILE] = None,
    topology: Annotated[
        Path | None,
        typer.Option(
            "--topology", help="Topology YAML (groups -> nodes -> agent host:port, or mode: local)."
        ),
    ] = None,
    local_agent: Annotated[
        list[str] | None,
        typer.Option(
            "--local-agent",
            metavar="[NAME=]HOST:PORT",
            help="Local mode: an agent every group spans (repeatable); groups are created "
            "on their first Acquire.",
        ),
    ] = None,
    group: Annotated[list[str] | None, options.LOCAL_GROUPS] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            metavar="KIND",
            help="Scheduling policy of every group whose topology names none: fifo "
            "(default), priority, fair-share or cost-aware (their settings: the config "
            "file's `policy:`, which this flag replaces).",
        ),
    ] = None,
    kubernetes: Annotated[
        bool,
        typer.Option(
            "--kubernetes",
            help="Topology from the API server: groups from node labels "
            "group.timeslice.io/<group>=true, agents from the DaemonSet's pods, jobs from "
            "pod labels (needs the kubernetes extra of tslice).",
            rich_help_panel="Kubernetes",
        ),
    ] = False,
    kubeconfig: Annotated[
        Path | None,
        _kube(
            "--kubeconfig",
            "Credentials (default: in-cluster, then $KUBECONFIG, ~/.kube/config).",
            "FILE",
        ),
    ] = None,
    agent_namespace: Annotated[
        str | None,
        _kube("--agent-namespace", "Namespace of the agent pods (default timeslice-system).", "NS"),
    ] = None,
    agent_selector: Annotated[
        str | None,
        _kube(
            "--agent-selector",
            "Label selector of the agent pods (default app.kubernetes.io/name=tslice-agent).",
            "SELECTOR",
        ),
    ] = None,
    job_namespace: Annotated[
        str | None,
        _kube("--job-namespace", "Namespace of RL job pods (default: all namespaces).", "NS"),
    ] = None,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Topology and job liveness from the Slurm controller (scontrol, squeue): "
            "a group per GPU node unless --slurm-group or the config's slurm.groups say "
            "otherwise; drained or down nodes leave their groups; a Slurm job that ends "
            "loses its locks.",
            rich_help_panel="Slurm",
        ),
    ] = False,
    slurm_group: Annotated[
        list[str] | None,
        typer.Option(
            "--slurm-group",
            metavar="NAME=KIND:VALUE",
            help="A group of GPU nodes (repeatable); KIND is partition, feature or nodes "
            "(a host list): trainer=partition:gpu, '*=feature:h100' (a group per node).",
            rich_help_panel="Slurm",
        ),
    ] = None,
    ha: Annotated[
        bool,
        typer.Option(
            "--ha",
            help="Kubernetes mode with several replicas: one leads (a coordination.k8s.io "
            "Lease), its state in ConfigMaps; followers redirect callers to it.",
            rich_help_panel="High availability",
        ),
    ] = False,
    lease_name: Annotated[
        str | None, _ha("--lease-name", "Name of the Lease (default tslice-orchestrator).", "NAME")
    ] = None,
    lease_namespace: Annotated[
        str | None,
        _ha(
            "--lease-namespace",
            "Namespace of the Lease and the state ConfigMaps (default timeslice-system).",
            "NS",
        ),
    ] = None,
    identity: Annotated[
        str | None,
        _ha(
            "--identity",
            "This replica's name in the Lease (default $POD_NAME, else the host name).",
            "NAME",
        ),
    ] = None,
    advertise_address: Annotated[
        str | None,
        _ha(
            "--advertise-address",
            "Where clients reach this replica, named in followers' redirects (default "
            "$POD_IP:<port>, else the address served on).",
            "HOST:PORT",
        ),
    ] = None,
    lease_duration: Annotated[
        int | None,
        _ha(
            "--lease-duration",
            "A leader not renewing for this long is replaced, s (default 15).",
            "S",
        ),
    ] = None,
    renew_interval: Annotated[
        float | None,
        _ha(
            "--renew-interval",
            "How often the leader renews and followers look, s (default 2).",
            "S",
        ),
    ] = None,
    host: Annotated[str | None, options.HOST] = None,
    port: Annotated[int | None, options.port("gRPC", 50051)] = None,
    state_dir: Annotated[
        Path | None, options.state_dir("Where orchestrator.db lives", "orchestrator")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Prometheus port (default 8080; 0 = off).")
    ] = None,
    history: Annotated[
        bool | None,
        typer.Option(
            "--history/--no-history",
            help="Keep the event history beside the state (default on; `tslice events --since`).",
            rich_help_panel="Event history",
        ),
    ] = None,
    history_max_size: Annotated[
        str | None,
        typer.Option(
            "--history-max-size",
            help="The history file's bound, e.g. 1GiB (default), 64MiB; the oldest go first.",
            rich_help_panel="Event history",
        ),
    ] = None,
    history_max_age: Annotated[
        float | None,
        typer.Option(
            "--history-max-age",
            min=0.001,
            help="Events older than this many hours go (default 168: 7 days).",
            rich_help_panel="Event history",
        ),
    ] = None,
    ready_file: Annotated[Path | None, options.READY_FILE] = None,
    log_level: Annotated[str | None, options.LOG_LEVEL] = None,
    tls_cert: Annotated[Path | None, options.TLS_CERT] = None,
    tls_key: Annotated[Path | None, options.TLS_KEY] = None,
    tls_client_ca: Annotated[Path | None, options.TLS_CLIENT_CA] = None,
    insecure: Annotated[bool, options.INSECURE] = False,
    agent_rpc_timeout: Annotated[
        float | None,
        _timeout("--agent-rpc-timeout", "Deadline of agent calls, s (default 10)."),
    ] = None,
    operation_timeout: Annotated[
        float | None,
        _timeout("--operation-timeout", "Max duration of one snapshot/restore, s (default 900)."),
    ] = None,
    reattach_grace: Annotated[
        float | None,
        _timeout(
            "--reattach-grace",
            "After a restart, how long queued jobs have to re-issue Acquire, s (default 30).",
        ),
    ] = None,
    shutdown_grace: Annotated[
        float | None,
        _timeout(
            "--shutdown-grace", "On SIGTERM, time for an in-flight switch to finish, s (default 5)."
        ),
    ] = None,
) -> None:
    """Run the orchestrator (SIGTERM/SIGINT stop it gracefully)."""
    # Imported here so that `tslice --help` does not pay for grpc servers.
    from tslice.orchestrator import app as orch_app
    from tslice.orchestrator import config as orch_config
    from tslice.orchestrator.persistence import store

    overrides: dict[str, Any] = {
        # Relative to the working directory, not to --config's directory.
        "topology_file": topology.resolve() if topology is not None else None,
        "local_agents": local_agent or None,
        "local_groups": group or None,
        "policy": policy,
        "kubernetes": kubernetes or None,
        "kubeconfig": kubeconfig.resolve() if kubeconfig is not None else None,
        "agent_namespace": agent_namespace,
        "agent_selector": agent_selector,
        "job_namespace": job_namespace,
        "slurm": {"enabled": slurm or None, "groups": slurm_group or None},
        "host": host,
        "port": port,
        "state_dir": state_dir,
        "metrics_port": metrics_port,
        "log_level": log_level,
        "agent_rpc_timeout_s": agent_rpc_timeout,
        "operation_timeout_s": operation_timeout,
        "reattach_grace_s": reattach_grace,
        "shutdown_grace_s": shutdown_grace,
        "history": {
            "enabled": history,
            "max_bytes": sizes.parse_bytes_or_none(history_max_size, option="--history-max-size"),
            "max_age_s": history_max_age * 3600 if history_max_age is not None else None,
        },
        **options.tls_overrides(tls_cert, tls_key, tls_client_ca, insecure),
    }
    ha_flags = {
        "--lease-name": lease_name,
        "--lease-namespace": lease_namespace,
        "--identity": identity,
        "--advertise-address": advertise_address,
        "--lease-duration": lease_duration,
        "--renew-interval": renew_interval,
    }
    with options.config_errors_exit_2():
        settings = orch_config.build(config_file=config, overrides=overrides)
        ha_settings = _ha_settings(ha, settings.kubernetes is not None, ha_flags)
    try:
        orch_app.run(settings, ready_file=ready_file, ha=ha_settings)
    except (store.StoreError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


def _ha_settings(ha: bool, kubernetes: bool, flags: dict[str, Any]) -> Any:
    """The HA settings of the flags (None without --ha); ConfigError naming the fix."""
    import os
    import socket

    from tslice.common import errors
    from tslice.orchestrator.kube import leadership

    given = [flag for flag, value in flags.items() if value is not None]
    if not ha:
        if given:
            raise errors.ConfigError(f"{', '.join(given)}: options of --ha; add --ha or drop them")
        return None
    if not kubernetes:
        raise errors.ConfigError(
            "--ha elects a leader through a Kubernetes Lease and keeps the state in the API "
            "server: add --kubernetes"
        )
    defaults = leadership.HaSettings(identity="", address="")
    duration = flags["--lease-duration"] or defaults.lease_duration_s
    renew = flags["--renew-interval"] or defaults.renew_interval_s
    if duration < 1:
        raise errors.ConfigError("--lease-duration is whole seconds, at least 1")
    if not 0 < renew < duration * 2 / 3:
        raise errors.ConfigError(
            f"--renew-interval {renew:g} must be above 0 and well below --lease-duration "
            f"{duration} (under 2/3 of it: the leader gets several tries before it expires)"
        )
    address = flags["--advertise-address"] or ""
    if address and not address.rpartition(":")[2].isdigit():
        raise errors.ConfigError(f"--advertise-address {address!r} is not HOST:PORT")
    return leadership.HaSettings(
        identity=flags["--identity"] or os.environ.get("POD_NAME") or socket.gethostname(),
        address=address,
        lease_name=flags["--lease-name"] or defaults.lease_name,
        namespace=flags["--lease-namespace"] or defaults.namespace,
        lease_duration_s=duration,
        renew_interval_s=renew,
    )
