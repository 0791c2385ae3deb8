"""The ``tslice`` command: servers, a local cluster, client commands and the demo.

Commands are thin: they parse options, call a library and hand the result to
:mod:`tslice.cli.render`. Every failure a user can cause ends as ONE line on stderr
(``error: ...``) with exit code 1 (runtime) or 2 (usage/configuration), never a
traceback (set ``TSLICE_DEBUG=1`` to see one).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated

import typer
import typer.exceptions

from tslice.cli import (
    admin_cmd,
    certs_cmd,
    client_cmds,
    demo_cmd,
    doctor_cmd,
    events_cmd,
    plan_cmd,
    render,
    slurm_cmd,
    timeline_cmd,
    up_cmd,
    watch_cmd,
)
from tslice.common import errors
from tslice.common import version as package_version

#: Server command modules written by the layer owners; each offers ``register(app)``.
_SERVER_COMMANDS = ("tslice.cli.orchestrator_cmd", "tslice.cli.agent_cmd")

app = typer.Typer(
    name="tslice",
    help="Co-operative time-slicing of GPUs between jobs.",
    invoke_without_command=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        version()
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    *,
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="Print the tslice version and exit.",
        ),
    ] = False,
) -> None:
    if ctx.invoked_subcommand is None:
        render.stdout().print(ctx.get_help())
        raise typer.Exit(0)


@app.command()
def version() -> None:
    """Print the tslice version."""
    render.stdout().print(f"tslice {package_version.VERSION}")


def _register_all() -> None:
    for name in _SERVER_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            # Only a missing command module is tolerated, not a broken import inside it.
            if err.name != name:
                raise
            continue
        module.register(app)
    up_cmd.register(app)
    client_cmds.register(app)
    events_cmd.register(app)
    timeline_cmd.register(app)
    watch_cmd.register(app)
    demo_cmd.register(app)
    plan_cmd.register(app)
    certs_cmd.register(app)
    # ``tslice admin ...``: evict, drain, resume, reset-fault (the admin role).
    admin_cmd.register(app)
    # ``tslice doctor``: is a node ready, can the orchestrator reach its agents.
    doctor_cmd.register(app)
    # ``tslice slurm prolog``: what Slurm's Prolog runs on a node.
    slurm_cmd.register(app)


_register_all()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``tslice`` script and of ``python -m tslice``."""
    command = typer.main.get_command(app)
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        code = command.main(args=args, prog_name="tslice", standalone_mode=False)
    except typer.exceptions.TyperException as err:
        # Usage errors of the (vendored) click parser: bad option, missing argument...
        hint = ""
        ctx = getattr(err, "ctx", None)
        if ctx is not None:
            hint = f" (see `{ctx.command_path} --help`)"
        render.error(f"{err.format_message()}{hint}")
        code = err.exit_code
    except typer.Abort:
        render.error("interrupted")
        code = 130
    except errors.ConfigError as err:
        render.error(str(err))
        code = 2
    except errors.TsliceError as err:
        render.error(str(err))
        code = 1
    except KeyboardInterrupt:
        render.error("interrupted")
        code = 130
    except Exception as err:
        if os.environ.get("TSLICE_DEBUG"):
            raise
        render.error(
            f"unexpected {type(err).__name__}: {err} (set TSLICE_DEBUG=1 for the traceback)"
        )
        code = 1
    sys.exit(code if isinstance(code, int) else 0)
