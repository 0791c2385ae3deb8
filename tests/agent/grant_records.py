"""Job records and Grant orders for the planning tests of tslice.agent.moves.grant_plan."""

from __future__ import annotations

from tslice.agent.jobs import model
from tslice.agent.moves import grant_plan

S = model.State
K = model.Kind
TARGET: model.Key = ("j1", "g")


def rec(job_id: str, state: S, group: str = "g", **kw: object) -> model.Job:
    return model.Job(job_id=job_id, group=group, state=state, **kw)  # type: ignore[arg-type]


def records(*found: model.Job) -> dict[model.Key, model.Job]:
    return {j.key: j for j in found}


def order(**kw: object) -> grant_plan.Order:
    args: dict[str, object] = {
        "job_id": "j1",
        "group": "g",
        "epoch": 3,
        "footprint_bytes": 0,
        "config": None,
    }
    args.update(kw)
    return grant_plan.order(**args)  # type: ignore[arg-type]
