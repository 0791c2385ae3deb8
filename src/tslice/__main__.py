"""``python -m tslice`` and the ``tslice`` command.

The command (servers, local cluster, client commands, demo) needs the ``server`` extra.
A job-side install (``pip install tslice``) does not have it: the command then says so
in one line and exits 2, instead of a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util
import sys

#: What the command imports from the ``server`` extra (import names, not distributions).
SERVER_MODULES = (
    "typer",
    "rich",
    "pydantic",
    "prometheus_client",
    "httpx",
    "yaml",
    "grpc_health",
    "grpc_reflection",
)
INSTALL_HINT = "pip install 'tslice[server]'"


def missing_server_modules() -> list[str]:
    """The modules of the ``server`` extra that cannot be imported here."""
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def main() -> None:
    missing = missing_server_modules()
    if missing:
        sys.stderr.write(
            "error: the tslice command needs the server extra, which is not installed "
            f"here (missing: {', '.join(missing)}); install it with: {INSTALL_HINT}\n"
        )
        raise SystemExit(2)
    from tslice.cli import main as cli

    cli.main()


if __name__ == "__main__":
    main()
