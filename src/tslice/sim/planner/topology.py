"""The recommendation as a topology file (the format ``tslice orchestrator`` reads).

Each block of the recommended grouping gets one group per shared pool its jobs use, on
a node of its own: with one block the groups keep the pools' names (``sampler``), with
several they are numbered (``sampler-1``, ``sampler-2``, ...), nodes ``node-1-sampler``.
The agents' addresses are given in order (one per node); by default 127.0.0.1:9001,
:9002, ... A comment at the top says which jobs use which groups: the topology file
itself has no place for jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from tslice.sim.planner import plan as planning
from tslice.sim.planner import recording

DEFAULT_FIRST_PORT = 9001


def nodes_needed(plan: planning.Plan) -> int:
    return sum(len(b.pools) for b in plan.recommended.blocks)


def default_agents(count: int) -> list[str]:
    return [f"127.0.0.1:{DEFAULT_FIRST_PORT + i}" for i in range(count)]


def group_id(pool: str, index: int, blocks: int) -> str:
    return pool if blocks == 1 else f"{pool}-{index}"


def document(plan: planning.Plan, agents: Sequence[str] | None = None) -> dict[str, Any]:
    """The topology as plain data (``groups: {id: {nodes: [{name, agent}]}}``)."""
    needed = nodes_needed(plan)
    addresses = list(agents) if agents else default_agents(needed)
    if len(addresses) < needed:
        raise recording.PlanInputError(
            f"the recommended topology has {needed} node(s) (one per pool of each set of "
            f"pools) but --agent gives {len(addresses)} address(es): give one --agent per node"
        )
    blocks = plan.recommended.blocks
    groups: dict[str, Any] = {}
    feed = iter(addresses)
    for index, block in enumerate(blocks, 1):
        for pool in block.pools:
            node = pool if len(blocks) == 1 else f"{index}-{pool}"
            groups[group_id(pool, index, len(blocks))] = {
                "nodes": [{"name": f"node-{node}", "agent": next(feed)}]
            }
    return {"groups": groups}


def text(plan: planning.Plan, agents: Sequence[str] | None = None) -> str:
    """The topology file: who uses which groups (comments), then the YAML."""
    doc = document(plan, agents)
    blocks = plan.recommended.blocks
    lines = [
        f"# tslice plan of {plan.recording.path} ({plan.recording.kind}): "
        f"predicted throughput gain {plan.recommended.gain:.2f}x over dedicated pools",
    ]
    for index, block in enumerate(blocks, 1):
        groups = ", ".join(group_id(p, index, len(blocks)) for p in block.pools)
        lines.append(f"# job(s) {', '.join(block.jobs)}: groups {groups}")
    return "\n".join(lines) + "\n" + yaml.safe_dump(doc, sort_keys=False)
