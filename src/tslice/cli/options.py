"""Options that several commands take, each defined once: its flag, help and panel.

A command declares ``name: Annotated[type, options.X] = default`` and keeps its own
default: a server's ``None`` lets its config file (and then the config's own default,
named in the help) decide. Typer copies the option for each command that uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import typer

from tslice.common import errors

SIM_PANEL = "Simulated devices (sim backend)"
SECURITY_PANEL = "Security (TLS)"

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


def in_panel(panel: str, flag: str, help: str, **details: Any) -> Any:
    """An option shown in ``panel`` of the help (a group of related flags)."""
    return typer.Option(flag, help=help, rich_help_panel=panel, **details)


def port(what: str, default: int) -> Any:
    """The gRPC port of a server (``default`` is its config's)."""
    return typer.Option("--port", help=f"{what} port (default {default}; 0 = any free port).")


def state_dir(what: str, server: str) -> Any:
    """Where a server keeps its state; the default follows the XDG base directories."""
    return typer.Option(
        "--state-dir",
        help=f"{what} (default $XDG_STATE_HOME/tslice/{server}, else /var/lib/tslice/{server} "
        f"as root, ~/.local/state/tslice/{server} otherwise).",
    )


# TLS of the gRPC port of `tslice orchestrator` and `tslice agent` (file: `tls:`, `insecure:`).
TLS_CERT = in_panel(SECURITY_PANEL, "--tls-cert", "Serve TLS with this certificate (PEM).")
TLS_KEY = in_panel(SECURITY_PANEL, "--tls-key", "Key of --tls-cert (PEM).")
TLS_CLIENT_CA = in_panel(
    SECURITY_PANEL,
    "--tls-client-ca",
    "Require client certificates signed by this CA (mutual TLS).",
)
INSECURE = in_panel(
    SECURITY_PANEL,
    "--insecure",
    "Serve plaintext on a non-loopback --host anyway (a trusted network only).",
)


def tls_overrides(
    cert: object, key: object, client_ca: object, insecure: bool | None
) -> dict[str, object]:
    """The config keys the TLS flags set (None: not given, the file decides)."""
    return {
        "tls": {"cert": cert, "key": key, "client_ca": client_ca},
        "insecure": insecure or None,
    }


# The simulated devices of `tslice agent` and of every agent `tslice up` starts; the
# defaults shown are the agent's (its SimConfig).
SIM_DEVICES = in_panel(SIM_PANEL, "--sim-devices", "Number of devices.")
SIM_CAPACITY = in_panel(
    SIM_PANEL, "--sim-capacity", "Memory per device, e.g. 80GiB.", show_default="80GiB"
)
SIM_BANDWIDTH = in_panel(
    SIM_PANEL,
    "--sim-bandwidth",
    "Copy rate, e.g. 25GB/s (snapshots; restores too unless --sim-restore-bandwidth is given).",
    show_default="25GB/s",
)
SIM_RESTORE_BANDWIDTH = in_panel(
    SIM_PANEL,
    "--sim-restore-bandwidth",
    "Copy rate of restores, e.g. 75GB/s.",
    show_default="--sim-bandwidth",
)
SIM_LATENCY = in_panel(
    SIM_PANEL, "--sim-latency", "Fixed cost per copy, s.", min=0.0, show_default="0.005"
)
SIM_FAIL_PROB = in_panel(SIM_PANEL, "--sim-fail-prob", "Failure probability per copy.")
SIM_HANG_PROB = in_panel(SIM_PANEL, "--sim-hang-prob", "Hang probability per copy.")
SIM_EXTRA_LATENCY = in_panel(SIM_PANEL, "--sim-extra-latency", "Added to every copy, s.")
SIM_SEED = in_panel(SIM_PANEL, "--sim-seed", "Seed of the fault dice.")


@contextlib.contextmanager
def config_errors_exit_2() -> Iterator[None]:
    """A bad configuration is one line on stderr and exit code 2, also where a server
    command runs on an app of its own (not through ``tslice.cli.main``)."""
    try:
        yield
    except errors.ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
