"""tslice inside Ray actors (veRL, OpenRLHF and other frameworks that run on Ray).

A tslice client owns a gRPC channel and threads of the process that made it, so it
cannot travel to an actor: the driver sends the *settings* and each actor makes its
own client. ::

    import ray
    import tslice.rl.ray

    # driver: what every actor of the job needs, from the driver's environment
    # (TSLICE_* / TIMESLICE_*), overridden by the arguments
    env = tslice.rl.ray.env_vars(job_id="job-a")
    trainer = Trainer.options(
        runtime_env={"env_vars": {**env, "TSLICE_ROLE": "trainer"}}
    ).remote()

    @ray.remote
    class Trainer:
        def __init__(self):
            self.phases = tslice.rl.ray.phases()      # made here, in the actor's process

        def train(self, batch):
            with self.phases.phase("train"):
                ...

Each GPU worker process is announced to its node agent (:func:`announce_gpu_worker`:
the actors Ray gave GPUs, with the job id and the group of their role), so that the
``cuda`` backend finds them; :func:`phases` does it for its actor, and so does veRL in
each of its workers. Call it in the ``__init__`` of any other GPU actor of the job.

:func:`phases` and :func:`client` return one object per process, made on first use
and closed at a normal exit (a killed process's groups go when its lease runs out), so
that an actor's methods (and the tasks that reuse a worker process) share one channel.
A process that forks gets its own. An actor that Ray restarts is a new process: it
makes a new client, and the groups its previous incarnation held stay with the job
until the new one re-enters a phase (granted at once: the job still holds them) or
the lease runs out (``$TSLICE_LEASE_S``, 30 s).

Ray itself is not imported by this module (only asked, when it is already loaded,
whether the actor was restarted, for the log).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import warnings
from collections.abc import Mapping

from tslice.client import Client
from tslice.common import errors, validation
from tslice.rl import _announce, _workload, roles, settings
from tslice.rl import phases as _phases

#: Announce this process to the node agent as one of the job's GPU processes (for the
#: ``cuda`` backend); :func:`phases` does it, veRL's workers do it when verl loads.
announce_gpu_worker = _announce.announce_gpu_worker

log = logging.getLogger("tslice.rl.ray")

#: The client's own variables (docs/client.md), forwarded as they are.
CLIENT_ENV: tuple[str, ...] = (
    "TSLICE_ORCHESTRATOR",
    "TIMESLICE_ORCH_ADDR",
    "TSLICE_JOB_ID",
    "TIMESLICE_JOB_ID",
    "TSLICE_DISABLED",
    "TSLICE_LEASE_S",
    "TSLICE_CONNECT_TIMEOUT_S",
    # the cuda backend's registration socket (tslice.workload.process.announce_process)
    "TSLICE_AGENT_REGISTER_SOCKET",
)

#: Every variable :func:`env_vars` forwards from the driver's environment.
FORWARDED_ENV: tuple[str, ...] = (
    *CLIENT_ENV,
    *settings.TRAINER_GROUP_ENV,
    *settings.SAMPLER_GROUP_ENV,
    *settings.GROUP_ENV,
    *settings.ROLE_ENV,
    *settings.AGENT_ENV,
)


def env_vars(
    job_id: str | None = None,
    *,
    address: str | None = None,
    trainer_group: str | None = None,
    sampler_group: str | None = None,
    group: str | None = None,
    role: roles.Role | str | None = None,
    agent: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``runtime_env={"env_vars": ...}`` that lets an actor's tslice find its job.

    The tslice variables of ``environ`` (default: this process's environment; see
    :data:`FORWARDED_ENV`), then the arguments, each written in both spellings
    (tslice's ``TSLICE_*`` and llm-d's ``TIMESLICE_*``) so that no stale variable of
    the actor's own environment wins. ``group`` is a colocated job's only group (both
    pools on the same GPUs, as in veRL's hybrid engine). Ids are checked here, in the
    driver, so that a typo fails before any actor starts.
    """
    source = os.environ if environ is None else environ
    env = {name: source[name] for name in FORWARDED_ENV if source.get(name, "").strip()}
    if job_id is not None:
        _check("job id", job_id, "job_id")
        env["TSLICE_JOB_ID"] = env["TIMESLICE_JOB_ID"] = job_id
    if address is not None:
        if not address.strip():
            raise errors.ConfigError("address= is empty: give the orchestrator as host:port")
        env["TSLICE_ORCHESTRATOR"] = env["TIMESLICE_ORCH_ADDR"] = address.strip()
    for pool, pool_group, names in (
        (roles.Pool.TRAINER, trainer_group, settings.TRAINER_GROUP_ENV),
        (roles.Pool.SAMPLER, sampler_group, settings.SAMPLER_GROUP_ENV),
    ):
        if pool_group is not None:
            _check("group", pool_group, f"{pool}_group")
            env.update(dict.fromkeys(names, pool_group))
    if group is not None:
        _check("group", group, "group")
        env.update(dict.fromkeys(settings.GROUP_ENV, group))
    if role is not None:
        env[settings.ROLE_ENV[0]] = roles.parse_role(role).value
    if agent is not None:
        env.update(dict.fromkeys(settings.AGENT_ENV, agent.strip()))
    return env


def _check(kind: str, value: str, argument: str) -> None:
    try:
        validation.check_id(kind, value)
    except validation.InvalidIdError as err:
        raise errors.ConfigError(f"{argument}=: {err}") from None


# -- one client, one Phases per process ------------------------------------------------


@dataclasses.dataclass
class _Process:
    pid: int
    client: Client
    phases: _phases.Phases | None = None
    #: What the Phases was made with (besides its role), to refuse a later call that
    #: asks for another.
    made_with: tuple[object, ...] = ()


class _Slot:
    """This process's :class:`_Process` (``current``), behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: _Process | None = None
        self.atexit_registered = False

    def get(self) -> _Process:
        """The process state, made (or remade after a fork); ``lock`` is held."""
        if self.current is None or self.current.pid != os.getpid():
            self.current = _Process(pid=os.getpid(), client=Client())
            if not self.atexit_registered:
                atexit.register(close)
                self.atexit_registered = True
        return self.current


_slot = _Slot()


def client() -> Client:
    """This process's :class:`~tslice.Client`, made from the environment on first use.

    In no-op mode (no orchestrator configured) it is a disabled client, as
    ``tslice.Client()`` would be.
    """
    with _slot.lock:
        return _slot.get().client


def phases(
    role: roles.Role | str | None = None,
    *,
    timeout: float | None = None,
    workload: object | None = None,
    agent: str | None = None,
    register_timeout: float | None = _workload.DEFAULT_REGISTER_TIMEOUT_S,
) -> _phases.Phases:
    """This process's :class:`~tslice.rl.Phases` (on :func:`client`), made on first use.

    The first call configures it (:meth:`Phases.from_env <tslice.rl.Phases.from_env>`:
    ``role`` else ``$TSLICE_ROLE`` else colocated; the groups from the environment);
    later calls without arguments, or with the same ones, return it. One process plays
    one role: asking for another is a :class:`~tslice.ConfigError`.
    """
    others = (timeout, None if workload is None else id(workload), agent, register_timeout)
    defaults = (None, None, None, _workload.DEFAULT_REGISTER_TIMEOUT_S)
    with _slot.lock:
        state = _slot.get()
        if state.phases is None:
            state.phases = _phases.Phases.from_env(
                role,
                client=state.client,
                timeout=timeout,
                workload=workload,
                agent=agent,
                register_timeout=register_timeout,
            )
            state.made_with = others
            _say_if_restarted(state.phases)
            if state.phases.enabled:
                # This actor may hold the job's GPU state itself (a trainer actor).
                announce_gpu_worker(job_id=state.phases.job_id)
        elif (role is not None and roles.parse_role(role) is not state.phases.role) or (
            others not in (defaults, state.made_with)
        ):
            raise errors.ConfigError(
                f"this process already has its Phases ({state.phases!r}); call "
                "tslice.rl.ray.phases() without arguments to get it (one process plays one "
                "role), or tslice.rl.ray.close() first to make another"
            )
        return state.phases


def close() -> None:
    """End this process's open phases and close its Phases and client (idempotent;
    also run at exit). The next :func:`phases` or :func:`client` makes new ones."""
    with _slot.lock:
        state, _slot.current = _slot.current, None
    if state is None or state.pid != os.getpid():
        return  # inherited across a fork: the parent's channel is not ours to close
    try:
        if state.phases is not None:
            state.phases.close()
    finally:
        state.client.close()


def _say_if_restarted(made: _phases.Phases) -> None:
    """Log when Ray restarted this actor: the holds of its previous incarnation are
    still the job's (see the module docstring)."""
    ray = sys.modules.get("ray")
    if ray is None or not made.enabled:
        return
    try:
        with warnings.catch_warnings():  # Ray's own property uses a deprecated one inside
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in an actor, Ray not initialised, an older Ray...
        return
    if restarted:
        log.info(
            "tslice: this actor was restarted; groups of job %r that its previous "
            "incarnation held stay held until this one re-enters a phase or the lease runs out",
            made.job_id,
        )
