"""``tslice doctor``: is this node ready for an agent, and can the orchestrator reach its agents?

On a node (the default): the NVIDIA driver, the CUDA checkpoint API or ``cuda-checkpoint``,
NVML, the register socket and host memory (``tslice.agent.doctor``). With
``--orchestrator-config``: every agent of the topology (static, local, or the Slurm
controller's nodes) asked as the orchestrator asks it, TLS included
(``tslice.orchestrator.switch.check``). Each line says what was found and what to fix; the
exit code is 1 when something blocks, 0 otherwise.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from tslice.cli import render

if TYPE_CHECKING:
    from tslice.orchestrator.config import OrchestratorConfig

_STYLE = {"ok": "green", "info": "dim", "warn": "yellow", "FAIL": "bold red"}


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)


def doctor(
    *,
    agent_config: Annotated[
        Path | None,
        typer.Option(
            "--agent-config",
            help="The agent's YAML config (its backends and sockets); default "
            "/etc/tslice/agent.yaml when it exists.",
            metavar="FILE",
        ),
    ] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend",
            help="The agent's backends when no config says (default: cuda, so the GPU "
            "checks block).",
            metavar="NAME",
        ),
    ] = None,
    orchestrator_config: Annotated[
        Path | None,
        typer.Option(
            "--orchestrator-config",
            help="Check every agent of this orchestrator config's topology instead of this "
            "node (reachability, TLS).",
            metavar="FILE",
        ),
    ] = None,
    topology: Annotated[
        Path | None,
        typer.Option("--topology", help="The topology, if the config names none.", metavar="FILE"),
    ] = None,
) -> None:
    """Check a node, or every agent of an orchestrator's config; exit 1 if something blocks."""
    rows: list[tuple[str, str, str]] = []
    if orchestrator_config is not None:
        from tslice.orchestrator import config

        overrides = {"topology_file": topology.resolve()} if topology is not None else {}
        rows += asyncio.run(
            _agents(config.build(config_file=orchestrator_config, overrides=overrides))
        )
    else:
        rows += _node(agent_config, backend)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("check", "result", "detail / what to do"):
        table.add_column(column)
    for name, level, detail in rows:
        table.add_row(Text(name), Text(level, style=_STYLE.get(level, "")), Text(detail))
    render.stdout().print(table)
    blocking = sum(level == "FAIL" for _, level, _ in rows)
    if blocking:
        render.error(f"{blocking} problem(s) block: fix them and run tslice doctor again")
        raise typer.Exit(1)


def _node(agent_config: Path | None, backends: list[str] | None) -> list[tuple[str, str, str]]:
    from tslice.agent import config as agent_cfg
    from tslice.agent import doctor as checks

    default = Path("/etc/tslice/agent.yaml")
    path = agent_config if agent_config is not None else (default if default.exists() else None)
    # The node name is not checked here; a placeholder keeps the loader from asking.
    loaded = agent_cfg.load(path=path, overrides={"node_name": "doctor"})
    enabled = (
        list(backends)
        if backends
        else [loaded.default_backend, *loaded.backends]
        if path is not None
        else ["cuda"]
    )
    found = checks.node_checks(backends=enabled, register_path=loaded.register_path)
    return [
        ("agent config", "info", f"{path or 'none'}; backends {', '.join(enabled)}"),
        *((c.name, c.level.value, c.detail) for c in found),
    ]


async def _agents(cfg: OrchestratorConfig) -> list[tuple[str, str, str]]:
    from tslice.orchestrator.switch import check as agent_check
    from tslice.orchestrator.switch import pool as agents

    rows: list[tuple[str, str, str]] = []
    if cfg.kubernetes is not None:
        return [
            (
                "Kubernetes mode",
                "info",
                "the agents are the DaemonSet's pods: kubectl -n timeslice-system get pods",
            )
        ]
    nodes = [*cfg.topology.local_nodes, *(n for ns in cfg.topology.groups.values() for n in ns)]
    if cfg.slurm is not None:
        from tslice.orchestrator.slurm import controller, model

        try:
            found = model.groups(await controller.read_nodes(cfg.slurm), cfg.slurm)
        except controller.ControllerError as err:
            return [("Slurm controller", "FAIL", str(err))]
        nodes = [n for ns in found.values() for n in ns]
        rows.append(("Slurm controller", "ok", f"{len(found)} group(s)"))
    if not nodes:
        return [*rows, ("agents", "warn", "the topology names no agent")]
    pool = agents.AgentPool(
        rpc_timeout_s=cfg.agent_rpc_timeout_s,
        operation_timeout_s=cfg.operation_timeout_s,
        wait_chunk_s=cfg.wait_chunk_s,
        security=cfg.agent_client,
    )
    try:
        findings = await agent_check.check(nodes, pool, cfg.agent_client)
    finally:
        await pool.close()
    for f in findings:
        rows.append(
            (f"agent {f.node} ({f.address})", "ok" if f.ok else "FAIL", f.problem or "answers")
        )
    return rows
