"""Node views and recovery decisions for the orchestrator's recovery tests."""

from __future__ import annotations

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import recovery
from tslice.orchestrator.switch import plan as steps

R, S, T, F = (
    pb.JOB_STATE_RUNNING,
    pb.JOB_STATE_SAVED,
    pb.JOB_STATE_TRANSITIONING,
    pb.JOB_STATE_FAULTED,
)


def view(**jobs: int) -> steps.NodeView:
    return {j: steps.JobView(state, "g") for j, state in jobs.items()}


def decide(
    resident: str | None, views: list[steps.NodeView], intent: tuple[str | None, str] | None = None
) -> recovery.RecoveryDecision:
    sw = decisions.StartSwitch(intent[0], intent[1], 2, 0, recovered=True) if intent else None
    return recovery.decide_recovery(
        group="g", resident=resident, intent=sw, known_jobs=set(), views=views
    )
