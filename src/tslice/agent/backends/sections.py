"""A backend's section of the agent config, validated at the file boundary.

Backends describe their section with a pydantic model (``extra="forbid"``, bounds on
every number) and convert it to their own frozen settings; this module gives every
backend the same error: which field is wrong, why, and where to fix it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import pydantic

from tslice.common import errors

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def validate(model: type[ModelT], settings: Mapping[str, Any], *, backend: str) -> ModelT:
    """Validate ``settings`` against ``model``; a ConfigError names each bad field."""
    try:
        return model.model_validate(dict(settings))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(section)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise invalid(backend, problems) from exc


def invalid(backend: str, problem: str) -> errors.ConfigError:
    """The error for a section that validated but still cannot be used."""
    return errors.ConfigError(
        f"invalid {backend} backend settings: {problem}; fix backend_settings.{backend} "
        "in the agent config"
    )
