"""deploy/kubernetes, checked offline.

Every overlay renders (``kubectl kustomize``) and every rendered object validates against
the Kubernetes JSON schemas (``kubernetes-validate``, strict: unknown fields are errors) of
Kubernetes 1.34, the first release with ``resource.k8s.io/v1`` (DRA) generally available,
and of the newest release the package knows (nothing used has been removed since).
The labels, taint, namespace and ports are the strings of ``tslice.server.kube_labels``;
every ``tslice ...`` container command line parses with the real command line; the
TLS overlay's config files load with the real loaders; the image:
test_dockerfile.py; the example job's script: test_example_script.py.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import typer.main
import yaml
from kubernetes_validate import utils as k8s_schemas

from tests import debian_tools
from tests.deploy import image
from tslice.agent import config as agent_config
from tslice.cli import main
from tslice.orchestrator import config as orch_config
from tslice.server import kube_labels as kl

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
SERVER_OVERLAYS = ("single", "tls", "ha")
OVERLAYS = (*SERVER_OVERLAYS, "rl-job-example")
#: The oldest Kubernetes the manifests are for (resource.k8s.io/v1) and the newest known.
KUBERNETES_VERSIONS = ("1.34", k8s_schemas.major_minor(k8s_schemas.latest_version()))
#: Flags of `tslice orchestrator --kubernetes` (.scratch/kube-contract.md).
KUBE_FLAGS = {
    "--kubernetes",
    "--kubeconfig",
    "--agent-namespace",
    "--agent-selector",
    "--job-namespace",
}
#: The kubelet expands $(VAR) in args from the container's env; a stand-in value.
_ENV_REF = re.compile(r"\$\(([A-Z_]+)\)")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
WORKLOADS = {"Deployment", "DaemonSet", "Pod"}
ORCHESTRATOR = "tslice-orchestrator"
AGENT = "tslice-agent"


Obj = dict[str, Any]


@functools.cache
def render(overlay: str) -> tuple[Obj, ...]:
    done = subprocess.run(
        [
            debian_tools.binary("kubectl", "kubectl"),
            "kustomize",
            str(KUSTOMIZE / "overlays" / overlay),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed: {done.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(done.stdout) if obj)


def name_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def one(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_template(obj: Obj) -> Obj:
    """A workload's pod (``metadata`` and ``spec``)."""
    return obj if obj["kind"] == "Pod" else obj["spec"]["template"]


def workloads(objs: tuple[Obj, ...]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in WORKLOADS)


def container(workload: Obj) -> Obj:
    (only,) = pod_template(workload)["spec"]["containers"]
    return dict(only)


def args(workload: Obj) -> list[str]:
    spec = container(workload)
    return [*spec.get("command", []), *spec.get("args", [])]


def flag(workload: Obj, name: str) -> str | None:
    """The value of ``--name=value`` in the container's args (the manifests' one form)."""
    values = [a.split("=", 1)[1] for a in args(workload) if a.startswith(f"{name}=")]
    assert len(values) <= 1, f"{name_of(workload)}: {name} given {len(values)} times"
    return values[0] if values else None


def port(workload: Obj, port_name: str) -> int:
    (number,) = [p["containerPort"] for p in container(workload)["ports"] if p["name"] == port_name]
    return int(number)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def mounts(workload: Obj) -> dict[str, Obj]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod_template(workload)["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container(workload)["volumeMounts"]}


def volume_at(workload: Obj, path: str) -> tuple[str, Obj]:
    """(mountPath, volume) of the mount ``path`` lies under."""
    for mount_path, volume in mounts(workload).items():
        if PurePosixPath(path).is_relative_to(mount_path):
            return mount_path, volume
    raise AssertionError(f"{name_of(workload)}: nothing is mounted where {path} is")


def servers(overlay: str) -> tuple[Obj, Obj]:
    objs = render(overlay)
    return one(objs, "Deployment", ORCHESTRATOR), one(objs, "DaemonSet", AGENT)


# ---- render and validate ------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str, version: str) -> None:
    objs = render(overlay)
    assert objs
    failures = []
    for obj in objs:
        try:
            validated = k8s_schemas.validate(obj, version, strict=True)
        except k8s_schemas.ValidationError as err:
            where = "/".join(str(p) for p in err.path)
            failures.append(f"{name_of(obj)} at {where}: {err.message}")
        except k8s_schemas.SchemaNotFoundError as err:
            failures.append(err.message)
        else:
            assert validated == version
    assert not failures, "\n".join(failures)


def test_the_base_has_what_a_cluster_needs() -> None:
    kinds = {name_of(o) for o in render("single")}
    assert kinds >= {
        f"Namespace/{kl.NAMESPACE}",
        f"Deployment/{ORCHESTRATOR}",
        f"Service/{ORCHESTRATOR}",
        f"PodDisruptionBudget/{ORCHESTRATOR}",
        f"PersistentVolumeClaim/{ORCHESTRATOR}-state",
        f"ServiceAccount/{ORCHESTRATOR}",
        f"DaemonSet/{AGENT}",
        f"Service/{AGENT}",
        f"ServiceAccount/{AGENT}",
        f"NetworkPolicy/{AGENT}",
    }


# ---- conventions: tslice.server.kube_labels ------------------------------------------------


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_every_object_is_labelled_and_in_the_namespace(overlay: str) -> None:
    for obj in render(overlay):
        metas = [obj["metadata"]]
        if obj["kind"] in WORKLOADS:
            metas.append(pod_template(obj)["metadata"])
        for meta in metas:
            labels = meta.get("labels", {})
            assert labels.get("app.kubernetes.io/part-of") == "tslice", name_of(obj)
            assert labels.get("app.kubernetes.io/name"), name_of(obj)
            assert labels.get("app.kubernetes.io/component"), name_of(obj)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"].get("namespace") == kl.NAMESPACE, name_of(obj)


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_ports_are_the_conventional_ones(overlay: str) -> None:
    orchestrator, agent = servers(overlay)
    assert port(orchestrator, "grpc") == kl.ORCHESTRATOR_PORT
    assert port(orchestrator, "metrics") == kl.METRICS_PORT
    assert port(agent, kl.AGENT_PORT_NAME) == kl.AGENT_PORT
    assert port(agent, "metrics") == kl.METRICS_PORT
    for workload, grpc in ((orchestrator, kl.ORCHESTRATOR_PORT), (agent, kl.AGENT_PORT)):
        assert flag(workload, "--port") == str(grpc)
        assert flag(workload, "--metrics-port") == str(kl.METRICS_PORT)
        assert flag(workload, "--host") == "0.0.0.0"
    service = one(render(overlay), "Service", ORCHESTRATOR)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": kl.ORCHESTRATOR_PORT,
        "metrics": kl.METRICS_PORT,
    }


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_the_orchestrator_finds_the_agent_pods(overlay: str) -> None:
    orchestrator, agent = servers(overlay)
    key, value = kl.AGENT_SELECTOR.split("=")
    assert pod_template(agent)["metadata"]["labels"][key] == value
    assert flag(orchestrator, "--agent-selector") == kl.AGENT_SELECTOR
    assert flag(orchestrator, "--agent-namespace") == agent["metadata"]["namespace"]


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_the_agent_is_a_privileged_daemonset_on_the_shared_nodes(overlay: str) -> None:
    _, agent = servers(overlay)
    pod = pod_template(agent)["spec"]
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork"), "on hostNetwork the NetworkPolicy would not apply"
    security = container(agent)["securityContext"]
    assert security["privileged"] is True
    assert security["runAsUser"] == 0
    shared = {
        "key": kl.SHARED_TAINT_KEY,
        "operator": "Equal",
        "value": kl.SHARED_TAINT_VALUE,
        "effect": kl.SHARED_TAINT_EFFECT,
    }
    assert shared in pod["tolerations"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    env = {e["name"]: e for e in container(agent)["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert flag(agent, "--node-name") == "$(NODE_NAME)"
    at = mounts(agent)
    assert at["/dev"]["hostPath"]["path"] == "/dev"
    assert env["LD_LIBRARY_PATH"]["value"].startswith("/usr/local/nvidia/")
    assert "hostPath" in at["/usr/local/nvidia"]
    assert at["/run/tslice"]["hostPath"]["path"] == "/run/tslice"
    assert volume_at(agent, flag(agent, "--unix-socket") or "")[0] == "/run/tslice"
    assert "hostPath" in volume_at(agent, flag(agent, "--state-dir") or "")[1]
    # The image's tslice stays reachable when the manifest sets PATH.
    assert image.venv_bin() in env["PATH"]["value"].split(":")


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_the_orchestrator_runs_unprivileged_on_its_state_volume(overlay: str) -> None:
    orchestrator, _ = servers(overlay)
    if overlay != "ha":  # one replica on its SQLite volume (HA: test_the_ha_overlay...)
        assert orchestrator["spec"]["replicas"] == 1, "without --ha: one replica"
        assert orchestrator["spec"]["strategy"]["type"] == "Recreate"
    pod = pod_template(orchestrator)["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == image.user()
    security = container(orchestrator)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    state = volume_at(orchestrator, flag(orchestrator, "--state-dir") or "")[1]
    if overlay == "ha":
        assert set(state) == {"name", "emptyDir"}  # its state is in the API server
    else:
        claim = state["persistentVolumeClaim"]["claimName"]
        one(render(overlay), "PersistentVolumeClaim", claim)
    assert container(orchestrator)["resources"]["requests"]


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_probes_check_grpc_health_where_the_kubelet_can(overlay: str) -> None:
    orchestrator, agent = servers(overlay)
    spec = container(orchestrator)
    probes = [spec[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    probes.append(container(agent)["readinessProbe"])
    for probe in probes:
        if overlay == "tls":
            # The kubelet's gRPC probe is plaintext: against a TLS port it always fails.
            assert "grpc" not in probe and probe["tcpSocket"]["port"] == "grpc"
        else:
            assert probe["grpc"]["port"] in (kl.ORCHESTRATOR_PORT, kl.AGENT_PORT)
    assert container(agent)["livenessProbe"]["tcpSocket"]["port"] == kl.AGENT_PORT_NAME


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_selectors_select_the_pods_they_are_for(overlay: str) -> None:
    objs = render(overlay)
    labels = {o["metadata"]["name"]: pod_template(o)["metadata"]["labels"] for o in workloads(objs)}
    service_for = {ORCHESTRATOR: ORCHESTRATOR, AGENT: AGENT}
    for obj in objs:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Service":
            assert selects(obj["spec"]["selector"], labels[service_for[name]]), name
        elif kind == "PodDisruptionBudget":
            assert selects(obj["spec"]["selector"]["matchLabels"], labels[ORCHESTRATOR])
        elif kind in ("Deployment", "DaemonSet"):
            assert selects(obj["spec"]["selector"]["matchLabels"], labels[name])


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_only_the_orchestrator_reaches_the_agents_grpc_port(overlay: str) -> None:
    objs = render(overlay)
    orchestrator, agent = servers(overlay)
    policy = one(objs, "NetworkPolicy", AGENT)["spec"]
    assert selects(policy["podSelector"]["matchLabels"], pod_template(agent)["metadata"]["labels"])
    assert "Ingress" in policy["policyTypes"]
    admitted = []
    for rule in policy["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        assert ports, "a rule without ports admits every port"
        if kl.AGENT_PORT in ports or kl.AGENT_PORT_NAME in ports:
            admitted.append(rule.get("from"))
    orchestrator_labels = pod_template(orchestrator)["metadata"]["labels"]
    assert len(admitted) == 1 and admitted[0], "the gRPC port is open to everyone"
    (peer,) = admitted[0]
    assert set(peer) == {"podSelector"}
    assert selects(peer["podSelector"]["matchLabels"], orchestrator_labels)


def rules_of(objs: tuple[Obj, ...], account: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) granted to a ServiceAccount through any binding."""
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objs if o["kind"].endswith("Role")}
    granted = set()
    for binding in (o for o in objs if o["kind"].endswith("RoleBinding")):
        if any(s["name"] == account for s in binding["subjects"]):
            role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        granted |= {(group, resource, verb) for verb in rule["verbs"]}
    return granted


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_rbac_grants_each_component_only_what_it_reads(overlay: str) -> None:
    objs = render(overlay)
    read = ("get", "list", "watch")
    reads = {("", r, v) for r in ("nodes", "pods") for v in read}
    if overlay == "ha":  # the Lease and the state ConfigMaps, in its namespace only
        writes = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
        writes |= {("", "configmaps", v) for v in ("get", "list", "create", "update", "delete")}
        assert rules_of(objs, ORCHESTRATOR) == reads | writes
        ha_role = one(objs, "Role", "tslice-orchestrator-ha")
        assert ha_role["metadata"]["namespace"] == kl.NAMESPACE
    else:
        assert rules_of(objs, ORCHESTRATOR) == reads
    assert rules_of(objs, AGENT) == {("", "pods", v) for v in read}
    for workload in workloads(objs):
        account = pod_template(workload)["spec"]["serviceAccountName"]
        assert account == workload["metadata"]["name"]
        one(objs, "ServiceAccount", account)


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_both_servers_are_scraped_on_their_metrics_port(overlay: str) -> None:
    for workload in servers(overlay):
        notes = pod_template(workload)["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert notes["prometheus.io/port"] == str(port(workload, "metrics"))
        assert notes["prometheus.io/path"] == "/metrics"


def test_the_tls_overlay_serves_mutual_tls_with_mounted_certificates(tmp_path: Path) -> None:
    objs = render("tls")
    orchestrator, agent = servers("tls")
    for workload in (orchestrator, agent):
        assert "--insecure" not in args(workload), name_of(workload)
        for name in ("--tls-cert", "--tls-key", "--tls-client-ca"):
            assert "secret" in volume_at(workload, flag(workload, name) or "")[1], name
    configs = {"orchestrator": orchestrator, "agent": agent}
    for what, workload in configs.items():
        config_path = flag(workload, "--config") or ""
        config_map = volume_at(workload, config_path)[1]["configMap"]["name"]
        text = one(objs, "ConfigMap", config_map)["data"][PurePosixPath(config_path).name]
        (tmp_path / f"{what}.yaml").write_text(text)
        data = yaml.safe_load(text)
        assert data["auth"] == {}, "roles by certificate"
        if what == "agent":
            agent_config.load(path=tmp_path / "agent.yaml", overrides={"state_dir": tmp_path})
            continue
        overrides = {"local_agents": ["node-a=127.0.0.1:9001"]}
        orch_config.build(config_file=tmp_path / "orchestrator.yaml", overrides=overrides)
        client = data["agent_client"]
        for key in ("ca", "cert", "key"):
            assert "secret" in volume_at(orchestrator, client[key])[1], key
        agent_service = one(objs, "Service", AGENT)
        assert client["server_name"] == f"{AGENT}.{agent_service['metadata']['namespace']}.svc"


# ---- the example RL job ---------------------------------------------------------------------


def test_the_example_job_is_labelled_as_wire_md_says() -> None:
    objs = render("rl-job-example")
    pods = {o["metadata"]["labels"][kl.GROUP_LABEL]: o for o in objs if o["kind"] == "Pod"}
    assert set(pods) == {"trainer", "sampler"}
    service = one(render("single"), "Service", ORCHESTRATOR)
    address = f"{ORCHESTRATOR}.{service['metadata']['namespace']}.svc:{kl.ORCHESTRATOR_PORT}"
    _, agent = servers("single")
    agent_group = container(agent)["securityContext"]["runAsGroup"]
    claims = set()
    for group, pod in pods.items():
        assert kl.job_of_pod(pod["metadata"]["labels"]) == "demo-a"
        env = {e["name"]: e["value"] for e in container(pod)["env"]}
        assert env["TIMESLICE_JOB_ID"] == "demo-a"
        assert env["TIMESLICE_ORCH_ADDR"] == address
        assert env["TIMESLICE_TRAINER_GROUP"] == "trainer"
        assert env["TIMESLICE_SAMPLER_GROUP"] == "sampler"
        assert env["TSLICE_ROLE"] == group
        spec = pod["spec"]
        assert {
            "key": kl.SHARED_TAINT_KEY,
            "operator": "Equal",
            "value": kl.SHARED_TAINT_VALUE,
            "effect": kl.SHARED_TAINT_EFFECT,
        } in spec["tolerations"]
        affinity = spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        (term,) = affinity["nodeSelectorTerms"]
        assert term["matchExpressions"] == [
            {
                "key": kl.group_node_label(group),
                "operator": "In",
                "values": [kl.GROUP_NODE_LABEL_VALUE],
            }
        ]
        (claim,) = spec["resourceClaims"]
        claims.add(claim["resourceClaimName"])
        assert container(pod)["resources"]["claims"] == [{"name": claim["name"]}]
        assert agent_group in spec["securityContext"]["supplementalGroups"]
        assert mounts(pod)["/run/tslice"]["hostPath"]["path"] == "/run/tslice"
    (shared,) = claims
    assert one(objs, "ResourceClaim", shared)["apiVersion"] == "resource.k8s.io/v1"


# ---- container command lines ----------------------------------------------------------------


@functools.cache
def cli_command(name: str) -> Any:
    return typer.main.get_command(main.app).commands[name]  # type: ignore[attr-defined]


def cli_flags(name: str) -> set[str]:
    return {opt for param in cli_command(name).params for opt in param.opts}


def command_lines() -> list[Obj]:
    return [
        pytest.param(w, id=f"{overlay}:{name_of(w)}")
        for overlay in OVERLAYS
        for w in workloads(render(overlay))
        if container(w).get("command") == ["tslice"]
    ]


def expanded(workload: Obj) -> list[str]:
    """The container's args after tslice, as the kubelet expands $(VAR)."""
    return [_ENV_REF.sub("node-a", a) for a in container(workload)["args"]]


def is_kube_flag(arg: str) -> bool:
    return arg.split("=", 1)[0] in KUBE_FLAGS


@pytest.mark.parametrize("workload", command_lines())
def test_container_command_lines_parse(workload: Obj) -> None:
    name, *rest = expanded(workload)
    # The --kubernetes flags are checked on their own, below.
    rest = [a for a in rest if not is_kube_flag(a)]
    assert all(a.startswith("--") for a in rest), "the manifests write --flag=value"
    cli_command(name).make_context(name, rest)  # raises on an unknown flag or a bad value


def test_the_orchestrator_command_lines_use_real_kubernetes_flags() -> None:
    lines = [w.values[0] for w in command_lines() if expanded(w.values[0])[0] == "orchestrator"]
    assert lines
    for workload in lines:
        name, *rest = expanded(workload)
        used = {a.split("=", 1)[0] for a in rest if is_kube_flag(a)}
        assert "--kubernetes" in used
        assert used <= cli_flags(name), f"tslice orchestrator lacks {used - cli_flags(name)}"
        cli_command(name).make_context(name, rest)


@pytest.mark.parametrize("overlay", SERVER_OVERLAYS)
def test_both_servers_run_in_kubernetes_mode(overlay: str) -> None:
    """An overlay that replaces a server's args must keep --kubernetes (the TLS one lost the
    agent's once: it then admitted workloads without checking their pods)."""
    for workload in servers(overlay):
        assert "--kubernetes" in args(workload), f"{overlay}: {name_of(workload)}"


def test_the_ha_overlay_runs_replicas_that_elect_a_leader() -> None:
    objs = render("ha")
    orchestrator, _ = servers("ha")
    assert orchestrator["spec"]["replicas"] >= 2
    assert orchestrator["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    assert "--ha" in args(orchestrator)
    assert flag(orchestrator, "--lease-namespace") == kl.NAMESPACE
    # --identity and --advertise-address default to the pod's name and IP.
    env = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(orchestrator)["env"]
    }
    assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    budget = one(objs, "PodDisruptionBudget", ORCHESTRATOR)["spec"]
    assert budget["maxUnavailable"] == 1 and "minAvailable" not in budget
    # Renewals leave several tries before the Lease expires (the CLI refuses less).
    assert (
        float(flag(orchestrator, "--renew-interval") or 0)
        < int(flag(orchestrator, "--lease-duration") or 0) * 2 / 3
    )
