"""Adapters without a channel: mode parsing, residency rules, engine mappings, resolution."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from typing import Any

import pytest

from tests.workload import workload_support
from tslice.common import residency
from tslice.workload import adapters
from tslice.workload.adapters import base, callbacks, sglang, vllm

OFFLOAD = base.SuspendMode.OFFLOAD
DISCARD = base.SuspendMode.DISCARD


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("offload", OFFLOAD),
        ("DISCARD", DISCARD),
        ("SUSPEND_MODE_OFFLOAD", OFFLOAD),
        (" discard ", DISCARD),
        (1, OFFLOAD),
        (2, DISCARD),
        (DISCARD, DISCARD),
    ],
)
def test_suspend_mode_parses_names_and_numbers(
    value: str | int, expected: base.SuspendMode
) -> None:
    assert base.SuspendMode.parse(value) is expected


@pytest.mark.parametrize("value", ["sleep", "", 0, 3, "SUSPEND_MODE_UNSPECIFIED"])
def test_suspend_mode_rejects_everything_else(value: str | int) -> None:
    with pytest.raises(ValueError, match="unknown suspend mode"):
        base.SuspendMode.parse(value)


def test_suspend_mode_matches_the_wire_values() -> None:
    from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

    assert int(OFFLOAD) == pb.SUSPEND_MODE_OFFLOAD
    assert int(DISCARD) == pb.SUSPEND_MODE_DISCARD
    assert OFFLOAD.label == "offload"


def test_normalize_tags() -> None:
    assert base.normalize_tags(None) == ()
    assert base.normalize_tags("weights") == ("weights",)
    assert base.normalize_tags([" weights", "kv_cache", "weights"]) == ("weights", "kv_cache")
    with pytest.raises(ValueError, match="not a non-empty string"):
        base.normalize_tags(["weights", ""])


# ---- residency rules (shared with the agent) ---------------------------------------


def test_residency_all_or_nothing_without_tags() -> None:
    tracker = residency.ResidencyTracker()
    assert tracker.residency == residency.FULL
    tracker.snapshot_done([])
    assert tracker.residency == residency.NONE and tracker.suspended
    tracker.restore_done(["anything"])
    assert tracker.residency == residency.FULL


def test_residency_staged_by_tag() -> None:
    tracker = residency.ResidencyTracker(declared=("weights", "kv_cache"))
    tracker.snapshot_done(["kv_cache"])
    assert (tracker.residency, tracker.resident_tags, tracker.missing_tags) == (
        residency.PARTIAL,
        ("weights",),
        ("kv_cache",),
    )
    tracker.snapshot_done([])
    assert tracker.residency == residency.NONE and tracker.resident_tags == ()
    tracker.restore_done(["weights"])
    assert tracker.residency == residency.PARTIAL and tracker.resident_tags == ("weights",)
    tracker.restore_done(["kv_cache"])
    assert tracker.residency == residency.FULL and not tracker.suspended
    tracker.snapshot_done(["weights", "kv_cache"])
    assert tracker.residency == residency.NONE


def test_residency_from_a_report() -> None:
    tracker = residency.ResidencyTracker(
        declared=("weights", "kv_cache"), suspended=True, resident=["weights"]
    )
    assert tracker.residency == residency.PARTIAL
    assert residency.ResidencyTracker(declared=("w",), suspended=True).residency == residency.NONE


# ---- vLLM ---------------------------------------------------------------------------


def test_vllm_maps_modes_to_sleep_levels_and_tags_to_wake_up() -> None:
    engine = workload_support.FakeVllm()
    adapter = vllm.VllmAdapter(engine)
    caps = adapter.capabilities()
    assert caps.supported_modes == (OFFLOAD, DISCARD) and caps.default_mode is None
    assert caps.tags == ("weights", "kv_cache")
    adapter.snapshot(OFFLOAD, [])
    assert adapter.state() == base.AdapterState(suspended=True, resident_tags=())
    adapter.restore(["weights"])
    assert adapter.state() == base.AdapterState(suspended=True, resident_tags=("weights",))
    adapter.restore(["kv_cache"])
    assert adapter.state() == base.AdapterState(
        suspended=False, resident_tags=("weights", "kv_cache")
    )
    adapter.snapshot(DISCARD, ["weights", "kv_cache"])
    adapter.restore([])
    assert engine.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
        ("sleep", 2),
        ("wake_up", None),
    ]


def test_vllm_state_follows_the_engine_when_it_can_tell() -> None:
    engine = workload_support.FakeVllm()
    engine.sleeping = True  # asleep before registration
    adapter = vllm.VllmAdapter(engine)
    assert adapter.state().suspended
    engine.sleeping = False  # someone woke it outside the channel
    assert adapter.state() == base.AdapterState(False, ("weights", "kv_cache"))


def test_vllm_refuses_a_partial_sleep() -> None:
    engine = workload_support.FakeVllm()
    with pytest.raises(ValueError, match="sleeps the whole engine"):
        vllm.VllmAdapter(engine).snapshot(OFFLOAD, ["kv_cache"])
    assert engine.calls == []


def test_vllm_async_engine_returns_awaitables() -> None:
    engine = workload_support.FakeAsyncVllm()
    adapter = vllm.VllmAdapter(engine)
    outcome = adapter.snapshot(DISCARD, [])
    assert asyncio.iscoroutine(outcome)
    assert asyncio.run(outcome) is None  # no CUDA here: nothing measured
    assert engine.calls == [("sleep", 2)]
    assert adapter.state().suspended


def test_vllm_rejects_non_engines() -> None:
    with pytest.raises(TypeError, match="is it a vLLM engine"):
        vllm.VllmAdapter(object())


# ---- SGLang -------------------------------------------------------------------------


def test_sglang_passes_tags_and_declares_its_launch_mode() -> None:
    engine = workload_support.FakeSglang()
    adapter = sglang.SglangAdapter(engine, mode="discard")
    caps = adapter.capabilities()
    assert caps.supported_modes == (DISCARD,) and caps.default_mode == DISCARD
    assert caps.tags == ("weights", "kv_cache", "cuda_graph")
    adapter.snapshot(DISCARD, ["kv_cache", "cuda_graph"])
    assert adapter.state() == base.AdapterState(True, ("weights",))
    adapter.restore([])
    assert engine.calls == [("release", ["kv_cache", "cuda_graph"]), ("resume", None)]
    with pytest.raises(ValueError, match="started for discard"):
        adapter.snapshot(OFFLOAD, [])


# ---- callbacks and duck-typed objects -----------------------------------------------


def test_callback_results_are_coerced() -> None:
    adapter = callbacks.CallbackAdapter(
        on_snapshot=lambda mode, tags: {"device_bytes": 10, "host_bytes": 8},
        on_restore=lambda tags: True,  # llm-d callbacks may return anything
    )
    assert adapter.snapshot(OFFLOAD, []) == base.AdapterResult(10, 8)
    assert adapter.restore([]) is None
    assert adapter.state() is None


def test_async_callbacks_are_awaitable() -> None:
    async def on_snapshot(mode: str, tags: list[str]) -> base.AdapterResult:
        return base.AdapterResult(device_bytes=5)

    async def on_restore(tags: list[str]) -> None:
        return None

    adapter = callbacks.CallbackAdapter(on_snapshot=on_snapshot, on_restore=on_restore)
    outcome: Any = adapter.snapshot(DISCARD, ["x"])
    assert asyncio.run(outcome) == base.AdapterResult(device_bytes=5)


class _Snapshottable:
    supported_modes = ("offload",)
    default_mode = "offload"
    tags = ("weights",)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def snapshot(self, mode: str, tags: list[str]) -> None:
        self.calls.append(("snapshot", mode, tags))

    def restore(self, tags: list[str]) -> None:
        self.calls.append(("restore", tags))


def test_snapshottable_object_reads_declared_capabilities() -> None:
    obj = _Snapshottable()
    adapter = callbacks.SnapshottableAdapter(obj)
    assert adapter.capabilities() == base.Capabilities((OFFLOAD,), OFFLOAD, ("weights",))
    adapter.snapshot(OFFLOAD, ["weights"])
    adapter.restore([])
    assert obj.calls == [("snapshot", "offload", ["weights"]), ("restore", [])]


# ---- resolution ---------------------------------------------------------------------


def test_resolution_order() -> None:
    assert isinstance(
        adapters.resolve_adapter(on_snapshot=lambda m, t: None, on_restore=lambda t: None),
        callbacks.CallbackAdapter,
    )
    custom = vllm.VllmAdapter(workload_support.FakeVllm())
    assert adapters.resolve_adapter(workload=custom) is custom
    assert isinstance(
        adapters.resolve_adapter(workload=workload_support.FakeVllm()), vllm.VllmAdapter
    )
    assert isinstance(
        adapters.resolve_adapter(workload=workload_support.FakeSglang()), sglang.SglangAdapter
    )
    assert isinstance(
        adapters.resolve_adapter(workload=_Snapshottable()), callbacks.SnapshottableAdapter
    )
    with pytest.raises(ValueError, match="nothing to register"):
        adapters.resolve_adapter()
    with pytest.raises(TypeError, match="cannot drive a int"):
        adapters.resolve_adapter(workload=3)


def test_importing_the_workload_package_does_not_import_torch() -> None:
    import subprocess

    code = (
        "import sys, tslice.workload, tslice.workload.channel; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "print(sorted(n for n in tslice.workload.__all__))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    assert "TorchAdapter" in out.stdout and "register_workload" in out.stdout


def test_torch_objects_resolve_to_the_torch_adapter() -> None:
    torch = pytest.importorskip("torch")
    import tslice.workload as workload_pkg

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for workload in (model, optimizer, (model, optimizer)):
        adapter = adapters.resolve_adapter(workload=workload)
        assert isinstance(adapter, workload_pkg.TorchAdapter)
        assert adapter.name == "torch"


def test_workload_package_exports_are_pinned() -> None:
    import tslice.workload as workload_pkg

    assert workload_pkg.__all__ == [
        "AdapterResult",
        "AdapterState",
        "CallbackAdapter",
        "Capabilities",
        "SglangAdapter",
        "SnapshottableAdapter",
        "SuspendMode",
        "TorchAdapter",
        "VllmAdapter",
        "WorkloadAdapter",
        "WorkloadHandle",
        "announce_process",
        "register_workload",
    ]
    has_torch = importlib.util.find_spec("torch") is not None
    for name in workload_pkg.__all__:
        if name == "TorchAdapter" and not has_torch:
            # A core install (no torch extra): a clear error that says what to install.
            with pytest.raises(ImportError, match=r"pip install 'tslice\[torch\]'"):
                getattr(workload_pkg, name)
            continue
        assert getattr(workload_pkg, name) is not None
    with pytest.raises(AttributeError):
        _ = workload_pkg.NoSuchThing
