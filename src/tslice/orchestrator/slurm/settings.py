"""Slurm mode's settings: the ``slurm:`` section of the orchestrator's config, and its flags.

::

    slurm:
      groups:                       # default: {"*": {}}, a group per GPU node, named after it
        trainer: {partition: gpu}   # the GPU nodes of a partition,
        fast: {feature: h100}       # of a node feature (both given: nodes with both),
        pair: {nodes: "gpu-[01-02]"}  # or of a host list
        "*": {partition: shared}    # "*": one group per node of the selection
      agent_address: "{node_addr}:9001"  # {node}, {node_addr}, {node_hostname}
      agents: {gpu-07: "10.0.0.7:9101"}  # a node whose agent is elsewhere
      poll_s: 2                     # how often the controller is read

``--slurm-group NAME=KIND:VALUE`` (KIND: partition, feature, nodes) gives a group on the
command line (``*=partition:gpu``: a group per node of the partition).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from tslice.common import validation

#: The group name that stands for "one group per node, named after the node".
PER_NODE = "*"
DEFAULT_AGENT_ADDRESS = "{node_addr}:9001"
DEFAULT_POLL_S = 2.0
_FIELDS = ("node", "node_addr", "node_hostname")
_KINDS = ("partition", "feature", "nodes")


def expand_hostlist(expression: str) -> list[str]:
    """Slurm's host list syntax: ``gpu-[01-03,07],login1`` -> gpu-01, gpu-02, gpu-03,
    gpu-07, login1 (zero padding kept; several brackets multiply). ValueError if malformed."""
    names: list[str] = []
    for part in _split_top(expression.strip()):
        pieces = re.findall(r"([^\[\]]*)(?:\[([^\[\]]+)\])?", part)
        if "".join(lit + (f"[{br}]" if br else "") for lit, br in pieces) != part:
            raise ValueError(f"{expression!r} is not a host list; write e.g. gpu-[01-04,07]")
        expanded = [""]
        for literal, bracket in pieces:
            choices = _ranges(bracket, expression) if bracket else [""]
            expanded = [e + literal + c for e in expanded for c in choices]
        names.extend(n for n in expanded if n)
    if not names or any(c in n for n in names for c in "[]"):
        raise ValueError(f"{expression!r} is not a host list; write e.g. gpu-[01-04,07],gpu-10")
    return names


def _split_top(expression: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in expression:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p for p in [*parts, current] if p]


def _ranges(bracket: str, expression: str) -> list[str]:
    out: list[str] = []
    for item in bracket.split(","):
        first, sep, last = item.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{expression!r}: [{bracket}] is not a list of numbers and ranges")
        if not sep:
            out.append(first)
            continue
        if int(last) < int(first):
            raise ValueError(f"{expression!r}: the range {item} runs backwards")
        out.extend(str(i).zfill(len(first)) for i in range(int(first), int(last) + 1))
    return out


@dataclasses.dataclass(frozen=True)
class Selector:
    """Which nodes a group has: all GPU nodes, narrowed by each criterion given."""

    partition: str | None = None
    feature: str | None = None
    #: The host list as written, and expanded.
    hostlist: str | None = None
    nodes: frozenset[str] | None = None

    def describe(self) -> str:
        given = [f"{k} {v}" for k, v in self._criteria() if v is not None]
        return ", ".join(given) or "every GPU node"

    def _criteria(self) -> list[tuple[str, str | None]]:
        return [("partition", self.partition), ("feature", self.feature), ("nodes", self.hostlist)]

    def matches(self, *, name: str, partitions: frozenset[str], features: frozenset[str]) -> bool:
        return (
            (self.partition is None or self.partition in partitions)
            and (self.feature is None or self.feature in features)
            and (self.nodes is None or name in self.nodes)
        )


@dataclasses.dataclass(frozen=True)
class SlurmSettings:
    """Slurm mode (see the module's docstring)."""

    #: Group name (or :data:`PER_NODE`) -> the nodes it has.
    groups: Mapping[str, Selector] = dataclasses.field(
        default_factory=lambda: {PER_NODE: Selector()}
    )
    #: Where a node's agent listens: a template of {node}, {node_addr}, {node_hostname}.
    agent_address: str = DEFAULT_AGENT_ADDRESS
    #: Node -> its agent's address, where the template does not fit.
    agents: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: How often the controller is read (nodes, jobs), seconds.
    poll_s: float = DEFAULT_POLL_S
    #: The Slurm commands (absolute paths, or found on $PATH).
    scontrol: str = "scontrol"
    squeue: str = "squeue"


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class GroupModel(_Model):
    partition: str | None = None
    feature: str | None = None
    nodes: str | None = None

    @pydantic.field_validator("nodes")
    @classmethod
    def _hostlist(cls, v: str | None) -> str | None:
        if v is not None:
            for name in expand_hostlist(v):
                validation.check_id("node name", name)
        return v


class SlurmModel(_Model):
    """The file's ``slurm:`` section (``slurm: true``: on, with the defaults)."""

    enabled: bool = True
    #: ``{NAME: {partition, feature, nodes}}``, or the flags' ``NAME=KIND:VALUE`` strings.
    groups: dict[str, GroupModel] | list[str] = {}
    agent_address: str = DEFAULT_AGENT_ADDRESS
    agents: dict[str, str] = {}
    poll_s: float = pydantic.Field(DEFAULT_POLL_S, gt=0, le=60)
    scontrol: str = "scontrol"
    squeue: str = "squeue"

    @pydantic.model_validator(mode="before")
    @classmethod
    def _switch(cls, data: Any) -> Any:
        if isinstance(data, bool):
            return {"enabled": data}
        return {} if data is None else data

    @pydantic.field_validator("groups", mode="after")
    @classmethod
    def _groups(cls, v: dict[str, GroupModel] | list[str]) -> dict[str, GroupModel]:
        parsed = parse_group_flags(v) if isinstance(v, list) else v
        for name, group in parsed.items():
            if name != PER_NODE:
                validation.check_id("group id", name)
                if group == GroupModel():
                    raise ValueError(
                        f"group {name!r} selects nothing; give it partition, feature or nodes "
                        f"(or name it {PER_NODE!r} for a group per GPU node)"
                    )
        return parsed

    @pydantic.field_validator("agent_address")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            filled = v.format(**{f: "x" for f in _FIELDS})
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"{v!r} is not an address template: use {{node}}, {{node_addr}} or "
                f"{{node_hostname}} and a port, e.g. {DEFAULT_AGENT_ADDRESS} ({err})"
            ) from None
        if not re.fullmatch(r".+:\d{1,5}", filled):
            raise ValueError(f"{v!r} has no port; write e.g. {DEFAULT_AGENT_ADDRESS}")
        return v

    @pydantic.field_validator("agents")
    @classmethod
    def _agents(cls, v: dict[str, str]) -> dict[str, str]:
        for node in v:
            validation.check_id("node name", node)
        return v


def parse_group_flags(flags: Sequence[str]) -> dict[str, GroupModel]:
    """``NAME=KIND:VALUE`` strings (``--slurm-group``) -> their models; ValueError with the fix."""
    groups: dict[str, GroupModel] = {}
    for flag in flags:
        name, _, selector = flag.partition("=")
        kind, colon, value = selector.partition(":")
        if not name.strip() or not colon or kind.strip() not in _KINDS or not value.strip():
            raise ValueError(
                f"--slurm-group {flag!r}: write NAME=KIND:VALUE with KIND one of "
                f"{', '.join(_KINDS)}, e.g. trainer=partition:gpu or '*=feature:h100'"
            )
        given = groups.get(name.strip(), GroupModel()).model_dump()
        groups[name.strip()] = GroupModel(**{**given, kind.strip(): value.strip()})
    return groups


def build(model: SlurmModel) -> SlurmSettings:
    groups = model.groups if isinstance(model.groups, dict) else parse_group_flags(model.groups)
    return SlurmSettings(
        groups={
            name: Selector(
                partition=g.partition,
                feature=g.feature,
                hostlist=g.nodes,
                nodes=frozenset(expand_hostlist(g.nodes)) if g.nodes is not None else None,
            )
            for name, g in sorted(groups.items())
        }
        or {PER_NODE: Selector()},
        agent_address=model.agent_address,
        agents=dict(model.agents),
        poll_s=model.poll_s,
        scontrol=model.scontrol,
        squeue=model.squeue,
    )


def agent_address(settings: SlurmSettings, *, node: str, node_addr: str, node_hostname: str) -> str:
    """Where ``node``'s agent listens."""
    given = settings.agents.get(node)
    if given is not None:
        return given
    fields = {"node": node, "node_addr": node_addr or node, "node_hostname": node_hostname or node}
    return settings.agent_address.format(**fields)
