"""``tslice certs``: a development CA, a server certificate and client certificates.

The certificates themselves (what tslice reads from them, the keys, the CA kept in the
directory) are ``tslice.security.certs``'s; this command parses its options, makes them
and says where they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tslice.cli import render
from tslice.security import certs as pki  # `certs` is the command below


def register(app: typer.Typer) -> None:
    app.command("certs")(certs)


def certs(
    *,
    out: Annotated[
        Path, typer.Option("--out", help="Directory of the CA and the certificates.")
    ] = Path("tslice-certs"),
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            metavar="NAME",
            help="A host name or address the servers are reached at (repeatable); "
            "localhost, 127.0.0.1 and ::1 are always in.",
        ),
    ] = None,
    client: Annotated[
        list[str] | None,
        typer.Option(
            "--client",
            metavar="IDENTITY",
            help="A client certificate for IDENTITY (repeatable): orchestrator, admin, "
            "job:<job-id>... Default: orchestrator and admin.",
        ),
    ] = None,
    days: Annotated[int, typer.Option("--days", min=1, help="Validity, days.")] = 365,
    force: Annotated[
        bool, typer.Option("--force", help="Replace certificates already there (not the CA).")
    ] = False,
) -> None:
    """Make a development CA, a server certificate and client certificates."""
    identities = [pki.check_identity(c) for c in (client or pki.DEFAULT_CLIENTS)]
    ca = pki.make_ca(out, days=max(days, 365))
    made: list[tuple[str, Path]] = [("CA", ca.cert)]
    server = pki.Pair(out / "server.pem", out / "server.key")
    if force or not server.cert.exists():
        pki.make_server(ca, server, hosts=host or (), days=days)
        made.append(("server", server.cert))
    for identity in identities:
        stem = pki.file_stem(identity)
        pair = pki.Pair(out / f"{stem}.pem", out / f"{stem}.key")
        if force or not pair.cert.exists():
            pki.make_client(ca, pair, identity=identity, days=days)
            made.append((identity, pair.cert))
    console = render.stdout()
    for what, path in made:
        console.print(f"{what}: {path}")
    console.print(
        f"serve with --tls-cert {server.cert} --tls-key {server.key} --tls-client-ca {ca.cert}; "
        f"clients: TSLICE_TLS_CA={ca.cert} TSLICE_TLS_CERT=<identity>.pem "
        "TSLICE_TLS_KEY=<identity>.key"
    )
