"""A GPU worker of an RL job tells its node agent "this process is job X's" (cuda backend).

Why: the ``cuda`` backend checkpoints a job's processes, and it knows them only if they
announce themselves (:func:`tslice.workload.process.announce_process`, the PID taken
from the Unix socket's peer credentials). In a Ray job the GPU state lives in the worker
actors (FSDP or Megatron ranks, rollout engines), not in the process that reports the
phases, so each GPU worker announces itself: :func:`tslice.rl.ray.announce_gpu_worker`,
called by :func:`tslice.rl.ray.phases` and, for veRL, when verl loads its plugins in each
worker process (``import verl`` imports :mod:`tslice.rl.verl`).

Which processes: inside Ray, only those Ray gave GPUs (a controller, the TaskRunner,
Ray's daemons hold none: announcing them would only make the agent skip them); outside
Ray, whoever calls. Which job and group: ``$TSLICE_JOB_ID`` (or ``$TIMESLICE_JOB_ID``);
the group from ``$TSLICE_GROUP`` (a colocated job's one group), else the pool of
``$TSLICE_ROLE`` (``trainer``/``sampler``), else none (the agent matches the process to
a group by the devices it holds memory on). Nothing happens without a job id, with
tslice disabled, or where no agent listens on this node (said once in the log): a job
moved by another backend never needs it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

from tslice.common import errors
from tslice.rl import roles, settings
from tslice.workload import process

log = logging.getLogger("tslice.rl")

_JOB_ENV = ("TSLICE_JOB_ID", "TIMESLICE_JOB_ID")
_lock = threading.Lock()
#: pid of this process → what was announced (the agent's answer), so that it is done once.
_done: dict[int, int | None] = {}


def ray_gpu_ids() -> list[str] | None:
    """The GPUs Ray gave this worker process; None where Ray is not running here."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            context = ray.get_runtime_context()
            if hasattr(context, "get_accelerator_ids"):
                ids = context.get_accelerator_ids().get("GPU", [])
            else:
                ids = ray.get_gpu_ids()
    except Exception:  # an older Ray, or not a worker: cannot tell
        return None
    return [str(i) for i in ids]


def group_from_env() -> str:
    """The group this worker's state belongs to, from the environment ('' = not said)."""
    colocated = settings.env_group(settings.GROUP_ENV)
    if colocated:
        return colocated
    role = settings.first_env(settings.ROLE_ENV)
    if role is not None:
        pool = {
            roles.Role.TRAINER.value: settings.TRAINER_GROUP_ENV,
            roles.Role.SAMPLER.value: settings.SAMPLER_GROUP_ENV,
        }.get(role[1].strip().lower())
        if pool is not None:
            return settings.env_group(pool) or ""
    return ""


def announce_gpu_worker(
    *, job_id: str | None = None, group: str | None = None, only_in_ray: bool = False
) -> int | None:
    """Announce this process to the node agent as one of ``job_id``'s GPU processes.

    Returns the PID the agent recorded, or None where nothing was announced (not a GPU
    worker, no job id, tslice disabled, no agent on this node; ``only_in_ray``: not a
    Ray worker). Once per process; never raises (a worker must not fail because its
    agent is elsewhere).
    """
    if only_in_ray and not ray_gpu_ids():
        return None
    pid = os.getpid()
    with _lock:
        if pid in _done:
            return _done[pid]
        try:
            answer = _announce(job_id, group)
        except errors.TsliceError as err:  # a bad group id in the environment
            log.warning("tslice: this GPU worker was not announced: %s", err)
            answer = None
        _done[pid] = answer
        return answer


def _announce(job_id: str | None, group: str | None) -> int | None:
    if os.environ.get("TSLICE_DISABLED", "").strip().lower() in ("1", "true", "yes"):
        return None
    found = settings.first_env(_JOB_ENV)
    job = job_id or (found[1] if found else "")
    if not job:
        return None
    gpus = ray_gpu_ids()
    if gpus is not None and not gpus:
        return None  # a Ray process without GPUs: nothing of the job's state is here
    chosen = group if group is not None else group_from_env()
    try:
        recorded = process.announce_process(job, group=chosen)
    except process.RegistrationError as err:
        log.info("tslice: this GPU worker was not announced to a node agent: %s", err)
        return None
    log.info(
        "tslice: GPU worker announced to the node agent (job %r, group %r, pid %d)",
        job,
        chosen,
        recorded,
    )
    return recorded
