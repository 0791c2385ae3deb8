"""Which backend serves a request on a job, and with which config (pure, no I/O).

A request may name its backend (a ``backend_config`` arm, or llm-d's deprecated
``backend`` enum); otherwise the job's records decide: the backend holding its state,
its recorded choice, the workload channel it registered on, the backend that last
served it, and finally the node default. The result is a :class:`model.Route`, which
the state rules (``tslice.agent.jobs.rules``) take as a fact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tslice.agent.jobs import model
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.rpc import refusals

BACKEND_BY_ARM: Mapping[str, str] = {
    "cuda": "cuda",
    "app_endpoint": "app-endpoint",
    "app_channel": "app-channel",
    "sim": "sim",
    "noop": "noop",
}
_UNSUPPORTED_ARMS = ("direct_memory", "memory_regions")


def requested_backend(
    config: pb.BackendConfig | None, *, deprecated_backend: int = 0
) -> str | None:
    """The backend a request names explicitly, or ``None`` if it leaves the choice to the agent."""
    arm = config.WhichOneof("backend") if config is not None else None
    if arm in _UNSUPPORTED_ARMS:
        raise refusals.Refused(
            refusals.Code.FAILED_PRECONDITION,
            f"backend_config.{arm} is not supported by this agent; use one of "
            f"{', '.join(sorted(BACKEND_BY_ARM))} (or send no backend_config for the node default)",
        )
    if arm is not None:
        return BACKEND_BY_ARM[arm]
    if deprecated_backend == pb.BACKEND_CUDA:
        return "cuda"
    return None


def route(
    *,
    request_config: pb.BackendConfig | None,
    deprecated_backend: int = 0,
    job: model.Job | None,
    channel_registered: bool,
    default_backend: str,
) -> model.Route:
    """Pick the backend for a request on ``job``.

    Precedence: the request's explicit choice; the backend holding a SAVED, FAULTED or
    TRANSITIONING job's state (it alone can bring it back); the job's recorded choice;
    the workload channel, if the job registered there; the backend that last served
    the job; the node default.
    """
    explicit = (
        requested_backend(request_config, deprecated_backend=deprecated_backend)
        if request_config is not None or deprecated_backend
        else None
    )
    if explicit is not None:
        has_arm = request_config is not None and request_config.WhichOneof("backend") is not None
        config = request_config if has_arm else None
        return model.Route(backend=explicit, config=config, explicit=True, record=True)
    if job is not None:
        holding = (
            model.State.SAVED,
            model.State.FAULTED,
            model.State.TRANSITIONING,
        )
        if job.backend and job.state in holding:
            same = job.choice == job.backend
            return model.Route(backend=job.backend, config=job.backend_config() if same else None)
        if job.choice:
            return model.Route(backend=job.choice, config=job.backend_config())
    if channel_registered:
        return model.Route(backend="app-channel", config=None, record=True)
    if job is not None and job.backend:
        return model.Route(backend=job.backend, config=None)
    return model.Route(backend=default_backend, config=None)


def not_enabled(backend: str, *, enabled: Iterable[str], node: str) -> refusals.Refused:
    """The refusal of a request for a backend the node does not run."""
    names = sorted(enabled)
    return refusals.Refused(
        refusals.Code.FAILED_PRECONDITION,
        f"backend {backend!r} is not enabled on node {node} (enabled: {', '.join(names)}); "
        f"start the agent with --backend {backend} or list it under `backends:` in its config",
    )
