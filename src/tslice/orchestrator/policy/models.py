"""The ``policy`` sections of the topology and config files (pydantic, validated at
the boundary by ``tslice.orchestrator.config``), and their specs (``spec``).

``policy: priority`` is short for ``policy: {kind: priority}``; job ids in the maps
are checked like every job id; numbers must be finite and in range.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

from tslice.common import ids
from tslice.orchestrator.policy import spec as policy_spec


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


def _job_ids(v: dict[str, Any]) -> dict[str, Any]:
    for job in v:
        ids.check_id("job id", job)
    return v


_Seconds = Annotated[float, pydantic.Field(gt=0, allow_inf_nan=False)]
_Level = Annotated[int, pydantic.Field(ge=-1_000_000, le=1_000_000)]
_Weight = Annotated[float, pydantic.Field(gt=0, allow_inf_nan=False)]


class FifoModel(_Model):
    kind: Literal["fifo"]


class PriorityModel(_Model):
    kind: Literal["priority"]
    aging_s: _Seconds = 60.0
    priority: dict[str, _Level] = {}
    default_priority: _Level = 0
    _jobs = pydantic.field_validator("priority")(_job_ids)


class FairShareModel(_Model):
    kind: Literal["fair-share"]
    weights: dict[str, _Weight] = {}
    default_weight: _Weight = 1.0
    quantum_s: _Seconds = 1.0
    memory_s: _Seconds = 600.0
    credit_s: float = pydantic.Field(10.0, ge=0, allow_inf_nan=False)
    _jobs = pydantic.field_validator("weights")(_job_ids)


class CostAwareModel(_Model):
    kind: Literal["cost-aware"]
    max_defer_s: _Seconds = 30.0
    default_switch_s: float = pydantic.Field(1.0, ge=0, allow_inf_nan=False)
    bandwidth_gb_s: float = pydantic.Field(0.0, ge=0, allow_inf_nan=False)
    gap_samples: int = pydantic.Field(2, ge=1)
    gap_patience: float = pydantic.Field(1.5, gt=0, le=100, allow_inf_nan=False)


def _policy_shorthand(v: Any) -> Any:
    """``policy: priority`` means ``policy: {kind: priority}``; an unknown kind is named."""
    v = {"kind": v} if isinstance(v, str) else v
    kinds = ", ".join(policy_spec.KINDS)
    if not isinstance(v, dict):
        raise ValueError(f"write `policy: KIND` or `policy: {{kind: KIND, ...}}` (KIND: {kinds})")
    if "kind" not in v:
        raise ValueError(f"the policy needs a `kind` (one of: {kinds})")
    if v["kind"] not in policy_spec.KINDS:
        raise ValueError(f"unknown policy kind {v['kind']!r}; use one of: {kinds}")
    return v


PolicyModel = Annotated[
    FifoModel | PriorityModel | FairShareModel | CostAwareModel,
    pydantic.Field(discriminator="kind"),
    pydantic.BeforeValidator(_policy_shorthand),
]


def spec_of(
    model: FifoModel | PriorityModel | FairShareModel | CostAwareModel | None,
) -> policy_spec.PolicySpec:
    """The validated policy section as the orchestrator's spec (None: FIFO)."""
    if isinstance(model, PriorityModel):
        return policy_spec.PrioritySpec(model.aging_s, dict(model.priority), model.default_priority)
    if isinstance(model, FairShareModel):
        return policy_spec.FairShareSpec(
            dict(model.weights),
            model.default_weight,
            model.quantum_s,
            model.memory_s,
            model.credit_s,
        )
    if isinstance(model, CostAwareModel):
        return policy_spec.CostAwareSpec(
            model.max_defer_s,
            model.default_switch_s,
            model.bandwidth_gb_s * 1e9,
            model.gap_samples,
            model.gap_patience,
        )
    return policy_spec.FifoSpec()
