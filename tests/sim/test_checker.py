"""The mutual-exclusion checker on synthetic journals: a clean run, then each violation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tslice.agent.backends import simdevice as device
from tslice.sim import checker


@dataclasses.dataclass(frozen=True)
class Win:
    job: str
    group: str
    requested: float
    acquired: float | None
    yielded: float | None
    error: str = ""


def ev(
    t: float,
    job: str,
    kind: str,
    *,
    node: str = "node-a",
    group: str = "sampler",
    dev: str = "sim0",
) -> device.Event:
    return device.Event(
        t=t,
        node=node,
        group=group,
        job=job,
        event=kind,  # type: ignore[arg-type]
        device=dev,
        bytes=1,
    )


def clean_run() -> tuple[list[device.Event], list[Win]]:
    """A then B on a two-node group (both devices), with a proper switch in between."""
    journal = []
    for node in ("node-a", "node-b"):
        journal += [
            ev(1.0, "A", "alloc", node=node),
            ev(5.5, "A", "free", node=node),
            ev(5.6, "B", "alloc", node=node),
        ]
    windows = [
        Win("A", "sampler", requested=0.9, acquired=1.1, yielded=5.0),
        Win("B", "sampler", requested=2.0, acquired=5.8, yielded=9.0),
    ]
    return journal, windows


def test_clean_run_has_no_violation() -> None:
    journal, windows = clean_run()
    assert checker.check(journal=journal, windows=windows) == []


def test_overlapping_allocations_are_reported() -> None:
    journal = [ev(1.0, "A", "alloc"), ev(2.0, "B", "alloc"), ev(3.0, "A", "free")]
    found = checker.check(journal=journal, windows=[])
    assert [v.kind for v in found] == [checker.OVERLAP]
    assert found[0].jobs == ("A", "B")
    assert "job B was allocated" in found[0].message
    assert "job A was still resident" in found[0].message


def test_jobs_of_different_groups_may_share_a_node() -> None:
    journal = [ev(1.0, "A", "alloc", group="sampler"), ev(2.0, "B", "alloc", group="trainer")]
    assert checker.check(journal=journal, windows=[]) == []


def test_window_before_restore_is_not_resident() -> None:
    journal, windows = clean_run()
    # B's acquire returned before its bytes landed on node-b.
    journal = [e for e in journal if not (e.job == "B" and e.node == "node-b")]
    journal.append(ev(6.0, "B", "alloc", node="node-b"))
    found = checker.check(journal=journal, windows=windows)
    assert [(v.kind, v.node) for v in found] == [(checker.NOT_RESIDENT, "node-b")]


def test_snapshot_before_yield_is_not_resident() -> None:
    journal, windows = clean_run()
    windows[0] = Win("A", "sampler", requested=0.9, acquired=1.1, yielded=6.0)
    found = checker.check(journal=journal, windows=windows)
    kinds = {v.kind for v in found}
    # A was freed at 5.5 on both nodes while still holding: two nodes not resident,
    # and B acquired at 5.8 while A's window was still open.
    assert kinds == {checker.NOT_RESIDENT, checker.DOUBLE_HOLDER}
    assert sum(v.kind == checker.NOT_RESIDENT for v in found) == 2


def test_a_window_that_ends_where_it_begins_holds_nothing() -> None:
    # Seen in a promise run: one process of A yielded the group just as another process
    # of A was granted it, before that answer came; the harness ends the window at the
    # answer. It is empty, not an instant at which A had to be resident.
    journal, windows = clean_run()
    windows.append(Win("A", "sampler", requested=5.2, acquired=5.7, yielded=5.7))
    assert checker.check(journal=journal, windows=windows) == []
    # A window with any length still has to be covered.
    windows[-1] = Win("A", "sampler", requested=5.2, acquired=5.7, yielded=5.75)
    found = checker.check(journal=journal, windows=windows)
    assert checker.NOT_RESIDENT in {v.kind for v in found}


def test_missing_node_from_group_nodes_is_reported() -> None:
    journal, windows = clean_run()
    found = checker.check(
        journal=journal, windows=windows, group_nodes={"sampler": ["node-a", "node-b", "node-c"]}
    )
    assert {v.node for v in found} == {"node-c"}
    assert all(v.kind == checker.NOT_RESIDENT for v in found)


def test_every_device_must_hold_the_job() -> None:
    journal, windows = clean_run()
    journal.append(ev(0.5, "X", "alloc", dev="sim1"))  # node-a also has sim1, A never there
    found = checker.check(journal=journal, windows=windows[:1])
    assert [(v.kind, v.node) for v in found] == [(checker.NOT_RESIDENT, "node-a")]
    assert "sim1" in found[0].message


def test_acquire_that_never_returned() -> None:
    journal, windows = clean_run()
    windows.append(Win("C", "sampler", requested=3.0, acquired=None, yielded=None, error="boom"))
    found = checker.check(journal=journal, windows=windows)
    assert [v.kind for v in found] == [checker.ACQUIRE_NOT_RETURNED]
    assert "boom" in found[0].message and "job C" in found[0].message


def test_unknown_group_cannot_be_proven() -> None:
    found = checker.check(journal=[], windows=[Win("A", "ghost", 0.0, 1.0, 2.0)])
    assert [v.kind for v in found] == [checker.NOT_RESIDENT]
    assert "no simulated node journaled" in found[0].message


def test_works_on_a_real_journal_file(tmp_path: Path) -> None:
    node = device.SimNode(node="node-a", state_dir=tmp_path)
    node.allocate(job="A", group="sampler", bytes_per_device=10)
    node.free(job="A", group="sampler")
    node.allocate(job="B", group="sampler", bytes_per_device=10)
    node.allocate(job="C", group="sampler", bytes_per_device=10)  # co-resident: a bug
    journal = device.read_journal(tmp_path / device.JOURNAL_FILE)
    found = checker.check(journal=journal, windows=[])
    assert [(v.kind, v.jobs) for v in found] == [(checker.OVERLAP, ("B", "C"))]
    # The journal lines carry what the checker needs.
    first = json.loads((tmp_path / device.JOURNAL_FILE).read_text().splitlines()[0])
    assert first["event"] == "alloc" and first["group"] == "sampler"


def test_holders_of_groups_that_share_devices_must_not_overlap() -> None:
    @dataclasses.dataclass
    class W:
        job: str
        group: str
        requested: float
        acquired: float | None
        yielded: float | None
        error: str = ""

    windows = [
        W("a", "sampler", 0.0, 1.0, 5.0),
        W("a", "trainer", 0.0, 2.0, 3.0),  # the same job holds both: fine
        W("b", "trainer", 0.0, 4.0, 6.0),  # b while a holds sampler: not fine
        W("c", "other", 0.0, 4.0, 6.0),  # shares nothing
    ]
    conflicts = {"sampler": {"trainer"}, "trainer": {"sampler"}, "other": set()}
    found = checker.check(journal=[], windows=windows, group_nodes={}, conflicts=conflicts)
    shared = [v for v in found if v.kind == checker.SHARED_HOLDERS]
    assert [(v.jobs, v.group) for v in shared] == [(("a", "b"), "trainer")]
    assert "share devices" in shared[0].message
