"""Who may register a workload on an agent's workload channel: the process behind a
registration, the job credential a TCP registration needs, and in Kubernetes mode the
pod it runs in.

gRPC reports a Unix-socket peer as ``unix:`` with no credentials, so the process behind a
registration is learnt from the agent's register socket (``tslice.agent.channel.registration``,
passed in as :class:`Bindings`):
the workload binds its random instance token there (the kernel says which process sent
it, ``SO_PEERCRED``) and presents the token on the stream. The rules:

- **Unix socket** (the agent runs with a registry): the token must be bound, to the job
  and group registered, by a process that is still alive; the session's pid is that
  process's. Where the agent knows the job's processes, the binding was refused unless
  the process is one of them (or a child). A stream without a bound token is refused
  with UNAUTHENTICATED naming the fix. In Kubernetes mode (``pod_check``) the bound
  process must also be in a pod of this node labelled for the job (and group) it
  claims (:func:`pod_refusal`; the agent looks the pod up), else PERMISSION_DENIED.
- **TCP**: the registration's ``pid`` field is never trusted (the session's pid is 0
  unless the token is bound). With authentication on, the hub is given ``credentials``
  (``tslice.security.roles.job_credentials``: the job ids the call's verified principal may
  act as; its interceptor admits only the job role here) and the registered job must be
  among them (PERMISSION_DENIED otherwise). Over the Unix socket no credential is needed:
  the socket's file mode decides who may connect, the binding names the process. With
  authentication off, TCP means: anyone who can reach the port may register a workload
  for a job that has none live; a live one is never replaced
  (``tslice.agent.channel``), and nothing about its process is known.

What this needs of the agent comes in as Protocols (:class:`Bindings`, :class:`Pod`): this
package imports nothing of the agent.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Collection
from typing import Any, NoReturn, Protocol

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import validation

#: Given a call, the job ids its credential may act as; ``None`` = authentication is off.
#: (It may abort the call itself, e.g. UNAUTHENTICATED for a missing credential.)
Context = grpc.aio.ServicerContext[Any, Any]
JobCredentials = Callable[[Context], "Collection[str] | Awaitable[Collection[str] | None] | None"]
#: Given ``(pid, job, group)``, why that process may not register so (None: it may).
PodCheck = Callable[[int, str, str], "str | None"]


class Binding(Protocol):
    """A workload's instance token bound to the process that presented it."""

    @property
    def job_id(self) -> str: ...
    @property
    def group(self) -> str: ...
    @property
    def pid(self) -> int: ...


class Bindings(Protocol):
    """The agent's register socket: which process bound an instance token (if alive)."""

    def channel_binding(self, instance: str) -> Binding | None: ...


class Pod(Protocol):
    """A pod of the agent's node, as Kubernetes mode knows it."""

    @property
    def key(self) -> str: ...  # ``namespace/name``
    @property
    def job(self) -> str: ...  # its job label
    @property
    def group(self) -> str | None: ...  # its group label (None: it has none)


def describe(job_id: str, group: str) -> str:
    """How messages name a workload: its job, and its group when it named one."""
    return f"job {job_id!r} (group {group!r})" if group else f"job {job_id!r}"


def over_unix_socket(context: Context) -> bool:
    return str(context.peer() or "").startswith("unix:")


class Admission:
    """Decides whether a registration may be accepted, and which process it is."""

    def __init__(
        self,
        *,
        processes: Bindings | None = None,
        credentials: JobCredentials | None = None,
    ) -> None:
        #: Channel bindings (the agent's register socket); ``None``: nothing is bound
        #: and Unix-socket registrations are taken as TCP ones are.
        self.processes = processes
        self.credentials = credentials
        #: Kubernetes mode: the bound process must be in a pod of the job it claims.
        self.pod_check: PodCheck | None = None

    async def identify(self, register: pb.RegisterWorkload, instance: str, context: Context) -> int:
        """The pid of the registering process (0 = not known); aborts the call if refused."""
        label = describe(register.job_id, register.group)
        unix = over_unix_socket(context)
        binding = (
            self.processes.channel_binding(instance)
            if self.processes is not None and instance
            else None
        )
        pid = 0
        if binding is not None:
            if (binding.job_id, binding.group) != (register.job_id, register.group):
                await _abort(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"this workload's instance token was bound for "
                    f"{describe(binding.job_id, binding.group)}, not {label}; register the "
                    "job and group it was bound for",
                )
            if register.pid and register.pid != binding.pid:
                await _abort(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{label}: claimed pid {register.pid} is not the bound process "
                    f"{binding.pid}; a process can only register itself",
                )
            pid = binding.pid
            why = self.pod_check(pid, register.job_id, register.group) if self.pod_check else None
            if why is not None:
                await _abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
        elif unix and self.processes is not None:
            await _abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{label}: a registration over the agent's Unix socket must come from a "
                "process bound by its peer credentials: tslice.workload.register_workload "
                "binds itself through the agent's register socket (set "
                "TSLICE_AGENT_REGISTER_SOCKET where it is not next to the agent socket); "
                "a workload that cannot (llm-d's library) must connect over TCP",
            )
        if not unix and self.credentials is not None:
            allowed = self.credentials(context)
            if inspect.isawaitable(allowed):
                allowed = await allowed
            if allowed is not None and register.job_id not in allowed:
                await _abort(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{label}: the credential of this call may act as jobs "
                    f"{validation.shown_list(sorted(allowed))}, not {register.job_id!r}; "
                    "register with the job's own credential",
                )
        return pid


async def _abort(context: Context, code: grpc.StatusCode, text: str) -> NoReturn:
    await context.abort(code, validation.bounded(text))
    raise AssertionError("context.abort() returned")  # it always raises


def pod_refusal(
    pid: int, job: str, group: str, pod: Pod | None, *, job_label: str, group_label: str
) -> str | None:
    """Why process ``pid``, in ``pod`` (None: in no job pod of the node), may not
    register for ``job`` (and ``group``); None: it may. The pod must carry the job's
    label (``job_label``) and, where the registration names a group and the pod has a
    group label (``group_label``), that group."""
    if pod is None:
        return (
            f"process {pid} is in no pod of job {job!r} on this node (its cgroup names no "
            f"pod labelled {job_label}); run the workload in a pod labelled "
            f"{job_label}={job} scheduled on this node"
        )
    if pod.job != job:
        return (
            f"process {pid} is in pod {pod.key}, labelled {job_label}={pod.job}, not job "
            f"{job!r}; register as job {pod.job!r} or set the pod's label {job_label}={job}"
        )
    if group and pod.group is not None and pod.group != group:
        return (
            f"process {pid} is in pod {pod.key} of job {job!r}, labelled "
            f"{group_label}={pod.group}, not group {group!r}; register in group "
            f"{pod.group!r} or set the pod's label {group_label}={group}"
        )
    return None
