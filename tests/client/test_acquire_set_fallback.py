"""Both clients against an orchestrator without AcquireSet (llm-d's, an older tslice): a
real gRPC server on loopback that has only Acquire and Yield (no Session either, as
llm-d's). ``slice()`` of several groups asks for the set once, then takes its groups
one by one in sorted order; ``acquire_set`` raises UNIMPLEMENTED with what to do; in
no-op mode ``acquire_set`` grants at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import tslice
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import errors
from tslice.rl import Phases


class AcquireAndYieldOnly(opb_grpc.TimeSliceOrchestratorServiceServicer):
    """Grants every Acquire at once and records the calls; AcquireSet is UNIMPLEMENTED
    (what the generated servicer answers, counted here); the rest is left unimplemented."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._guard = threading.Lock()

    def _record(self, method: str, what: str) -> None:
        with self._guard:
            self.calls.append((method, what))

    def Acquire(self, request: opb.AcquireRequest, context: object) -> opb.AcquireResponse:
        self._record("Acquire", request.group_id)
        return opb.AcquireResponse(success=True, grant_epoch=1)

    def Yield(self, request: opb.YieldRequest, context: object) -> opb.YieldResponse:
        self._record("Yield", request.group_id)
        return opb.YieldResponse(success=True, snapshot_deferred=True)

    def AcquireSet(
        self, request: opb.AcquireSetRequest, context: grpc.ServicerContext
    ) -> opb.AcquireSetResponse:
        self._record("AcquireSet", ",".join(request.group_ids))
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        raise AssertionError("abort raises")


@pytest.fixture
def double() -> Iterator[tuple[str, AcquireAndYieldOnly]]:
    servicer = AcquireAndYieldOnly()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    opb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


#: Two slices of groups b and a: the set asked for once, then sorted one by one.
FALLBACK = [
    ("AcquireSet", "a,b"),
    ("Acquire", "a"),
    ("Acquire", "b"),
    ("Yield", "b"),
    ("Yield", "a"),
    ("Acquire", "a"),
    ("Acquire", "b"),
    ("Yield", "b"),
    ("Yield", "a"),
]


def test_sync_slice_falls_back_to_one_by_one_and_remembers(
    double: tuple[str, AcquireAndYieldOnly],
) -> None:
    address, servicer = double
    with tslice.Client(address, job_id="j", lease_s=None) as client:
        for _ in range(2):
            with client.slice("b", "a") as grants:
                assert sorted(grants) == ["a", "b"]
        assert servicer.calls == FALLBACK


async def test_async_slice_falls_back_to_one_by_one_and_remembers(
    double: tuple[str, AcquireAndYieldOnly],
) -> None:
    address, servicer = double
    async with tslice.AsyncClient(address, job_id="j", lease_s=None) as client:
        for _ in range(2):
            async with client.slice("b", "a") as grants:
                assert sorted(grants) == ["a", "b"]
        assert servicer.calls == FALLBACK


def test_weight_sync_falls_back_to_the_trainer_group_first(
    double: tuple[str, AcquireAndYieldOnly],
) -> None:
    address, servicer = double
    with (
        tslice.Client(address, job_id="j", lease_s=None) as client,
        Phases(trainer_group="trainer", sampler_group="sampler", client=client) as phases,
        phases.phase("weight_sync") as grants,
    ):
        assert sorted(grants) == ["sampler", "trainer"]
    # Not sorted: the RL phases' one order for every job, trainer group first.
    assert servicer.calls == [
        ("AcquireSet", "trainer,sampler"),
        ("Acquire", "trainer"),
        ("Acquire", "sampler"),
        ("Yield", "sampler"),
        ("Yield", "trainer"),
    ]


async def test_acquire_set_says_what_to_do_without_the_rpc(
    double: tuple[str, AcquireAndYieldOnly],
) -> None:
    address, servicer = double
    with tslice.Client(address, job_id="j", lease_s=None) as client:
        with pytest.raises(errors.RPCError, match=r"no AcquireSet.*slice\(\)") as caught:
            client.acquire_set(["a", "b"])
        assert caught.value.status is grpc.StatusCode.UNIMPLEMENTED
    async with tslice.AsyncClient(address, job_id="j", lease_s=None) as aclient:
        with pytest.raises(errors.RPCError, match=r"no AcquireSet.*slice\(\)"):
            await aclient.acquire_set(["a", "b"])
    assert [method for method, _ in servicer.calls] == ["AcquireSet", "AcquireSet"]


async def test_acquire_set_in_no_op_mode_grants_at_once() -> None:
    with tslice.Client(job_id="j") as client:
        granted = client.acquire_set(["b", "a", "b"])
    async with tslice.AsyncClient(job_id="j") as aclient:
        assert await aclient.acquire_set(["b", "a"]) == granted
    assert list(granted) == ["b", "a"]
    assert all(result.success and result.grant_epoch == 0 for result in granted.values())
