"""Orchestrator configuration: YAML file and CLI flags in, frozen dataclasses out.

pydantic validates at the boundary only; the rest of the orchestrator sees
:class:`OrchestratorConfig` and :class:`Topology`. Every error names the path of
the offending field (``groups.trainer.nodes[1].agent``) and the fix.

Topology file::

    groups:
      sampler: {nodes: [{name: node-a, agent: 127.0.0.1:9001}]}
      trainer:
        nodes:
          - {name: node-b, agent: 127.0.0.1:9002}
          - {name: node-c, agent: "10.0.0.3:9001"}

Each group may name its scheduling policy (``tslice.orchestrator.policy``; the
default is the orchestrator's ``policy``, itself ``fifo`` unless set)::

    groups:
      trainer:
        nodes: [{name: node-b, agent: 127.0.0.1:9002}]
        policy: {kind: priority, aging_s: 30, priority: {job-a: 10}}

or, for a laptop (groups created on their first Acquire, spanning every agent; with
``local_groups`` / ``--group NAME`` only the groups named exist)::

    mode: local
    nodes: [{name: node-a, agent: 127.0.0.1:9001}]
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pydantic
import yaml

from tslice.common import errors, validation
from tslice.orchestrator.limits import Limits, LimitsModel
from tslice.orchestrator.persistence.history import HistorySettings
from tslice.orchestrator.policy import models as policy_models
from tslice.orchestrator.policy import spec as policy_spec
from tslice.orchestrator.slurm import settings as slurm_settings
from tslice.security.identities import AuthSettings
from tslice.security.tls import ClientSecurity, ServerTLS, check_listen
from tslice.server import kube_labels, serving

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 8080


def default_state_dir() -> pathlib.Path:
    """Absolute, as for the agent: ``$XDG_STATE_HOME/tslice/orchestrator``, else
    ``/var/lib/tslice/orchestrator`` for root, ``~/.local/state/tslice/orchestrator`` otherwise."""
    return serving.default_state_dir("orchestrator")


_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def check_address(value: str) -> str:
    """``host:port`` (``[v6]:port``) or ``unix:/path``; raise ValueError with the fix."""
    value = value.strip()
    if value.startswith(("unix:", "unix-abstract:")):
        if len(value.split(":", 1)[1]) == 0:
            raise ValueError("unix address needs a path, e.g. unix:/run/tslice/agent.sock")
        return value
    m = _HOST_PORT.fullmatch(value)
    if not m or not 1 <= int(m.group(1)) <= 65535:
        raise ValueError(f"{value!r} is not an agent address; write host:port, e.g. 127.0.0.1:9001")
    return value


# ---- file models (pydantic) ---------------------------------------------------------------


class _Model(pydantic.BaseModel):
    # Numbers are finite (.inf as a timeout or a grace is no bound).
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        # pydantic's lax mode takes `port: true` as 1 and `reattach_grace_s: false` as 0.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(v, bool) and field is not None and field.annotation in (int, float):
            raise ValueError(f"{str(v).lower()} is not a number: write a number")
        return v


class NodeModel(_Model):
    name: str
    agent: str
    #: Device indices of the node that the group uses (None = all of them). Groups
    #: whose devices on a node intersect take turns there (tslice.orchestrator.group.overlap).
    devices: list[pydantic.NonNegativeInt] | None = pydantic.Field(default=None, min_length=1)

    @pydantic.field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return validation.check_id("node name", v)

    @pydantic.field_validator("agent")
    @classmethod
    def _agent(cls, v: str) -> str:
        return check_address(v)


class GroupModel(_Model):
    nodes: list[NodeModel] = pydantic.Field(min_length=1)
    #: The group's scheduling policy (None: the orchestrator's default).
    policy: policy_models.PolicyModel | None = None

    @pydantic.field_validator("nodes")
    @classmethod
    def _unique(cls, v: list[NodeModel]) -> list[NodeModel]:
        seen: set[str] = set()
        for node in v:
            if node.name in seen:
                raise ValueError(
                    f"node name {node.name!r} appears twice; give each node its own name"
                )
            seen.add(node.name)
        return v


class TopologyModel(_Model):
    mode: Literal["static", "local"] = "static"
    groups: dict[str, GroupModel] = {}
    #: Agents of local mode (every group spans all of them).
    nodes: list[NodeModel] = []

    @pydantic.field_validator("groups")
    @classmethod
    def _group_ids(cls, v: dict[str, GroupModel]) -> dict[str, GroupModel]:
        for gid in v:
            validation.check_id("group id", gid)
        return v

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> TopologyModel:
        if self.mode == "static" and not self.groups:
            raise ValueError(
                "no groups defined; add `groups: {NAME: {nodes: [{name: ..., agent: host:port}]}}`"
                " or use `mode: local` with `nodes: [...]`"
            )
        if self.mode == "local":
            if self.groups:
                raise ValueError("`groups` cannot be used with `mode: local`; use `nodes` instead")
            if not self.nodes:
                raise ValueError("`mode: local` needs `nodes: [{name: ..., agent: host:port}]`")
            GroupModel(nodes=self.nodes)  # same uniqueness rule
        agents: dict[str, str] = {}
        for gid, group in self.groups.items():
            for node in group.nodes:
                known = agents.setdefault(node.name, node.agent)
                if known != node.agent:
                    raise ValueError(
                        f"node {node.name!r} has two agent addresses, {known} and "
                        f"{node.agent} (group {gid}); a node has one agent: give it the "
                        "same address in every group, or two names if they are two nodes"
                    )
        return self


class HistoryModel(_Model):
    """``history:`` in the config file (see tslice.orchestrator.persistence.history)."""

    enabled: bool = True
    #: (the defaults of HistorySettings; tests/orchestrator/test_history.py checks so)
    max_age_s: float = pydantic.Field(default=7 * 86400.0, gt=0)
    max_bytes: int = pydantic.Field(default=1 << 30, ge=1 << 20)
    flush_interval_s: float = pydantic.Field(default=1.0, gt=0, le=60)


class OrchestratorModel(_Model):
    host: str = "127.0.0.1"
    port: int = pydantic.Field(DEFAULT_PORT, ge=0, le=65535)
    state_dir: pathlib.Path = pydantic.Field(default_factory=default_state_dir)
    topology_file: pathlib.Path | None = None
    topology: TopologyModel | None = None
    local_agents: list[str] = []
    #: Local mode: the only groups there are (none given: created on first Acquire).
    local_groups: list[str] = []
    #: The scheduling policy of every group whose topology names none.
    policy: policy_models.PolicyModel | None = None
    agent_rpc_timeout_s: float = pydantic.Field(10.0, gt=0)
    operation_timeout_s: float = pydantic.Field(900.0, gt=0)
    wait_chunk_s: float = pydantic.Field(30.0, gt=0)
    status_timeout_s: float = pydantic.Field(2.0, gt=0)
    reattach_grace_s: float = pydantic.Field(30.0, ge=0)
    shutdown_grace_s: float = pydantic.Field(5.0, ge=0)
    backoff_initial_s: float = pydantic.Field(0.05, gt=0)
    backoff_max_s: float = pydantic.Field(5.0, gt=0)
    max_refusals: int = pydantic.Field(5, ge=1)
    max_operation_failures: int = pydantic.Field(10, ge=1)
    max_local_groups: int = pydantic.Field(256, ge=1)
    idle_group_ttl_s: float = pydantic.Field(300.0, ge=0)
    metrics_port: int = pydantic.Field(DEFAULT_METRICS_PORT, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    sqlite_synchronous: Literal["normal", "full"] = "normal"
    #: ``{cert, key, client_ca}``: serve TLS (mutual TLS with client_ca); see security.tls.
    tls: dict[str, Any] | None = None
    #: Serve plaintext on a non-loopback host anyway (a trusted network).
    insecure: bool = False
    #: How the orchestrator calls agents: ``{ca, cert, key, server_name, token_file}``.
    agent_client: dict[str, Any] | None = None
    #: Who may call what (tslice.security.identities, .roles); absent: no authentication.
    auth: dict[str, Any] | None = None
    #: Kubernetes mode: the topology from the API server (see KubeSettings).
    kubernetes: bool = False
    kubeconfig: pathlib.Path | None = None
    agent_namespace: str | None = None
    agent_selector: str | None = None
    job_namespace: str | None = None
    #: Slurm mode: the topology and job liveness from the controller (see SlurmSettings).
    slurm: slurm_settings.SlurmModel | None = None
    #: The event history kept beside the state (tslice events --since).
    history: HistoryModel = HistoryModel()
    #: Caps on waiters and event watchers (see tslice.orchestrator.limits).
    limits: LimitsModel = LimitsModel()

    @pydantic.field_validator("local_groups")
    @classmethod
    def _local_group_ids(cls, v: list[str]) -> list[str]:
        for gid in v:
            validation.check_id("group id", gid)
        return list(dict.fromkeys(v))

    @pydantic.field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v


# ---- internal config (frozen dataclasses) -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeRef:
    name: str
    address: str
    #: Device indices the group uses on the node; ``None`` = all of them.
    devices: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Topology:
    """Static groups, or local mode (groups created on first Acquire over ``local_nodes``)."""

    groups: Mapping[str, tuple[NodeRef, ...]] = dataclasses.field(default_factory=dict)
    local_nodes: tuple[NodeRef, ...] = ()
    #: Local mode: the groups there are, each over every local node (none: on demand).
    local_groups: tuple[str, ...] = ()
    #: Groups whose topology names a scheduling policy (the others use the default).
    policies: Mapping[str, policy_spec.PolicySpec] = dataclasses.field(default_factory=dict)

    @property
    def local(self) -> bool:
        return bool(self.local_nodes)


@dataclasses.dataclass(frozen=True)
class KubeSettings:
    """Kubernetes mode: groups from node labels, agents from the DaemonSet's pods, jobs
    from pod labels (tslice.orchestrator.kube)."""

    #: Credentials file; None: in-cluster, then $KUBECONFIG / ~/.kube/config.
    kubeconfig: pathlib.Path | None = None
    #: Where the agent DaemonSet's pods run, and their label selector.
    agent_namespace: str = kube_labels.NAMESPACE
    agent_selector: str = kube_labels.AGENT_SELECTOR
    #: Where RL job pods are watched; None: all namespaces.
    job_namespace: str | None = None


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    """Validated orchestrator settings (see ``tslice orchestrator --help``)."""

    topology: Topology
    #: Interface to listen on.
    host: str = "127.0.0.1"
    #: gRPC port; 0 picks a free one (reported through the ready file).
    port: int = DEFAULT_PORT
    #: Directory of orchestrator.db (created if missing).
    state_dir: pathlib.Path = dataclasses.field(default_factory=default_state_dir)
    #: Deadline of every unary agent call, seconds.
    agent_rpc_timeout_s: float = 10.0
    #: How long a snapshot/restore may run before it counts as failed, seconds.
    operation_timeout_s: float = 900.0
    #: WaitOperation long-poll chunk, seconds (a dead agent is noticed within this).
    wait_chunk_s: float = 30.0
    #: Deadline of the live Status reads of GetGroupStatus, seconds.
    status_timeout_s: float = 2.0
    #: After a restart, how long queued jobs have to re-issue Acquire, seconds.
    reattach_grace_s: float = 30.0
    #: On SIGTERM, how long an in-flight switch may take to finish, seconds.
    shutdown_grace_s: float = 5.0
    #: Retry backoff for agent failures: first delay and cap, seconds (jittered).
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    #: Refusals in a row (the agent answers, and says no) after which a switch stops
    #: retrying a node and marks it degraded until an operator clears it.
    max_refusals: int = 5
    #: Failed snapshots/restores in a row (the job FAULTED there each time) after which
    #: a switch stops retrying a node and marks it degraded until an operator clears it.
    max_operation_failures: int = 10
    #: Local mode without --group: how many groups may exist at once (an Acquire of a
    #: new group past it is refused with RESOURCE_EXHAUSTED once no idle one can go).
    max_local_groups: int = 256
    #: Local mode without --group: a group with no holder, no waiter and nothing
    #: resident on any node is forgotten after this long idle, seconds (0: at once).
    idle_group_ttl_s: float = 300.0
    #: Prometheus port; 0 = off.
    metrics_port: int = 0
    log_level: str = "info"
    #: SQLite synchronous mode ("normal": crash-safe against SIGKILL; "full": also power loss).
    sqlite_synchronous: str = "normal"
    #: Certificate files served (None: plaintext, loopback only unless ``insecure``).
    tls: ServerTLS | None = None
    #: Plaintext on a non-loopback host is meant (a trusted network).
    insecure: bool = False
    #: TLS and token of the orchestrator's calls to agents.
    agent_client: ClientSecurity = dataclasses.field(default_factory=ClientSecurity)
    #: Authentication and roles; None: every caller may call everything.
    auth: AuthSettings | None = None
    #: Kubernetes mode (the topology is empty at start: groups come from the API server).
    kubernetes: KubeSettings | None = None
    #: Slurm mode (the topology is empty at start: groups come from the controller).
    slurm: slurm_settings.SlurmSettings | None = None
    #: Scheduling policy of the groups whose topology names none (local mode: all).
    policy: policy_spec.PolicySpec = dataclasses.field(default_factory=policy_spec.FifoSpec)
    #: The event history: on/off, its bounds (age, size) and how often it is written.
    history: HistorySettings = dataclasses.field(default_factory=HistorySettings)
    #: Caps on a group's waiters and on event watchers (see tslice.orchestrator.limits).
    limits: Limits = dataclasses.field(default_factory=Limits)

    def policy_for(self, group_id: str) -> policy_spec.PolicySpec:
        """The group's scheduling policy: its own from the topology, else the default."""
        return self.topology.policies.get(group_id, self.policy)


# ---- building ---------------------------------------------------------------------------


def format_validation_error(err: pydantic.ValidationError, *, prefix: str = "") -> str:
    """One line per problem: ``path.to[1].field: message``."""
    lines = []
    for e in err.errors():
        path = prefix
        loc = e["loc"]
        for i, part in enumerate(loc):
            if part in policy_spec.KINDS and i > 0 and loc[i - 1] == "policy":
                continue  # the tag pydantic adds for the policy's kind: no field of the file
            if isinstance(part, int):
                path += f"[{part}]"
            else:
                path += f".{part}" if path else str(part)
        msg = str(e["msg"]).removeprefix("Value error, ")
        lines.append(f"{path or '(top level)'}: {msg}")
    return "; ".join(lines)


def _read_yaml(path: pathlib.Path, what: str) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise errors.ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise errors.ConfigError(f"{what} {path} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise errors.ConfigError(f"{what} {path} must be a YAML mapping at the top level")
    return data


def load_topology(path: pathlib.Path) -> Topology:
    """Read and validate a topology YAML file."""
    data = _read_yaml(path, "topology file")
    try:
        model = TopologyModel.model_validate(data)
    except pydantic.ValidationError as err:
        raise errors.ConfigError(f"{path}: {format_validation_error(err)}") from err
    return _topology(model)


def _topology(model: TopologyModel) -> Topology:
    if model.mode == "local":
        return Topology(local_nodes=tuple(NodeRef(n.name, n.agent) for n in model.nodes))
    return Topology(
        groups={
            gid: tuple(
                NodeRef(n.name, n.agent, tuple(n.devices) if n.devices is not None else None)
                for n in g.nodes
            )
            for gid, g in sorted(model.groups.items())
        },
        policies={
            gid: policy_models.spec_of(g.policy)
            for gid, g in sorted(model.groups.items())
            if g.policy is not None
        },
    )


def parse_local_agent(spec: str) -> NodeRef:
    """``ADDR`` or ``NAME=ADDR``; without a name the address names the node."""
    name, sep, addr = spec.partition("=")
    if not sep:
        name, addr = spec, spec
    try:
        return NodeRef(validation.check_id("node name", name.strip()), check_address(addr))
    except ValueError as err:
        raise errors.ConfigError(f"--local-agent {spec!r}: {err}") from err


def build(
    *,
    config_file: pathlib.Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> OrchestratorConfig:
    """Merge the YAML config file (if any) with explicit overrides and validate once."""
    data: dict[str, Any] = dict(_read_yaml(config_file, "config file")) if config_file else {}
    for key, value in (overrides or {}).items():
        if isinstance(value, Mapping):
            # A section given in part by flags (--tls-cert): the file keeps the rest.
            given = {k: v for k, v in value.items() if v is not None}
            below = data.get(key)
            if given:
                data[key] = {**(below if isinstance(below, Mapping) else {}), **given}
        elif value is not None:
            data[key] = value
    where = f"{config_file}: " if config_file else ""
    try:
        model = OrchestratorModel.model_validate(data)
    except pydantic.ValidationError as err:
        raise errors.ConfigError(where + format_validation_error(err)) from err

    kube = _kube_settings(model, where, config_file)
    slurm = _slurm_settings(model, where)
    local: list[NodeRef] = [parse_local_agent(s) for s in model.local_agents]
    topology: Topology | None = Topology() if kube is not None or slurm is not None else None
    if model.topology is not None:
        topology = _topology(model.topology)
    if model.topology_file is not None:
        if topology is not None:
            raise errors.ConfigError(
                f"{where}both `topology` and `topology_file` are set; keep one of them"
            )
        path = model.topology_file
        if config_file is not None and not path.is_absolute():
            path = config_file.parent / path
        topology = load_topology(path)
    if local:
        if topology is not None and not topology.local:
            raise errors.ConfigError(
                "--local-agent cannot be combined with a static topology (groups: ...); "
                "use one or the other"
            )
        merged = list(topology.local_nodes if topology else ()) + local
        _check_unique(merged)
        topology = Topology(local_nodes=tuple(merged))
    if topology is None:
        raise errors.ConfigError(
            "no topology: pass --topology FILE (groups -> nodes -> agent) "
            "or --local-agent HOST:PORT (repeatable) for local mode"
        )
    if model.local_groups:
        if not topology.local:
            raise errors.ConfigError(
                "--group (local_groups) names the groups of local mode; a static topology "
                "names its own groups: drop --group or add the group to the topology file"
            )
        topology = dataclasses.replace(topology, local_groups=tuple(model.local_groups))
    # Every other setting has the same name in the file model and in the config.
    settings = {f.name: getattr(model, f.name) for f in dataclasses.fields(OrchestratorConfig)}
    settings["policy"] = policy_models.spec_of(model.policy)
    settings["history"] = HistorySettings(**model.history.model_dump())
    settings["limits"] = model.limits.settings()
    return OrchestratorConfig(
        **{
            **settings,
            **_security(model, where),
            "topology": topology,
            "kubernetes": kube,
            "slurm": slurm,
        }
    )


_KUBE_ONLY = {
    "kubeconfig": "--kubeconfig",
    "agent_namespace": "--agent-namespace",
    "agent_selector": "--agent-selector",
    "job_namespace": "--job-namespace",
}
_NOT_WITH_KUBE = {
    "topology_file": "--topology",
    "topology": "topology",
    "local_agents": "--local-agent",
    "local_groups": "--group",
}


def _kube_settings(
    model: OrchestratorModel, where: str, config_file: pathlib.Path | None
) -> KubeSettings | None:
    """Kubernetes mode's settings, or None; a topology given with it (or a Kubernetes
    flag without it) is refused, naming both."""
    if not model.kubernetes:
        given = [flag for key, flag in _KUBE_ONLY.items() if getattr(model, key) is not None]
        if given:
            verb = "is an option" if len(given) == 1 else "are options"
            raise errors.ConfigError(
                f"{where}{', '.join(given)} {verb} of Kubernetes mode: add --kubernetes "
                "(file: `kubernetes: true`) or drop it"
            )
        return None
    clashing = [flag for key, flag in _NOT_WITH_KUBE.items() if getattr(model, key)]
    if clashing:
        raise errors.ConfigError(
            f"{where}--kubernetes takes the topology from the API server (groups from "
            f"node labels, agents from the DaemonSet's pods); {', '.join(clashing)} cannot be "
            "combined with it: drop one or the other"
        )
    for key in ("agent_namespace", "job_namespace"):
        value = getattr(model, key)
        if value is not None and not _DNS_LABEL.fullmatch(value):
            raise errors.ConfigError(
                f"{where}{_KUBE_ONLY[key]} {value!r} is not a namespace name (lower-case "
                "letters, digits and '-', at most 63)"
            )
    if model.agent_selector is not None and not model.agent_selector.strip():
        raise errors.ConfigError(
            f"{where}--agent-selector is empty; give the agent pods' label selector, e.g. "
            f"{kube_labels.AGENT_SELECTOR}"
        )
    kubeconfig = model.kubeconfig
    if kubeconfig is not None and config_file is not None and not kubeconfig.is_absolute():
        kubeconfig = config_file.parent / kubeconfig  # as topology_file
    return KubeSettings(
        kubeconfig=kubeconfig,
        agent_namespace=model.agent_namespace or kube_labels.NAMESPACE,
        agent_selector=model.agent_selector or kube_labels.AGENT_SELECTOR,
        job_namespace=model.job_namespace,
    )


def _slurm_settings(model: OrchestratorModel, where: str) -> slurm_settings.SlurmSettings | None:
    """Slurm mode's settings, or None; a topology (or Kubernetes mode) given with it is
    refused, naming both."""
    if model.slurm is None or not model.slurm.enabled:
        return None
    clashing = [flag for key, flag in _NOT_WITH_KUBE.items() if getattr(model, key)]
    clashing += ["--kubernetes"] if model.kubernetes else []
    if clashing:
        raise errors.ConfigError(
            f"{where}--slurm takes the topology from the Slurm controller (groups of GPU "
            f"nodes, agents on each); {', '.join(clashing)} cannot be combined with it: drop "
            "one or the other"
        )
    return slurm_settings.build(model.slurm)


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _security(model: OrchestratorModel, where: str) -> dict[str, Any]:
    """The TLS sections, parsed (their rules live in tslice.security.tls); plaintext on a
    non-loopback host is refused here, before anything starts."""
    try:
        server_tls = ServerTLS.from_mapping(model.tls, where="tls")
        agent_client = ClientSecurity.from_mapping(model.agent_client, where="agent_client")
        auth = AuthSettings.from_mapping(model.auth, load_yaml=yaml.safe_load)
    except ValueError as err:
        raise errors.ConfigError(f"{where}{err}") from err
    check_listen(model.host, tls=server_tls, insecure=model.insecure, what="orchestrator")
    return {"tls": server_tls, "agent_client": agent_client, "auth": auth}


def _check_unique(nodes: Sequence[NodeRef]) -> None:
    seen: set[str] = set()
    for n in nodes:
        if n.name in seen:
            raise errors.ConfigError(
                f"local agent name {n.name!r} is used twice; name them NAME=HOST:PORT"
            )
        seen.add(n.name)
