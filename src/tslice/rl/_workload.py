"""The ``workload=`` hook of :class:`~tslice.rl.Phases`: register adapters with the agent.

A workload adapter (``TorchAdapter``, an engine adapter, callbacks) is registered
over the workload channel for the group whose devices hold its state, so that the
node agent can offload it when another job takes that group and bring it back at
the next grant. One adapter goes to the role's own pool; a colocated job with two
distinct groups says which state is on which by a mapping
``{"trainer": adapter, "sampler": adapter}``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
from typing import Any

from tslice.common import errors
from tslice.rl import roles, settings

#: How long construction waits for the agent to acknowledge a registration.
DEFAULT_REGISTER_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Registration:
    group: str
    workload: object


def plan(
    workload: object | None, role: roles.Role, pools: dict[roles.Pool, str]
) -> list[Registration]:
    """Which adapter registers for which group; a clear error when it is ambiguous."""
    if workload is None:
        return []
    if isinstance(workload, collections.abc.Mapping):
        by_pool = _by_pool(workload, pools)
    else:
        by_pool = {_home_pool(role, pools): workload}
    registrations: dict[str, Registration] = {}
    for pool, adapter in by_pool.items():
        group = pools[pool]
        known = registrations.get(group)
        if known is not None and known.workload is not adapter:
            raise errors.ConfigError(
                f"workload= gives two different adapters for group {group!r} (the trainer and "
                "sampler pools are the same group); the agent keeps one per (job, group): "
                "give one adapter that covers both"
            )
        registrations[group] = Registration(group, adapter)
    return list(registrations.values())


def _by_pool(
    workload: collections.abc.Mapping[Any, object], pools: dict[roles.Pool, str]
) -> dict[roles.Pool, object]:
    by_pool: dict[roles.Pool, object] = {}
    for key, adapter in workload.items():
        try:
            pool = roles.Pool(key)
        except ValueError:
            raise errors.ConfigError(
                f"workload= key {key!r} is not a pool; use 'trainer' and/or 'sampler'"
            ) from None
        if pool not in pools:
            raise errors.ConfigError(
                f"workload= names the {pool} pool, but this job has no {pool} group "
                f"(pass {pool}_group= or set "
                f"{settings.env_names(_GROUP_ENV[pool])})"
            )
        by_pool[pool] = adapter
    return by_pool


_GROUP_ENV = {
    roles.Pool.TRAINER: settings.TRAINER_GROUP_ENV,
    roles.Pool.SAMPLER: settings.SAMPLER_GROUP_ENV,
}


def _home_pool(role: roles.Role, pools: dict[roles.Pool, str]) -> roles.Pool:
    if role is roles.Role.TRAINER:
        return roles.Pool.TRAINER
    if role is roles.Role.SAMPLER:
        return roles.Pool.SAMPLER
    if len(set(pools.values())) > 1:
        raise errors.ConfigError(
            "a colocated job with two groups "
            f"({pools[roles.Pool.TRAINER]!r}, {pools[roles.Pool.SAMPLER]!r}) must say which "
            "state lives on which: workload={'trainer': adapter, 'sampler': adapter}"
        )
    return roles.Pool.TRAINER


def agent_address(agent: str | None) -> str:
    """The agent to register with: ``agent``, else the first of :data:`settings.AGENT_ENV`."""
    if agent is not None and agent.strip():
        return agent.strip()
    found = settings.first_env(settings.AGENT_ENV)
    if found is None:
        raise errors.ConfigError(
            "workload= needs the node agent's address: pass agent='127.0.0.1:9001' (or "
            f"'unix:/path/agent.sock') or set {settings.env_names(settings.AGENT_ENV)}"
        )
    return found[1]


def local_rank() -> int:
    """Which of the job's processes on this node this one is: ``$LOCAL_RANK`` (torchrun,
    accelerate, DeepSpeed and veRL's workers set it), else 0. Each rank registers its own
    workload; the agent moves all of a job's ranks on a node at once."""
    raw = os.environ.get("LOCAL_RANK", "").strip()
    if not raw:
        return 0
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if rank < 0:
        raise errors.ConfigError(
            f"LOCAL_RANK={raw!r} is not a process's rank on its node (0, 1, ...); fix or "
            "unset it (one process per job and node needs none)"
        )
    return rank


class Registrations:
    """The workload handles of one Phases: started together, waited for, closed."""

    def __init__(self, *, agent: str, job_id: str, planned: list[Registration]) -> None:
        self.agent = agent
        self.job_id = job_id
        self.planned = planned
        self.handles: list[Any] = []

    def start(self) -> None:
        # Imported here: tslice.rl without workload= never loads the workload layer.
        from tslice.workload import register_workload

        try:
            for item in self.planned:
                self.handles.append(
                    register_workload(
                        self.agent,
                        self.job_id,
                        item.group,
                        workload=item.workload,
                        rank=local_rank(),
                    )
                )
        except BaseException:
            self.close()
            raise

    def wait(self, timeout: float | None) -> None:
        """Block until the agent acknowledged every registration (``None``: do not wait)."""
        if timeout is None:
            return
        for handle in self.handles:
            if not handle.wait_registered(timeout=timeout):
                why = handle.error or "no acknowledgement"
                self.close()
                raise errors.ConfigError(
                    f"the node agent at {self.agent} did not accept the workload of job "
                    f"{self.job_id!r} for group {handle.group!r} within {timeout:g} s ({why}); "
                    "check the agent address and that the agent runs the app-channel backend "
                    "(register_timeout=None skips this check, e.g. against llm-d's agent, "
                    "which never acknowledges)"
                )

    def close(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.close()
