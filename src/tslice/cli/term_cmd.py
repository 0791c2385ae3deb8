"""``tslice admin reset-term --agent HOST:PORT [--term N]``: set a node agent's leader-term
fence (its ResetLeaderTerm; with authentication on, the admin role).

An agent that served a Kubernetes HA orchestrator refuses directives of older terms and
of none. Reset it to 0 to hand the node to an orchestrator without a term (embedded
mode, llm-d's), or down from a term no election can reach (one sent before terms were
bounded by what a Lease counts). The next leader's first call raises it again. Talks
to the agent directly (``$TSLICE_TLS_*``, ``$TSLICE_TOKEN*`` as for every client).
"""

from __future__ import annotations

from typing import Annotated

import grpc
import typer
from rich.text import Text

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.cli import client_cmds, render
from tslice.common import errors
from tslice.security import tls


def reset_term(
    *,
    agent: Annotated[str, typer.Option("--agent", help="The node agent's address host:port.")],
    term: Annotated[
        int,
        typer.Option(
            "--term",
            min=0,
            help="The term it keeps (default 0: none, directives without a term are taken).",
        ),
    ] = 0,
    timeout: client_cmds.Timeout = 10.0,
    as_json: client_cmds.AsJson = False,
) -> None:
    """Set a node agent's leader-term fence (Kubernetes HA mode's repair)."""
    security = tls.ClientSecurity.from_env()
    request = pb.ResetLeaderTermRequest(term=term)
    try:
        with security.channel(agent) as channel:
            stub = pb_grpc.SnapshotAgentServiceStub(channel)
            reply = stub.ResetLeaderTerm(request, metadata=security.metadata(), timeout=timeout)
    except grpc.RpcError as err:
        raise errors.TsliceError(f"agent {agent}: {err.code().name}: {err.details()}") from err
    before = reply.previous_leader or "no leader named"
    render.show(
        {
            "agent": agent,
            "term": term,
            "previous_term": reply.previous_term,
            "previous_leader": reply.previous_leader,
        },
        Text(f"agent {agent}: leader term {reply.previous_term} ({before}) -> {term}"),
        as_json=as_json,
    )
