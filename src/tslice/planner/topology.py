"""The recommendation as a topology file (the format ``tslice orchestrator`` reads).

Each block of the recommended grouping gets one group per shared pool its jobs use, on
a node of its own: with one block the groups keep the pools' names (``sampler``), with
several they are numbered (``sampler-1``, ``sampler-2``, ...), nodes ``node-1-sampler``.
The agents' addresses are given in order (one per node); by default 127.0.0.1:9001,
:9002, ... A comment at the top says which jobs use which groups: the topology file
itself has no place for jobs.

:func:`write` puts it in place atomically, and only once it loads as the orchestrator
reads it: an invalid result never replaces an existing file, and a symbolic link at the
destination is refused, never followed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tslice.common import errors
from tslice.orchestrator import config
from tslice.planner import plan as planning
from tslice.planner import recording

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


def write(path: Path, text: str) -> None:
    """``text`` as the topology file at ``path``: written to a temporary file beside it,
    loaded as the orchestrator loads it, then renamed over ``path`` (one step: a reader
    sees the old file or the new one). Nothing is written when it does not load, when
    ``path`` is a symbolic link (its target is left alone) or not a regular file."""
    where = f"--out {path}"
    if path.is_symlink():
        raise errors.ConfigError(
            f"{where} is a symbolic link (to {os.readlink(path)}): give the path of the file "
            "itself; nothing was written"
        )
    if path.exists() and not path.is_file():
        raise errors.ConfigError(f"{where} exists and is not a regular file; nothing was written")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise errors.ConfigError(f"{where}: cannot write the topology ({err})") from None
    temporary = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        # The mode a new file would have (mkstemp's is 0600), or the old file's.
        os.chmod(temporary, _mode_of(path))
        try:
            config.load_topology(temporary)  # what the orchestrator will read: it must load
        except errors.ConfigError as err:
            shown = str(err).replace(str(temporary), str(path))
            raise errors.ConfigError(
                f"the recommended topology does not load, so {path} was left as it was: {shown}"
            ) from None
        os.replace(temporary, path)
    except OSError as err:
        raise errors.ConfigError(f"{where}: cannot write the topology ({err})") from None
    finally:
        temporary.unlink(missing_ok=True)


def _mode_of(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
