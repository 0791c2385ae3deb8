"""Pins the v1alpha1 wire contract (shared WIRE.md) from the compiled descriptors.

Every package, service, RPC, message, field name, field number, field type, label and enum
value that llm-d clients depend on is listed here literally. tslice additions (new RPCs, new
messages, fields numbered >= 100) are allowed; changing anything below is not.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from google.protobuf import descriptor as d

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as apb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

T = d.FieldDescriptor
STR, BOOL, I64, I32, U64, MSG, ENUM = (
    T.TYPE_STRING,
    T.TYPE_BOOL,
    T.TYPE_INT64,
    T.TYPE_INT32,
    T.TYPE_UINT64,
    T.TYPE_MESSAGE,
    T.TYPE_ENUM,
)
REP = "repeated"
OPT = "optional"

ORCH_PKG = "timeslice_orchestrator.v1alpha1"
AGENT_PKG = "snapshot_agent.v1alpha1"

# message -> {field: (number, type, type_name or None, "repeated"/"optional"/None)}
ORCH_MESSAGES: dict[str, dict[str, tuple[int, int, str | None, str | None]]] = {
    "AcquireRequest": {"job_id": (1, STR, None, None), "group_id": (2, STR, None, None)},
    "AcquireResponse": {
        "success": (1, BOOL, None, None),
        "waited_ms": (2, I64, None, None),
        "context_restored": (3, BOOL, None, None),
    },
    "YieldRequest": {"job_id": (1, STR, None, None), "group_id": (2, STR, None, None)},
    "YieldResponse": {
        "success": (1, BOOL, None, None),
        "pending_waiters": (2, I64, None, None),
        "snapshot_deferred": (3, BOOL, None, None),
    },
    "ListGroupsRequest": {},
    "ListGroupsResponse": {"group_ids": (1, STR, None, REP)},
    "GetGroupStatusRequest": {"group_id": (1, STR, None, None)},
    "GetGroupStatusResponse": {
        "group": (1, MSG, f"{ORCH_PKG}.GroupStatus", None),
        "agent_job_states": (2, MSG, f"{ORCH_PKG}.SnapshotAgentJobState", REP),
    },
    "GroupStatus": {
        "group_id": (1, STR, None, None),
        "group_state": (2, ENUM, f"{ORCH_PKG}.GroupStatus.State", None),
        "state_timestamp": (3, MSG, "google.protobuf.Timestamp", None),
        "locking_job": (4, STR, None, None),
        "active_job": (5, STR, None, None),
        "waiter_queue_depth": (6, I64, None, None),
        "loaded_job": (7, STR, None, None),
    },
    "SnapshotAgentJobState": {
        "agent": (1, STR, None, None),
        "job_state": (2, ENUM, f"{ORCH_PKG}.SnapshotAgentJobState.State", None),
        "job_id": (3, STR, None, None),
    },
}

# tslice additions its own clients rely on: their numbers and names are pinned too.
TSLICE_ORCH_MESSAGES: dict[str, dict[str, tuple[int, int, str | None, str | None]]] = {
    "AcquireRequest": {
        "footprint_bytes": (100, I64, None, None),
        "lease_ms": (101, I64, None, None),
        "timeout_ms": (102, I64, None, None),
    },
    "GroupStatus": {"draining": (106, BOOL, None, None)},
}

# tslice's administrator RPCs (issue 10): whole messages of its own, pinned as they are.
ADMIN_MESSAGES: dict[str, dict[str, tuple[int, int, str | None, str | None]]] = {
    "EvictRequest": {
        "group_id": (1, STR, None, None),
        "job_id": (2, STR, None, None),
        "reason": (3, STR, None, None),
    },
    "EvictResponse": {"evictions": (1, MSG, f"{ORCH_PKG}.Eviction", REP)},
    "Eviction": {
        "group_id": (1, STR, None, None),
        "role": (2, ENUM, f"{ORCH_PKG}.Eviction.Role", None),
        "next_job": (3, STR, None, None),
    },
    "DrainRequest": {"group_id": (1, STR, None, None), "drain": (2, BOOL, None, None)},
    "DrainResponse": {
        "draining": (1, BOOL, None, None),
        "was_draining": (2, BOOL, None, None),
        "locking_job": (3, STR, None, None),
        "switching": (4, BOOL, None, None),
        "waiter_queue_depth": (5, I64, None, None),
    },
}
# The all-or-nothing Acquire of several groups (issue 9 §3), and its place on Session.
SET_MESSAGES: dict[str, dict[str, tuple[int, int, str | None, str | None]]] = {
    "AcquireSetRequest": {
        "job_id": (1, STR, None, None),
        "group_ids": (2, STR, None, REP),
        "footprint_bytes": (3, I64, None, None),
        "lease_ms": (4, I64, None, None),
        "timeout_ms": (5, I64, None, None),
        # tslice's addition (>= 100): a footprint per group (issue 17 §6).
        "footprints": (100, MSG, f"{ORCH_PKG}.AcquireSetRequest.FootprintsEntry", REP),
    },
    "AcquireSetResponse": {
        "success": (1, BOOL, None, None),
        "waited_ms": (2, I64, None, None),
        "grants": (3, MSG, f"{ORCH_PKG}.SetGrant", REP),
    },
    "SetGrant": {
        "group_id": (1, STR, None, None),
        "context_restored": (2, BOOL, None, None),
        "grant_epoch": (3, I64, None, None),
    },
}
#: Where AcquireSet rides on a Session stream: (message, field) -> (number, message type).
SET_ON_SESSION = {
    ("SessionRequest", "acquire_set"): (5, f"{ORCH_PKG}.AcquireSetRequest"),
    ("SessionResponse", "acquire_set"): (6, f"{ORCH_PKG}.AcquireSetResponse"),
}
ADMIN_ENUMS = {"Eviction.Role": [("ROLE_UNSPECIFIED", 0), ("ROLE_HOLDER", 1), ("ROLE_WAITER", 2)]}
ADMIN_RPCS = {
    "ClearDegraded": ("ClearDegradedRequest", "ClearDegradedResponse", False, False),
    "Evict": ("EvictRequest", "EvictResponse", False, False),
    "Drain": ("DrainRequest", "DrainResponse", False, False),
}
SET_RPCS = {"AcquireSet": ("AcquireSetRequest", "AcquireSetResponse", False, False)}

ORCH_ENUMS = {
    "GroupStatus.State": [
        ("STATE_UNSPECIFIED", 0),
        ("STATE_UNKNOWN", 1),
        ("STATE_IDLE", 2),
        ("STATE_IDLE_YIELDED", 3),
        ("STATE_LOCKED", 4),
        ("STATE_SWITCHING", 5),
    ],
    "SnapshotAgentJobState.State": [
        ("STATE_UNSPECIFIED", 0),
        ("STATE_IDLE", 1),
        ("STATE_RUNNING", 2),
        ("STATE_TRANSITIONING", 3),
        ("STATE_SAVED", 4),
        ("STATE_FAULTED", 5),
    ],
}

ORCH_RPCS = {
    "Acquire": ("AcquireRequest", "AcquireResponse", False, False),
    "Yield": ("YieldRequest", "YieldResponse", False, False),
    "ListGroups": ("ListGroupsRequest", "ListGroupsResponse", False, False),
    "GetGroupStatus": ("GetGroupStatusRequest", "GetGroupStatusResponse", False, False),
}

_PT = f"{AGENT_PKG}.ProcessTarget"
_MODE = f"{AGENT_PKG}.SuspendMode"
AGENT_MESSAGES: dict[str, dict[str, tuple[int, int, str | None, str | None]]] = {
    "ProcessTarget": {"pids": (1, I32, None, REP)},
    "CudaBackendConfig": {"explicit_target": (1, MSG, _PT, None)},
    "DirectMemoryBackendConfig": {"explicit_target": (1, MSG, _PT, None)},
    "AppEndpointConfig": {
        "app": (1, ENUM, f"{AGENT_PKG}.App", None),
        "endpoints": (2, STR, None, REP),
        "mode": (3, ENUM, _MODE, None),
        "tags": (4, STR, None, REP),
    },
    "AppChannelConfig": {"mode": (1, ENUM, _MODE, None), "tags": (2, STR, None, REP)},
    "MemoryRegion": {
        "pid": (1, I32, None, None),
        "address": (2, U64, None, None),
        "size_bytes": (3, U64, None, None),
    },
    "MemoryRegionsBackendConfig": {
        "regions": (1, MSG, f"{AGENT_PKG}.MemoryRegion", REP),
        "snapshot_name": (2, STR, None, None),
    },
    "BackendConfig": {
        "cuda": (1, MSG, f"{AGENT_PKG}.CudaBackendConfig", None),
        "app_endpoint": (2, MSG, f"{AGENT_PKG}.AppEndpointConfig", None),
        "app_channel": (3, MSG, f"{AGENT_PKG}.AppChannelConfig", None),
        "direct_memory": (4, MSG, f"{AGENT_PKG}.DirectMemoryBackendConfig", None),
        "memory_regions": (5, MSG, f"{AGENT_PKG}.MemoryRegionsBackendConfig", None),
    },
    "WorkloadCapabilities": {
        "supported_modes": (1, ENUM, _MODE, REP),
        "default_mode": (2, ENUM, _MODE, None),
        "tags": (3, STR, None, REP),
    },
    "RegisterWorkload": {
        "job_id": (1, STR, None, None),
        "group": (2, STR, None, None),
        "capabilities": (3, MSG, f"{AGENT_PKG}.WorkloadCapabilities", None),
    },
    "CommandResult": {
        "command_id": (1, STR, None, None),
        "ok": (2, BOOL, None, None),
        "error": (3, STR, None, None),
    },
    "WorkloadMessage": {
        "register": (1, MSG, f"{AGENT_PKG}.RegisterWorkload", None),
        "result": (2, MSG, f"{AGENT_PKG}.CommandResult", None),
    },
    "SnapshotCommand": {"mode": (1, ENUM, _MODE, None), "tags": (2, STR, None, REP)},
    "RestoreCommand": {"tags": (1, STR, None, REP)},
    "AgentCommand": {
        "command_id": (1, STR, None, None),
        "snapshot": (2, MSG, f"{AGENT_PKG}.SnapshotCommand", None),
        "restore": (3, MSG, f"{AGENT_PKG}.RestoreCommand", None),
    },
    "SnapshotRequest": {
        "job_id": (1, STR, None, None),
        "group": (2, STR, None, None),
        "backend": (3, ENUM, f"{AGENT_PKG}.Backend", None),
        "backend_config": (4, MSG, f"{AGENT_PKG}.BackendConfig", None),
    },
    "SnapshotResponse": {"operation_id": (1, STR, None, None)},
    "RestoreRequest": {
        "job_id": (1, STR, None, None),
        "group": (2, STR, None, None),
        "backend": (3, ENUM, f"{AGENT_PKG}.Backend", None),
        "backend_config": (4, MSG, f"{AGENT_PKG}.BackendConfig", None),
    },
    "RestoreResponse": {"operation_id": (1, STR, None, None)},
    "GetOperationRequest": {"operation_id": (1, STR, None, None)},
    "GetOperationResponse": {
        "status": (1, ENUM, f"{AGENT_PKG}.OperationStatus", None),
        "storage_bytes": (2, I64, None, OPT),
        "snapshot_device_bytes": (3, I64, None, OPT),
        "elapsed_ms": (4, I64, None, None),
        "error": (5, STR, None, OPT),
    },
    "StatusRequest": {},
    "JobStatus": {
        "job_id": (1, STR, None, None),
        "state": (2, ENUM, f"{AGENT_PKG}.JobState", None),
    },
    "AcceleratorStatus": {
        "id": (1, STR, None, None),
        "memory_used_bytes": (2, I64, None, None),
        "memory_total_bytes": (3, I64, None, None),
    },
    "StatusResponse": {
        "job_statuses": (1, MSG, f"{AGENT_PKG}.JobStatus", REP),
        "accelerator_statuses": (2, MSG, f"{AGENT_PKG}.AcceleratorStatus", REP),
    },
}

AGENT_ONEOFS = {
    "BackendConfig": (
        "backend",
        {"cuda", "app_endpoint", "app_channel", "direct_memory", "memory_regions"},
    ),
    "WorkloadMessage": ("message", {"register", "result"}),
    "AgentCommand": ("command", {"snapshot", "restore"}),
}

AGENT_ENUMS = {
    "Backend": [("BACKEND_UNSPECIFIED", 0), ("BACKEND_CUDA", 1)],
    "App": [("APP_UNSPECIFIED", 0), ("APP_VLLM", 1), ("APP_SGLANG", 2)],
    "SuspendMode": [
        ("SUSPEND_MODE_UNSPECIFIED", 0),
        ("SUSPEND_MODE_OFFLOAD", 1),
        ("SUSPEND_MODE_DISCARD", 2),
    ],
    "OperationStatus": [
        ("OPERATION_STATUS_UNSPECIFIED", 0),
        ("OPERATION_STATUS_PENDING", 1),
        ("OPERATION_STATUS_COMPLETE", 2),
        ("OPERATION_STATUS_FAILED", 3),
    ],
    "JobState": [
        ("JOB_STATE_UNSPECIFIED", 0),
        ("JOB_STATE_IDLE", 1),
        ("JOB_STATE_RUNNING", 2),
        ("JOB_STATE_TRANSITIONING", 3),
        ("JOB_STATE_SAVED", 4),
        ("JOB_STATE_FAULTED", 5),
    ],
}

AGENT_RPCS = {
    "Snapshot": ("SnapshotRequest", "SnapshotResponse", False, False),
    "Restore": ("RestoreRequest", "RestoreResponse", False, False),
    "GetOperation": ("GetOperationRequest", "GetOperationResponse", False, False),
    "Status": ("StatusRequest", "StatusResponse", False, False),
    "WorkloadChannel": ("WorkloadMessage", "AgentCommand", True, True),
}


def _label(field: d.FieldDescriptor) -> str | None:
    if field.is_repeated:
        return REP
    if (
        field.has_presence
        and field.containing_oneof is not None
        and field.containing_oneof.name.startswith("_")
    ):
        return OPT
    return None


def _check_messages(
    file: d.FileDescriptor,
    package: str,
    expected: dict[str, dict[str, tuple[int, int, str | None, str | None]]],
) -> None:
    assert file.package == package
    for msg_name, fields in expected.items():
        msg = file.pool.FindMessageTypeByName(f"{package}.{msg_name}")
        for fname, (number, ftype, type_name, label) in fields.items():
            field = msg.fields_by_name.get(fname)
            assert field is not None, f"{msg_name}.{fname} missing"
            assert field.number == number, f"{msg_name}.{fname} number {field.number} != {number}"
            assert field.type == ftype, f"{msg_name}.{fname} type changed"
            if type_name is not None:
                target = field.message_type or field.enum_type
                assert target.full_name == type_name, f"{msg_name}.{fname} -> {target.full_name}"
            assert _label(field) == label, f"{msg_name}.{fname} label {_label(field)} != {label}"
        # Additions must be numbered >= 100 so that nothing collides with future upstream fields.
        for field in msg.fields:
            if field.name not in fields:
                assert field.number >= 100, (
                    f"tslice addition {msg_name}.{field.name} must be >= 100"
                )


def _check_enum(
    file: d.FileDescriptor, package: str, name: str, values: list[tuple[str, int]]
) -> None:
    pool = file.pool
    enum = pool.FindEnumTypeByName(f"{package}.{name}")
    assert [(v.name, v.number) for v in enum.values] == values, name


def _check_service(
    file: d.FileDescriptor, package: str, service: str, rpcs: dict[str, tuple[str, str, bool, bool]]
) -> None:
    svc = file.pool.FindServiceByName(f"{package}.{service}")
    for name, (req, resp, client_stream, server_stream) in rpcs.items():
        method = svc.methods_by_name[name]
        assert method.input_type.full_name == f"{package}.{req}"
        assert method.output_type.full_name == f"{package}.{resp}"
        assert method.client_streaming is client_stream, name
        assert method.server_streaming is server_stream, name


def test_orchestrator_messages() -> None:
    _check_messages(opb.DESCRIPTOR, ORCH_PKG, ORCH_MESSAGES)


def test_tslice_orchestrator_additions_keep_their_numbers() -> None:
    pinned = {m: {**ORCH_MESSAGES[m], **extra} for m, extra in TSLICE_ORCH_MESSAGES.items()}
    _check_messages(opb.DESCRIPTOR, ORCH_PKG, pinned)


@pytest.mark.parametrize("name", sorted(ORCH_ENUMS))
def test_orchestrator_enums(name: str) -> None:
    _check_enum(opb.DESCRIPTOR, ORCH_PKG, name, ORCH_ENUMS[name])


def test_orchestrator_service() -> None:
    _check_service(opb.DESCRIPTOR, ORCH_PKG, "TimeSliceOrchestratorService", ORCH_RPCS)


def test_admin_rpcs_messages_and_enums_keep_their_shape() -> None:
    _check_service(opb.DESCRIPTOR, ORCH_PKG, "TimeSliceOrchestratorService", ADMIN_RPCS)
    for name, fields in ADMIN_MESSAGES.items():
        msg = opb.DESCRIPTOR.pool.FindMessageTypeByName(f"{ORCH_PKG}.{name}")
        assert sorted(f.name for f in msg.fields) == sorted(fields), name
    _check_messages(opb.DESCRIPTOR, ORCH_PKG, ADMIN_MESSAGES)
    for name, values in ADMIN_ENUMS.items():
        _check_enum(opb.DESCRIPTOR, ORCH_PKG, name, values)


def test_the_set_acquire_keeps_its_shape_and_needs_the_job_role() -> None:
    from tslice.security import roles

    _check_service(opb.DESCRIPTOR, ORCH_PKG, "TimeSliceOrchestratorService", SET_RPCS)
    for name, fields in SET_MESSAGES.items():
        msg = opb.DESCRIPTOR.pool.FindMessageTypeByName(f"{ORCH_PKG}.{name}")
        assert sorted(f.name for f in msg.fields) == sorted(fields), name
    _check_messages(opb.DESCRIPTOR, ORCH_PKG, SET_MESSAGES)
    for (name, field), (number, type_name) in SET_ON_SESSION.items():
        found = opb.DESCRIPTOR.pool.FindMessageTypeByName(f"{ORCH_PKG}.{name}").fields_by_name
        assert found[field].number == number, (name, field)
        assert found[field].message_type.full_name == type_name, (name, field)
        assert found[field].containing_oneof is not None, (name, field)
    service = f"/{ORCH_PKG}.TimeSliceOrchestratorService/AcquireSet"
    assert roles.ORCHESTRATOR_RULES[service] is roles.Rule.JOB


def test_admin_rpcs_need_the_admin_role() -> None:
    """What a caller without it gets: PERMISSION_DENIED naming the role (tests/security)."""
    from tslice.security import roles

    service = f"/{ORCH_PKG}.TimeSliceOrchestratorService/"
    for name in ADMIN_RPCS:
        assert roles.ORCHESTRATOR_RULES[service + name] is roles.Rule.ADMIN, name


def test_admin_status_codes_keep_their_meaning() -> None:
    """Evict's and Drain's codes as clients branch on them (behaviour: tests/orchestrator/
    test_admin_rpcs.py): an evicted waiter's Acquire ends ABORTED; a job that neither holds
    nor waits, or an unknown group, is NOT_FOUND; an evicted job's later Yield is
    FAILED_PRECONDITION (nobody holds) or PERMISSION_DENIED (another job holds)."""
    from tslice.orchestrator.group import effects as decisions
    from tslice.rpc import refusals

    assert decisions.Abort("j", "m").code is refusals.Code.ABORTED
    numbers = {c: refusals.status_number(c) for c in refusals.Code}
    assert numbers[refusals.Code.ABORTED] == 10
    assert numbers[refusals.Code.NOT_FOUND] == 5
    assert numbers[refusals.Code.FAILED_PRECONDITION] == 9
    assert numbers[refusals.Code.PERMISSION_DENIED] == 7


# tslice additions of the agent the orchestrator relies on (issue 9 §2: prefetch).
TSLICE_AGENT_MESSAGES: dict[str, dict[str, tuple[int, int, str | None, str | None]]] = {
    "RestoreRequest": {"wait_ms": (100, I64, None, None), "prefetch": (101, BOOL, None, None)},
    "AgentFeatures": {
        "grant_step": (1, BOOL, None, None),
        "grant_stream": (2, BOOL, None, None),
        "prefetch": (3, BOOL, None, None),
    },
    # Issue 20 §1: one session per rank of a multi-process job (0 = the only one).
    "RegisterWorkload": {"rank": (104, I32, None, None)},
}


def test_tslice_agent_additions_keep_their_numbers() -> None:
    pinned = {
        m: {**AGENT_MESSAGES.get(m, {}), **extra} for m, extra in TSLICE_AGENT_MESSAGES.items()
    }
    _check_messages(apb.DESCRIPTOR, AGENT_PKG, pinned)


def test_agent_messages() -> None:
    _check_messages(apb.DESCRIPTOR, AGENT_PKG, AGENT_MESSAGES)


@pytest.mark.parametrize("name", sorted(AGENT_ENUMS))
def test_agent_enums(name: str) -> None:
    _check_enum(apb.DESCRIPTOR, AGENT_PKG, name, AGENT_ENUMS[name])


def test_agent_service() -> None:
    _check_service(apb.DESCRIPTOR, AGENT_PKG, "SnapshotAgentService", AGENT_RPCS)


@pytest.mark.parametrize("message", sorted(AGENT_ONEOFS))
def test_agent_oneofs(message: str) -> None:
    oneof_name, members = AGENT_ONEOFS[message]
    msg = apb.DESCRIPTOR.pool.FindMessageTypeByName(f"{AGENT_PKG}.{message}")
    oneof = msg.oneofs_by_name[oneof_name]
    assert members <= {f.name for f in oneof.fields}


def test_deprecated_backend_field_still_on_the_wire() -> None:
    msg = apb.SnapshotRequest.DESCRIPTOR
    assert msg.fields_by_name["backend"].GetOptions().deprecated


def test_wire_md_tables_match_when_available() -> None:
    """Cross-check the message rows of shared/WIRE.md itself, when it sits beside the repo."""
    wire = pathlib.Path(__file__).resolve().parents[2] / "shared" / "WIRE.md"
    if not wire.exists():
        pytest.skip("shared/WIRE.md not beside this checkout")
    row = re.compile(r"^\| (\w+) \| (.+) \|$")
    field = re.compile(r"(\w+) = (\d+) : ")
    checked = 0
    for line in wire.read_text().splitlines():
        m = row.match(line)
        if not m or m.group(1) in ("message", "rpc"):
            continue
        name, spec = m.groups()
        pairs = field.findall(spec)
        if not pairs:
            continue
        for pkg_file, pkg in ((opb.DESCRIPTOR, ORCH_PKG), (apb.DESCRIPTOR, AGENT_PKG)):
            try:
                msg = pkg_file.pool.FindMessageTypeByName(f"{pkg}.{name}")
            except KeyError:
                continue
            for fname, number in pairs:
                assert msg.fields_by_name[fname].number == int(number), f"{name}.{fname}"
                checked += 1
            break
    assert checked > 60


@pytest.mark.parametrize(
    ("file", "service", "upstream"),
    [
        (opb.DESCRIPTOR, f"{ORCH_PKG}.TimeSliceOrchestratorService", ORCH_RPCS),
        (apb.DESCRIPTOR, f"{AGENT_PKG}.SnapshotAgentService", AGENT_RPCS),
    ],
    ids=["orchestrator", "agent"],
)
def test_every_tslice_rpc_is_documented(
    file: d.FileDescriptor, service: str, upstream: dict[str, object]
) -> None:
    api_doc = (pathlib.Path(__file__).parent.parent / "docs" / "api.md").read_text()
    added = [m.name for m in file.pool.FindServiceByName(service).methods if m.name not in upstream]
    assert added, "the wire pin lists every RPC: nothing to check"
    for name in added:
        assert f"`rpc {name}(" in api_doc, f"tslice RPC {name} is not described in docs/api.md"
