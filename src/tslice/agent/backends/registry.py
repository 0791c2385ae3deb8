"""Backend names resolved to classes through one explicit dict, loaded lazily.

Names map to ``"module:Class"`` strings so that importing the agent never imports
CUDA bindings or torch; a backend's module is imported only when it is enabled.
Callers (tests, the embedded mode) may pass their own mapping, or backend instances
directly, which bypass the registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tslice.agent.backends import base
from tslice.common import errors

if TYPE_CHECKING:
    from tslice.agent.backends import services

BUILTIN: Mapping[str, str] = {
    "noop": "tslice.agent.backends.noop:NoopBackend",
    "sim": "tslice.agent.backends.sim:SimBackend",
    "cuda": "tslice.agent.backends.cuda:CudaBackend",
    "app-endpoint": "tslice.agent.backends.app_endpoint:AppEndpointBackend",
    "app-channel": "tslice.agent.backends.app_channel:AppChannelBackend",
}

#: Optional extra that provides a backend's third-party imports.
_EXTRAS: Mapping[str, str] = {"cuda": "gpu"}


def load_class(name: str, *, registry: Mapping[str, str] = BUILTIN) -> type[base.Backend]:
    """Import and return the backend class registered as ``name``."""
    try:
        target = registry[name]
    except KeyError:
        raise errors.ConfigError(
            f"unknown backend {name!r}; choose one of: {', '.join(sorted(registry))}"
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
    except (ImportError, AttributeError) as err:
        extra = _EXTRAS.get(name)
        hint = f"; install its extra: pip install 'tslice[{extra}]'" if extra else ""
        raise errors.ConfigError(
            f"backend {name!r} could not be loaded from {target} "
            f"({type(err).__name__}: {err}){hint}"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, base.Backend)):
        raise errors.ConfigError(f"backend {name!r}: {target} is not a Backend subclass")
    return cls


def create(
    name: str,
    *,
    settings: Mapping[str, Any],
    node_services: services.NodeServices | None = None,
    registry: Mapping[str, str] = BUILTIN,
) -> base.Backend:
    """Build the backend ``name`` from its settings and, in the agent, the node's services.

    Bad settings become a ConfigError. Without ``node_services`` (tools, tests) the
    backend is built from its settings alone (``Backend.create``).
    """
    cls = load_class(name, registry=registry)
    try:
        if node_services is None:
            return cls.create(settings)
        return cls.create_on_node(settings, node_services)
    except base.BackendUnavailableError as err:
        raise errors.ConfigError(f"backend {name!r} cannot run on this node: {err}") from err
    except (TypeError, ValueError) as err:
        raise errors.ConfigError(
            f"invalid settings for backend {name!r} ({err}); fix its section in the agent config"
        ) from err
