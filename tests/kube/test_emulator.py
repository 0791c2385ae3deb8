"""The API-server emulator answers a real client library (lightkube, over HTTP) as an API
server would: versions, selectors, conflicts, watches and 410 Gone."""

from __future__ import annotations

import contextlib
import itertools
import pathlib
from collections.abc import Iterator

import pytest

lightkube = pytest.importorskip("lightkube")

from lightkube import ApiError, Client, KubeConfig  # noqa: E402
from lightkube.models.meta_v1 import ObjectMeta  # noqa: E402
from lightkube.resources.core_v1 import ConfigMap, Node, Pod  # noqa: E402
from lightkube.types import PatchType  # noqa: E402

from tests.kube.emulator import ApiServerEmulator  # noqa: E402


@pytest.fixture
def client(api: ApiServerEmulator, tmp_path: pathlib.Path) -> Iterator[Client]:
    config = KubeConfig.from_file(api.write_kubeconfig(tmp_path / "kubeconfig"))
    with Client(config=config, trust_env=False) as client:
        yield client


def _node(name: str, **labels: str) -> Node:
    return Node(metadata=ObjectMeta(name=name, labels=labels))


def test_create_get_list_with_selectors(client: Client) -> None:
    a = client.create(_node("a", **{"group.timeslice.io/g": "true"}))
    b = client.create(_node("b", tier="x"))
    assert int(b.metadata.resourceVersion) > int(a.metadata.resourceVersion)
    assert client.get(Node, "a").metadata.uid == a.metadata.uid
    labelled = [n.metadata.name for n in client.list(Node, labels={"group.timeslice.io/g": "true"})]
    assert labelled == ["a"]
    assert [n.metadata.name for n in client.list(Node, fields={"metadata.name": "b"})] == ["b"]
    pods = client.list(
        Pod, namespace="*", labels={"timeslice.io/job-id": lightkube.operators.exists()}
    )
    assert list(pods) == []
    with pytest.raises(ApiError) as err:
        client.create(_node("a"))
    assert err.value.status.code == 409


def test_a_stale_resource_version_is_a_conflict(client: Client) -> None:
    first = client.create(ConfigMap(metadata=ObjectMeta(name="locks", namespace="ns"), data={}))
    first.data = {"g": "job-a"}
    second = client.replace(first)
    assert second.data == {"g": "job-a"}
    first.data = {"g": "job-b"}  # still carries the old resourceVersion
    with pytest.raises(ApiError) as err:
        client.replace(first)
    assert err.value.status.code == 409
    stale = {"metadata": {"resourceVersion": first.metadata.resourceVersion}, "data": {"g": "x"}}
    with pytest.raises(ApiError):
        client.patch(ConfigMap, "locks", stale, namespace="ns", patch_type=PatchType.MERGE)
    fresh = {"metadata": {"resourceVersion": second.metadata.resourceVersion}, "data": {"g": "c"}}
    patched = client.patch(ConfigMap, "locks", fresh, namespace="ns", patch_type=PatchType.MERGE)
    assert patched.data == {"g": "c"}


def test_a_watch_replays_from_a_version_and_follows_its_selector(client: Client) -> None:
    client.create(_node("a"))
    listed = client.list(Node, labels={"group.timeslice.io/g": "true"})
    assert list(listed) == []
    label = {"metadata": {"labels": {"group.timeslice.io/g": "true"}}}
    client.patch(Node, "a", label, patch_type=PatchType.MERGE)
    client.patch(Node, "a", {"metadata": {"labels": {"group.timeslice.io/g": None}}})
    client.delete(Node, "a")
    watch = client.watch(
        Node, labels={"group.timeslice.io/g": "true"}, resource_version=listed.resourceVersion
    )
    # In: ADDED; out of the selector: DELETED; the deletion of an unselected node: nothing.
    with contextlib.closing(iter(watch)) as events:  # type: ignore[type-var]
        seen = [(t, n.metadata.name) for t, n in itertools.islice(events, 2)]
    assert seen == [("ADDED", "a"), ("DELETED", "a")]


def test_a_watch_from_a_compacted_version_is_gone(client: Client, api: ApiServerEmulator) -> None:
    old = client.create(_node("a")).metadata.resourceVersion
    client.create(_node("b"))
    api.store.compact()
    with pytest.raises(ApiError) as err:
        next(iter(client.watch(Node, resource_version=old)))
    assert err.value.status.code == 410


def test_leases_are_served_with_optimistic_concurrency(client: Client) -> None:
    from lightkube.models.coordination_v1 import LeaseSpec
    from lightkube.resources.coordination_v1 import Lease

    meta = ObjectMeta(name="tslice-orchestrator", namespace="timeslice-system")
    lease = client.create(Lease(metadata=meta, spec=LeaseSpec(holderIdentity="replica-a")))
    lease.spec.holderIdentity = "replica-b"
    taken = client.replace(lease)
    assert client.get(Lease, "tslice-orchestrator", namespace="timeslice-system").spec == taken.spec
    lease.spec.holderIdentity = "replica-a"  # a deposed leader writing with its old version
    with pytest.raises(ApiError) as err:
        client.replace(lease)
    assert err.value.status.code == 409
