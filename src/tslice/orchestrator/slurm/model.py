"""Slurm's nodes as Slurm mode sees them, and the groups they make: pure, fed by ``controller``.

A node (one line of ``scontrol show node --oneliner``) counts for its groups while it has
GPUs in its GRES and its state lets jobs run there: IDLE, MIXED, ALLOCATED or
COMPLETING, without DRAIN, FAIL, a power-saving flag or the ``*`` of a node that does not
respond. A drained or draining node leaves its groups as a cordoned Kubernetes node does
(its running jobs go on; the group carries on over the nodes left, or goes if none is
left), and comes back when resumed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from tslice.common import validation
from tslice.orchestrator import config
from tslice.orchestrator.slurm import settings as slurm_settings

#: Base states a job can run in.
_RUNNABLE = frozenset({"IDLE", "MIXED", "ALLOCATED", "COMPLETING"})
#: Flags that take a node out of its groups, with how a log line says it.
_OUT_FLAGS = {
    "DRAIN": "is drained or draining",
    "FAIL": "is failing",
    "POWERED_DOWN": "is powered down",
    "POWERING_DOWN": "is powering down",
    "POWER_DOWN": "is to be powered down",
    "POWERING_UP": "is powering up",
    "REBOOT_ISSUED": "is rebooting",
    "NOT_RESPONDING": "does not respond",
}
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z_]*)=")


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    addr: str = ""
    hostname: str = ""
    #: ``State=`` as Slurm writes it, e.g. ``MIXED+DRAIN`` or ``IDLE*``.
    state: str = "IDLE"
    partitions: frozenset[str] = frozenset()
    features: frozenset[str] = frozenset()
    #: GPUs in its GRES.
    gpus: int = 0
    reason: str = ""

    def why_out(self) -> str | None:
        """Why the node counts for no group (None: it counts)."""
        if self.gpus <= 0:
            return "has no GPU in its GRES (Gres=gpu:N)"
        base, *flags = self.state.split("+")
        why = None
        if base.endswith("*"):
            why = _OUT_FLAGS["NOT_RESPONDING"]
        elif base.rstrip("~#!%$@^-") not in _RUNNABLE:
            why = f"is {base.lower()}"
        for flag in flags:
            why = why or _OUT_FLAGS.get(flag.rstrip("*"))
        if why is not None and self.reason:
            why += f" (Reason={self.reason})"
        return why


def parse_fields(line: str) -> dict[str, str]:
    """``Key=value`` pairs of one ``--oneliner`` line (values may hold spaces)."""
    marks = list(_KEY.finditer(line))
    return {
        m.group(1): line[
            m.end() : marks[i + 1].start() if i + 1 < len(marks) else len(line)
        ].strip()
        for i, m in enumerate(marks)
    }


def gpu_count(gres: str) -> int:
    """GPUs of a GRES string: ``gpu:2,shard:4`` -> 2, ``gpu:a100:4(S:0-1),gpu:v100:2`` -> 6."""
    total = 0
    for entry in re.split(r",(?![^()]*\))", gres):
        name, _, rest = entry.strip().partition(":")
        if name != "gpu":
            continue
        count = rest.split("(")[0].rsplit(":", 1)[-1]
        total += int(count) if count.isdigit() else 0
    return total


def _names(value: str) -> frozenset[str]:
    return frozenset(v for v in value.split(",") if v and v != "(null)")


def parse_nodes(text: str) -> list[Node]:
    """The nodes of ``scontrol show node --oneliner``."""
    nodes = []
    for line in text.splitlines():
        fields = parse_fields(line)
        name = fields.get("NodeName", "")
        if not name:
            continue
        nodes.append(
            Node(
                name=name,
                addr=fields.get("NodeAddr", ""),
                hostname=fields.get("NodeHostName", ""),
                state=fields.get("State", "UNKNOWN"),
                partitions=_names(fields.get("Partitions", "")),
                features=_names(fields.get("AvailableFeatures", "")),
                gpus=gpu_count(fields.get("Gres", "")),
                reason=fields.get("Reason", ""),
            )
        )
    return nodes


def _selected(nodes: Iterable[Node], selector: slurm_settings.Selector) -> list[Node]:
    return [
        n
        for n in nodes
        if selector.matches(name=n.name, partitions=n.partitions, features=n.features)
    ]


def groups(
    nodes: Iterable[Node], settings: slurm_settings.SlurmSettings
) -> dict[str, tuple[config.NodeRef, ...]]:
    """Group -> its member nodes (sorted by name) with their agents; a group with none
    is left out. Each node's devices are its GRES GPUs (indices 0 .. N-1)."""
    usable = [n for n in nodes if n.why_out() is None and _valid_name(n.name)]
    members: dict[str, list[Node]] = {}
    for name, selector in settings.groups.items():
        chosen = _selected(usable, selector)
        if name == slurm_settings.PER_NODE:
            for node in chosen:
                if node.name not in settings.groups:  # a named group wins its name
                    members.setdefault(node.name, []).append(node)
        elif chosen:
            members[name] = chosen
    return {
        gid: tuple(sorted((_ref(n, settings) for n in ns), key=lambda r: r.name))
        for gid, ns in sorted(members.items())
    }


def _ref(node: Node, settings: slurm_settings.SlurmSettings) -> config.NodeRef:
    address = slurm_settings.agent_address(
        settings, node=node.name, node_addr=node.addr, node_hostname=node.hostname
    )
    return config.NodeRef(node.name, address, tuple(range(node.gpus)))


def _valid_name(name: str) -> bool:
    try:
        validation.check_id("node name", name)
    except validation.InvalidIdError:
        return False
    return True


def left_out(nodes: Iterable[Node], settings: slurm_settings.SlurmSettings) -> dict[str, str]:
    """Nodes some group selects that count for none, with why (for the logs)."""
    why: dict[str, str] = {}
    candidates = list(nodes)
    for selector in settings.groups.values():
        for node in _selected(candidates, selector):
            reason = node.why_out()
            if reason is None and not _valid_name(node.name):
                reason = "has a name tslice does not take as a node name"
            if reason is not None:
                why[node.name] = reason
    return dict(sorted(why.items()))


def describe(groups: dict[str, tuple[config.NodeRef, ...]]) -> str:
    """One line for the logs."""
    return "; ".join(
        f"{gid}: " + ", ".join(f"{n.name}@{n.address} ({len(n.devices or ())} GPUs)" for n in ns)
        for gid, ns in groups.items()
    )
