"""The ``policy`` sections of the topology and config files (pydantic, validated at
the boundary by ``tslice.orchestrator.config``), and their specs (``spec``).

``policy: priority`` is short for ``policy: {kind: priority}``; job ids in the maps
are checked like every job id; numbers must be numbers (``true`` is no priority level:
pydantic's lax mode took it as 1), finite and in range: a
duration at most :data:`MAX_POLICY_S`, and a priority policy's starvation bound at most
:data:`MAX_STARVATION_S` (``aging_s: 1e308`` made it infinite).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

from tslice.common import validation
from tslice.orchestrator.policy import spec as policy_spec


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


def _job_ids(v: dict[str, Any]) -> dict[str, Any]:
    for job in v:
        validation.check_id("job id", job)
    return v


#: Longest duration a policy takes, seconds (a day: every policy knob is far below it).
MAX_POLICY_S = 86_400.0
#: Longest starvation bound of a priority policy, seconds: ``(P_max - P_min) * aging_s``
#: (how long the lowest level may wait before it passes the highest), 30 days.
MAX_STARVATION_S = 30 * 86_400.0


def _not_a_boolean(v: Any) -> Any:
    # pydantic's lax mode takes true as 1; YAML's 1e308 (a string to YAML 1.1) stays a number.
    if isinstance(v, bool):
        raise ValueError(f"{str(v).lower()} is not a number: write a number")
    return v


_NotBool = pydantic.BeforeValidator(_not_a_boolean)
_Seconds = Annotated[float, _NotBool, pydantic.Field(gt=0, le=MAX_POLICY_S, allow_inf_nan=False)]
_SecondsOr0 = Annotated[float, _NotBool, pydantic.Field(ge=0, le=MAX_POLICY_S, allow_inf_nan=False)]
_Level = Annotated[int, _NotBool, pydantic.Field(ge=-1_000_000, le=1_000_000)]
_Weight = Annotated[float, _NotBool, pydantic.Field(gt=0, allow_inf_nan=False)]
_Number = Annotated[float, _NotBool, pydantic.Field(ge=0, allow_inf_nan=False)]


class FifoModel(_Model):
    kind: Literal["fifo"]


class PriorityModel(_Model):
    kind: Literal["priority"]
    aging_s: _Seconds = 60.0
    priority: dict[str, _Level] = {}
    default_priority: _Level = 0
    _jobs = pydantic.field_validator("priority")(_job_ids)

    @pydantic.model_validator(mode="after")
    def _starvation_bounded(self) -> PriorityModel:
        levels = [self.default_priority, *self.priority.values()]
        bound = (max(levels) - min(levels)) * self.aging_s
        if bound > MAX_STARVATION_S:
            raise ValueError(
                f"a waiter at level {min(levels)} could wait {bound / 86_400:.0f} days before "
                f"it passes level {max(levels)} ((P_max - P_min) x aging_s = {bound:g} s); "
                f"keep it within {MAX_STARVATION_S / 86_400:.0f} days: lower aging_s or "
                "bring the levels closer"
            )
        return self


class FairShareModel(_Model):
    kind: Literal["fair-share"]
    weights: dict[str, _Weight] = {}
    default_weight: _Weight = 1.0
    quantum_s: _Seconds = 1.0
    memory_s: _Seconds = 600.0
    credit_s: _SecondsOr0 = 10.0
    _jobs = pydantic.field_validator("weights")(_job_ids)


class CostAwareModel(_Model):
    kind: Literal["cost-aware"]
    max_defer_s: _Seconds = 30.0
    default_switch_s: _SecondsOr0 = 1.0
    bandwidth_gb_s: _Number = 0.0
    gap_samples: Annotated[int, _NotBool, pydantic.Field(ge=1)] = 2
    gap_patience: Annotated[float, _NotBool, pydantic.Field(gt=0, le=100, allow_inf_nan=False)] = (
        1.5
    )


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
