"""HA mode's pure parts: the flags' checks (exit 2, naming the fix), the record codec that
keeps a group's state in a ConfigMap, and the ConfigMap names."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import grpc
import pytest

from tests.cli.support import run_cli
from tslice.orchestrator.kube import codec
from tslice.orchestrator.persistence import records

pytest.importorskip("lightkube")

from tslice.orchestrator.kube import state


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--ha", "--local-agent", "127.0.0.1:1"],
            "--ha elects a leader through a Kubernetes Lease .*: add --kubernetes",
        ),
        (["--kubernetes", "--lease-name", "x"], "--lease-name: options of --ha; add --ha"),
        (
            ["--kubernetes", "--ha", "--lease-duration", "3", "--renew-interval", "2"],
            "--renew-interval 2 must be above 0 and well below --lease-duration 3",
        ),
        (["--kubernetes", "--ha", "--advertise-address", "pod"], "is not HOST:PORT"),
    ],
)
def test_bad_ha_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, "orchestrator", *flags)
    assert code == 2
    assert re.search(message, err), err


def test_a_record_round_trips_and_reads_what_another_release_wrote() -> None:
    record = records.LockRecord(
        "job-a",
        "job-a",
        3,
        4,
        7,
        (records.QueueRecord("job-b", 5, 2**33),),
        records.IntentRecord(None, "job-a", 3, 4),
        (("job-a", 2**34),),
        holder_lease_ms=1500,
        draining=True,
        holder_unclaimed_until=1.5e9,
    )
    assert codec.decode(codec.encode(record)) == record
    assert codec.decode(codec.encode(records.LockRecord.empty())) == records.LockRecord.empty()
    # Older (a field missing: its default) and newer (a field unknown: ignored) writers.
    data = json.loads(codec.encode(record))
    del data["draining"]
    data["a_field_of_a_later_release"] = {"x": 1}
    assert codec.decode(json.dumps(data)) == dataclasses.replace(record, draining=False)
    with pytest.raises(ValueError, match="not a lock record"):
        codec.decode('{"holder": null}')


def test_configmap_names_are_dns_names_unique_per_group() -> None:
    names = {state.configmap_name(g) for g in ("trainer", "Trainer", "a_b", "a-b", "x" * 200)}
    assert len(names) == 5
    for name in names:
        assert len(name) <= 63 and name == name.lower() and name[0].isalpha()
        assert set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


async def test_a_follower_refuses_every_call_of_the_service_naming_the_leader() -> None:
    from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
    from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
    from tslice.orchestrator import app, server
    from tslice.orchestrator.kube import leadership
    from tslice.rpc import undecodable

    role = leadership.Leadership(app.SERVICE_NAME, "orch-b")
    role.saw_leader("orch-a", "10.0.0.7:50051")
    grpc_server = grpc.aio.server(
        interceptors=[undecodable.UndecodableRequests(), leadership.FollowerGate(role)]
    )
    methods = [
        m.name for m in opb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"].methods
    ]
    opb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(
        leadership.forwarding(server.OrchestratorServicer, methods, role), grpc_server
    )
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
            session = stub.Session()
            await session.write(opb.SessionRequest(request_id=1))
            calls = {
                "Acquire": stub.Acquire(opb.AcquireRequest(group_id="g", job_id="j")),
                "ListGroups": stub.ListGroups(opb.ListGroupsRequest()),
                "Drain": stub.Drain(opb.DrainRequest(group_id="g")),
                "WatchEvents": _drain(stub.WatchEvents(opb.WatchEventsRequest())),
                "Hold": _drain(stub.Hold(opb.HoldRequest(group_id="g", job_id="j"))),
                "Session": _drain(session),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                error = refused.value
                assert error.code() is grpc.StatusCode.UNAVAILABLE, name
                assert str(error.details()).startswith(
                    f"{name}: this orchestrator replica (orch-b) is a follower; the leader is "
                    "orch-a at 10.0.0.7:50051"
                )
                assert dict(error.trailing_metadata() or ())["x-tslice-leader"] == "10.0.0.7:50051"
    finally:
        await grpc_server.stop(0)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass
