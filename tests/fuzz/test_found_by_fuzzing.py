"""What the fuzz runs found, each pinned by a test on the real servers.

Each failed before its fix.
"""

from __future__ import annotations

import grpc
import pytest

from tests.fuzz import calls
from tests.fuzz.conftest import Served
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import validation


@pytest.mark.parametrize("value", ["job-a\n", "a\n"])
def test_an_id_with_a_trailing_newline_is_malformed(value: str) -> None:
    with pytest.raises(validation.InvalidIdError, match="malformed"):
        validation.check_id("job_id", value)


def test_the_orchestrator_refuses_a_job_id_with_a_trailing_newline(orchestrator: Served) -> None:
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(orchestrator.channel)
    request = opb.AcquireRequest(job_id="job-a\n", group_id="newline")
    try:
        stub.Acquire(request, timeout=calls.PROMPT_S)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    else:
        stub.Yield(opb.YieldRequest(job_id="job-a\n", group_id="newline"), timeout=calls.PROMPT_S)
        pytest.fail("job 'job-a\\n' (a different job from 'job-a') was granted the group")


def test_the_agent_refuses_a_group_with_a_trailing_newline(agent: Served) -> None:
    stub = pb_grpc.SnapshotAgentServiceStub(agent.channel)
    grant = pb.GrantRequest(
        job_id="newline", group="g\n", grant_epoch=1, backend_config=pb.BackendConfig(noop={})
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Grant(grant, timeout=calls.PROMPT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_a_registration_without_group_for_a_job_in_two_groups_fails_no_task(
    agent: Served,
) -> None:
    """A workload may register without a group (llm-d's clients do); for a job the
    agent has records of in two groups, that names none of them. The agent must not
    fail on it: its registration task raised FAILED_PRECONDITION ("name the group in the
    request") into the void, logged as a crashed task."""
    stub = pb_grpc.SnapshotAgentServiceStub(agent.channel)
    for group in ("two-groups-1", "two-groups-2"):
        grant = pb.GrantRequest(
            job_id="two-groups",
            group=group,
            grant_epoch=1,
            backend_config=pb.BackendConfig(noop={}),
        )
        stub.Grant(grant, timeout=calls.PROMPT_S)
    register = pb.WorkloadMessage(register=pb.RegisterWorkload(job_id="two-groups"))
    # Registered, then the stream half-closes: the agent handled the registration first.
    answer = calls.exchange(stub.WorkloadChannel, "WorkloadChannel", [register])
    answer.check()
    # A call after it: the registration's task has run by the time this is answered.
    stub.Status(pb.StatusRequest(), timeout=calls.PROMPT_S)
    assert "task channel-registration-two-groups failed" not in agent.server.logs()
