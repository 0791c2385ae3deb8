"""Options that several commands take, each defined once: its flag, help and panel.

A command declares ``name: Annotated[type, options.X] = default`` and keeps its own
default: a server's ``None`` lets its config file (and then the config's own default,
named in the help) decide. Typer copies the option for each command that uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer

from tslice.common import errors

SIM_PANEL = "Simulated devices (sim backend)"

CONFIG_FILE = typer.Option("--config", help="YAML config file; flags override it.")
HOST = typer.Option(
    "--host",
    help="Address to bind (0.0.0.0 to serve other machines).",
    show_default="127.0.0.1",
)
READY_FILE = typer.Option("--ready-file", help='Write {"address", "pid"} here once serving.')
LOG_LEVEL = typer.Option("--log-level", help="debug, info, warning or error.", show_default="info")
LOCAL_GROUPS = typer.Option(
    "--group",
    metavar="NAME",
    help="Local mode: the groups there are (repeatable); an Acquire of any other group is "
    "NOT_FOUND. Without it, a group is created by its first Acquire.",
)

# The simulated devices of `tslice agent` and of every agent `tslice up` starts; the
# defaults shown are the agent's (its SimConfig).
SIM_CAPACITY = typer.Option(
    "--sim-capacity",
    help="Memory per device, e.g. 80GiB.",
    show_default="80GiB",
    rich_help_panel=SIM_PANEL,
)
SIM_BANDWIDTH = typer.Option(
    "--sim-bandwidth",
    help="Copy rate, e.g. 25GB/s (snapshots; restores too unless --sim-restore-bandwidth "
    "is given).",
    show_default="25GB/s",
    rich_help_panel=SIM_PANEL,
)
SIM_RESTORE_BANDWIDTH = typer.Option(
    "--sim-restore-bandwidth",
    help="Copy rate of restores, e.g. 75GB/s.",
    show_default="--sim-bandwidth",
    rich_help_panel=SIM_PANEL,
)
SIM_LATENCY = typer.Option(
    "--sim-latency",
    min=0.0,
    help="Fixed cost per copy, s.",
    show_default="0.005",
    rich_help_panel=SIM_PANEL,
)


@contextlib.contextmanager
def config_errors_exit_2() -> Iterator[None]:
    """A bad configuration is one line on stderr and exit code 2, also where a server
    command runs on an app of its own (not through ``tslice.cli.main``)."""
    try:
        yield
    except errors.ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
