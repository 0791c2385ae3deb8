"""``tslice up``: an orchestrator and N simulated agents on this machine, in one command."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from tslice.cli import options, render, sizes
from tslice.common import errors
from tslice.security import tls
from tslice.sim import cluster


def register(app: typer.Typer) -> None:
    app.command("up")(up)


def up(
    *,
    agents: Annotated[int, typer.Option("--agents", min=1, help="Simulated nodes to start.")] = 2,
    group: Annotated[list[str] | None, options.LOCAL_GROUPS] = None,
    host: Annotated[str, options.HOST] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Orchestrator port (0 = any free).")
    ] = 50051,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="State and logs of every process.")
    ] = Path(".tslice/up"),
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Delete the state dir first (forget all jobs).")
    ] = False,
    # The agents' own defaults (None), as `tslice agent`, except the footprint.
    sim_capacity: Annotated[str | None, options.SIM_CAPACITY] = None,
    sim_footprint: Annotated[
        str,
        options.in_panel(
            options.SIM_PANEL,
            "--sim-footprint",
            "Footprint of jobs that declare none. Every group spans every node in "
            "local mode, so it is small enough for one job per group to fit a node.",
        ),
    ] = "20GiB",
    sim_bandwidth: Annotated[str | None, options.SIM_BANDWIDTH] = None,
    sim_restore_bandwidth: Annotated[str | None, options.SIM_RESTORE_BANDWIDTH] = None,
    sim_latency: Annotated[float | None, options.SIM_LATENCY] = None,
    log_level: Annotated[str, options.LOG_LEVEL] = "info",
    insecure: Annotated[bool, options.INSECURE] = False,
) -> None:
    """Run an orchestrator (local mode) and N simulated agents until Ctrl-C."""
    if not (insecure or tls.is_loopback(host)):
        # The servers would refuse too, one after the other; `up` has no TLS flags.
        raise errors.ConfigError(
            f"refusing to serve the local cluster on {host} without TLS (`tslice up` serves "
            "plaintext): anyone who reaches it could drive it; give --insecure on a trusted "
            "network, or keep --host 127.0.0.1 (for TLS, run `tslice orchestrator` and "
            "`tslice agent` with --tls-cert and --tls-key)"
        )
    if fresh:
        shutil.rmtree(state_dir, ignore_errors=True)
    # Checked here, naming the flag, before any process starts.
    node = cluster.SimAgent(
        name="node",
        capacity_bytes=sizes.parse_bytes_or_none(sim_capacity, option="--sim-capacity"),
        footprint_bytes=sizes.parse_bytes(sim_footprint, option="--sim-footprint"),
        bandwidth_bytes_per_s=sizes.parse_rate_or_none(sim_bandwidth, option="--sim-bandwidth"),
        restore_bandwidth_bytes_per_s=sizes.parse_rate_or_none(
            sim_restore_bandwidth, option="--sim-restore-bandwidth"
        ),
        latency_s=sim_latency,
    )
    specs = [dataclasses.replace(node, name=f"node-{i + 1}") for i in range(agents)]
    local = cluster.LocalCluster(
        agents=specs,
        base_dir=state_dir,
        host=host,
        orchestrator_port=port,
        log_level=log_level,
        orchestrator_args=[arg for name in group or () for arg in ("--group", name)],
        insecure=insecure,
    )
    wake = threading.Event()
    stop_requested = threading.Event()

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()
        wake.set()

    def on_child(signum: int, frame: FrameType | None) -> None:
        wake.set()

    previous = {
        sig: signal.signal(sig, handler)
        for sig, handler in (
            (signal.SIGINT, on_stop),
            (signal.SIGTERM, on_stop),
            (signal.SIGCHLD, on_child),
        )
    }
    try:
        local.start()
        rows = [
            (name, local.address(name), local.pid(name), str(local.state_dir(name)))
            for name in [cluster.ORCHESTRATOR, *(s.name for s in specs)]
        ]
        render.stdout().print(
            render.cluster_table(
                rows=rows, orchestrator=local.orchestrator_address, groups=group or ()
            )
        )
        while not stop_requested.is_set():
            wake.wait()
            wake.clear()
            dead = local.exited()
            if dead and not stop_requested.is_set():
                which = ", ".join(f"{n} (exit {c})" for n, c in dead.items())
                raise errors.TsliceError(
                    f"{which} stopped unexpectedly; logs in {state_dir}; stopping the rest"
                )
    finally:
        local.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    render.stdout().print("stopped.")
