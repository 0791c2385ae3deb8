"""HA mode's state ConfigMaps against the API-server emulator, store by store (no
orchestrator process): a term belongs to one replica. Two replicas that won the same term
(a Lease deleted or replaced by hand) never adopt each other's writes: the second to
claim, or the first whose write meets the other's, is deposed; and a Lease created anew
starts above the terms the state names."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("lightkube")

from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from tests.kube.emulator import ApiServerEmulator
from tests.kube.ha_stack import NAMESPACE
from tslice.orchestrator.kube import leadership, lease, state
from tslice.orchestrator.persistence import records
from tslice.server import kube_watch


def whole(record: records.LockRecord) -> records.Changes:
    """A record written whole (as a group's first save writes what it started from)."""
    return records.Changes(row=record.row, queued=record.queue, footprints=record.footprints)


@pytest.fixture
async def client(api: ApiServerEmulator, tmp_path: pathlib.Path) -> AsyncIterator[Any]:
    kube = kube_watch.connect(api.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        yield kube
    finally:
        await kube.close()


def _store(client: Any, term: int, identity: str, deposed: list[tuple[str, int]]) -> Any:
    return state.ConfigMapStore(
        client,
        namespace=NAMESPACE,
        term=term,
        identity=identity,
        on_deposed=lambda why, t: deposed.append((why, t)),
    )


def _held_by(job: str) -> records.LockRecord:
    return records.LockRecord(job, job, 1, 1, 2, (), None, ())


async def test_a_same_term_write_by_another_replica_is_never_adopted(client: Any) -> None:
    deposed_a: list[tuple[str, int]] = []
    deposed_b: list[tuple[str, int]] = []
    a = _store(client, 3, "orch-a", deposed_a)
    await a.claim()
    nodes = [("gpu-a", "127.0.0.1:1")]
    await a.save("trainer", nodes=nodes, changes=whole(_held_by("job-a")))
    # orch-b won term 3 too: its claim finds orch-a's write of term 3 and steps down.
    b = _store(client, 3, "orch-b", deposed_b)
    with pytest.raises(state.NewerTerm) as claimed:
        await b.claim()
    assert claimed.value.term == 3
    assert "two replicas were elected in one term" in str(claimed.value)
    assert [t for _, t in deposed_b] == [3]
    # Had orch-b's claim come first, orch-a's next write conflicts, and orch-a steps down
    # instead of adopting the version and overwriting orch-b's record.
    cm = await client.get(state.ConfigMap, state.configmap_name("trainer"), namespace=NAMESPACE)
    cm.metadata.annotations[state.LEADER_ANNOTATION] = "orch-b"
    cm.data["record"] = state.codec.encode(_held_by("job-b"))
    await client.replace(cm)
    with pytest.raises(state.NewerTerm):
        await a.save("trainer", nodes=nodes, changes=whole(_held_by("job-c")))
    assert [t for _, t in deposed_a] == [3]
    kept = await client.get(state.ConfigMap, cm.metadata.name, namespace=NAMESPACE)
    assert state.codec.decode(kept.data["record"]).holder == "job-b"


async def test_a_new_lease_starts_above_the_terms_in_the_state(client: Any) -> None:
    a = _store(client, 9, "orch-a", [])
    await a.claim()
    await a.save("trainer", nodes=[], changes=whole(_held_by("job-a")))
    # No Lease (deleted by hand), and a replica that never saw it: it starts above term 9.
    settings = leadership.HaSettings(identity="orch-b", address="127.0.0.1:1")
    elector = lease.Elector(
        client,
        settings,
        on_seen=lambda holder, address: None,
        known_terms=lambda: state.highest_term(client, NAMESPACE),
    )
    assert await elector.acquire() == 10
    await elector.release()
    # Replaced by hand with a fresh Lease (its count 0): above what this replica saw.
    fresh = Lease(metadata=ObjectMeta(name=settings.lease_name, namespace=NAMESPACE))
    await client.delete(Lease, settings.lease_name, namespace=NAMESPACE)
    await client.create(fresh)
    assert await elector.acquire() == 11


async def test_no_term_is_won_beyond_what_a_lease_counts(client: Any) -> None:
    settings = leadership.HaSettings(identity="orch-a", address="127.0.0.1:1")
    full = Lease(
        metadata=ObjectMeta(name=settings.lease_name, namespace=NAMESPACE),
        spec=LeaseSpec(leaseTransitions=2**31 - 1),
    )
    await client.create(full)
    elector = lease.Elector(client, settings, on_seen=lambda holder, address: None)
    with pytest.raises(RuntimeError, match=r"above 2147483647, the most a Lease counts"):
        await elector._try_acquire()
