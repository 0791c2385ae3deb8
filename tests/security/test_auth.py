"""Authentication and roles on real orchestrator and agent processes (mutual TLS, tokens):
each attack of issue 10 on identities is refused, with the status code and a message
naming the principal and the fix, and changes nothing.

- a job's (or an admin's) direct Snapshot, Restore, Grant, GrantStream or ResetJob to an
  agent: only the orchestrator's identity may move a job's state;
- Acquire, Yield, Hold and Session requests as another job: a job credential acts only
  as its own job ids;
- ClearDegraded, Evict and Drain without the admin role;
- a caller that presents nothing (or an unknown token) on the agent's plaintext Unix socket.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable, Iterator

import grpc
import pytest

import tslice.client as tsclient
from tests.harness.ports import closed_port
from tests.security.conftest import (
    JOB_A_TOKEN,
    READER_TOKEN,
    SecureStack,
    agent_args,
    orchestrator_args,
    serving_all,
)
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import _admin
from tslice.common import errors
from tslice.security import tls

TIMEOUT_S = 20.0


class Caller:
    """Stubs of both services on one channel, every call carrying the caller's token."""

    def __init__(self, target: str, security: tls.ClientSecurity) -> None:
        self.channel = security.channel(target)
        self.metadata = security.metadata()
        self.agent = pb_grpc.SnapshotAgentServiceStub(self.channel)
        self.orch = opb_grpc.TimeSliceOrchestratorServiceStub(self.channel)

    def refused(self, call: Callable[..., object], request: object) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=TIMEOUT_S, metadata=self.metadata)
        return err.value

    def streamed_refusal(
        self, call: Callable[..., Iterator[object]], request: object
    ) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            next(iter(call(request, timeout=TIMEOUT_S, metadata=self.metadata)))
        return err.value


Connect = Callable[..., Caller]


@pytest.fixture
def connect(secure_stack: SecureStack) -> Iterator[Connect]:
    """``connect(identity, server=..., token=...)``: a caller with ``identity``'s certificate
    (``None``: none) to the orchestrator, the agent's TCP port or its Unix socket."""
    made: list[Caller] = []

    def caller(
        identity: str | None, *, server: str = "orchestrator", token: str | None = None
    ) -> Caller:
        security = secure_stack.security(identity, token=token)
        if server == "agent-unix":
            security = tls.ClientSecurity(token=security.token)  # the socket is plaintext
        target = {
            "orchestrator": secure_stack.orchestrator,
            "agent": secure_stack.agent,
            "agent-unix": secure_stack.agent_unix,
        }[server]
        made.append(Caller(target, security))
        return made[-1]

    yield caller
    for each in made:
        each.channel.close()


@pytest.fixture
def job_a(connect: Connect) -> Caller:
    """Job a's certificate, on the orchestrator."""
    return connect("job:job-a")


@pytest.fixture
def job_b(connect: Connect) -> Caller:
    return connect("job:job-b")


def _holds(caller: Caller, job: str, group: str) -> int:
    reply = caller.orch.Acquire(
        opb.AcquireRequest(job_id=job, group_id=group), timeout=TIMEOUT_S, metadata=caller.metadata
    )
    assert reply.success
    return int(reply.grant_epoch)


def _locking_job(caller: Caller, group: str) -> str:
    reply = caller.orch.GetGroupStatus(
        opb.GetGroupStatusRequest(group_id=group), timeout=TIMEOUT_S, metadata=caller.metadata
    )
    return str(reply.group.locking_job)


def _job_state(caller: Caller, job: str, group: str) -> int:
    """The agent's state of ``job``'s state for ``group`` (other modules leave the same
    job resident for groups of their own on this session's agent)."""
    status = caller.agent.Status(pb.StatusRequest(), timeout=TIMEOUT_S, metadata=caller.metadata)
    return next(j.state for j in status.job_statuses if (j.job_id, j.group) == (job, group))


@pytest.mark.parametrize("identity", ["job:job-b", "admin"])
def test_only_the_orchestrator_moves_state_on_an_agent(
    connect: Connect, job_a: Caller, identity: str
) -> None:
    group = f"moved-{identity.replace(':', '-')}"
    epoch = _holds(job_a, "job-a", group)  # job a is resident on the agent
    attacker = connect(identity, server="agent")
    victim = {"job_id": "job-a", "group": group}
    attacks = [
        (attacker.agent.Snapshot, pb.SnapshotRequest(**victim)),
        (attacker.agent.Restore, pb.RestoreRequest(**victim)),
        (attacker.agent.Grant, pb.GrantRequest(job_id="job-x", group=group, grant_epoch=2**62)),
        (attacker.agent.ResetJob, pb.ResetJobRequest(**victim)),
    ]
    for call, request in attacks:
        err = attacker.refused(call, request)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
        assert f"principal '{identity}' (certificate)" in err.details()
        assert "orchestrator role" in err.details()
    grant = pb.GrantStreamRequest(request_id=1, grant=pb.GrantRequest(job_id="job-x", group=group))
    # A stream of requests (one): a bare message is no iterator, and the client's request
    # thread failing on it first ended the call UNKNOWN before the refusal arrived.
    err = attacker.streamed_refusal(attacker.agent.GrantStream, iter([grant]))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    # Nothing moved: job a still runs there and holds its group at the same grant.
    assert _job_state(attacker, "job-a", group) == pb.JOB_STATE_RUNNING
    assert _locking_job(job_a, group) == "job-a"
    assert _holds(job_a, "job-a", group) == epoch  # re-acquire: the same grant
    job_a.orch.Yield(opb.YieldRequest(job_id="job-a", group_id=group), timeout=TIMEOUT_S)


def test_a_job_cannot_acquire_yield_or_hold_as_another_job(job_a: Caller, job_b: Caller) -> None:
    group = "as-another"
    epoch = _holds(job_a, "job-a", group)
    acquire = opb.AcquireRequest(job_id="job-a", group_id=group)
    for call, request in [
        (job_b.orch.Acquire, acquire),
        (job_b.orch.Yield, opb.YieldRequest(job_id="job-a", group_id=group)),
    ]:
        err = job_b.refused(call, request)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
        assert "principal 'job:job-b' (certificate) may not act as job 'job-a'" in err.details()
    hold = opb.HoldRequest(job_id="job-a", group_id=group, grant_epoch=epoch)
    err = job_b.streamed_refusal(job_b.orch.Hold, hold)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not act as job 'job-a'" in err.details()
    # Over a Session the refusal is the request's, and the stream goes on.
    session = job_b.orch.Session(
        iter([opb.SessionRequest(request_id=7, acquire=acquire)]),
        timeout=TIMEOUT_S,
        metadata=job_b.metadata,
    )
    reply = next(iter(session))
    assert reply.request_id == 7
    assert reply.status_code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "may not act as job 'job-a'" in reply.status_message
    session.cancel()
    assert _locking_job(job_b, group) == "job-a"  # reads are anyone's
    job_a.orch.Yield(opb.YieldRequest(job_id="job-a", group_id=group), timeout=TIMEOUT_S)


def test_clear_degraded_needs_the_admin_role(connect: Connect, job_a: Caller) -> None:
    _holds(job_a, "job-a", "admin-only")
    request = opb.ClearDegradedRequest(group_id="admin-only")
    err = job_a.refused(job_a.orch.ClearDegraded, request)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs the admin role" in err.details()
    admin = connect("admin")
    reply = admin.orch.ClearDegraded(request, timeout=TIMEOUT_S, metadata=admin.metadata)
    assert not reply.cleared  # nothing was degraded; the call was allowed
    job_a.orch.Yield(opb.YieldRequest(job_id="job-a", group_id="admin-only"), timeout=TIMEOUT_S)


def test_evict_and_drain_need_the_admin_role(connect: Connect, job_a: Caller) -> None:
    _holds(job_a, "job-a", "admin-evict")
    evict = opb.EvictRequest(group_id="admin-evict", job_id="job-a", reason="test")
    drain = opb.DrainRequest(group_id="admin-evict", drain=True)
    for call, request in ((job_a.orch.Evict, evict), (job_a.orch.Drain, drain)):
        err = job_a.refused(call, request)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "needs the admin role" in err.details()
    assert _locking_job(job_a, "admin-evict") == "job-a"  # nothing changed
    admin = connect("admin")
    drained = admin.orch.Drain(drain, timeout=TIMEOUT_S, metadata=admin.metadata)
    assert drained.draining and drained.locking_job == "job-a"
    reply = admin.orch.Evict(evict, timeout=TIMEOUT_S, metadata=admin.metadata)
    assert [e.role for e in reply.evictions] == [opb.Eviction.ROLE_HOLDER]
    assert _locking_job(job_a, "admin-evict") == ""
    resume = opb.DrainRequest(group_id="admin-evict", drain=False)
    assert not admin.orch.Drain(resume, timeout=TIMEOUT_S, metadata=admin.metadata).draining


def test_a_caller_who_presents_nothing_is_told_how_to_authenticate(connect: Connect) -> None:
    anonymous = connect(None, server="agent-unix")
    err = anonymous.refused(anonymous.agent.Status, pb.StatusRequest())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "requires authentication" in err.details() and "TSLICE_TOKEN" in err.details()
    unknown = connect(None, server="agent-unix", token="not-a-token")
    err = unknown.refused(unknown.agent.Snapshot, pb.SnapshotRequest(job_id="job-a"))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token presented is not known" in err.details()


def test_tokens_map_to_roles_and_are_checked_on_the_unix_socket_too(connect: Connect) -> None:
    job = connect(None, server="agent-unix", token=JOB_A_TOKEN)
    err = job.refused(job.agent.Snapshot, pb.SnapshotRequest(job_id="job-a"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "principal 'job-a' (token)" in err.details()
    reader = connect(None, server="agent-unix", token=READER_TOKEN)  # from a token file
    assert reader.agent.Status(pb.StatusRequest(), timeout=TIMEOUT_S, metadata=reader.metadata)


def _register(caller: Caller, job: str) -> grpc.RpcError:
    hello = pb.WorkloadMessage(register=pb.RegisterWorkload(job_id=job, group="g"))
    stream = caller.agent.WorkloadChannel(
        iter([hello]), timeout=TIMEOUT_S, metadata=caller.metadata
    )
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stream))
    return err.value


def test_a_workload_registers_over_tcp_only_as_a_job_its_credential_names(
    connect: Connect,
) -> None:
    err = _register(connect("job:job-b", server="agent"), "job-a")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not 'job-a'" in err.details() and "job-b" in err.details(), err.details()
    err = _register(connect("admin", server="agent"), "job-a")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs the job role" in err.details()


def test_the_orchestrator_proves_its_role_to_agents_with_a_token(
    tmp_path: pathlib.Path,
) -> None:
    """No TLS at all (loopback): the orchestrator's token is what lets it switch."""
    secret = tmp_path / "orchestrator.token"
    secret.write_text("orchestrator-secret-42\n")
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens: [{{name: orch, roles: [orchestrator], token_file: {secret}}}]\n")
    agent_config = tmp_path / "agent.yaml"
    agent_config.write_text(f"auth: {{tokens_file: {tokens}}}\n")
    agent = agent_args(tmp_path, "--config", str(agent_config))
    agent[agent.index("--port") + 1] = port = str(closed_port())
    orch_config = tmp_path / "orchestrator.yaml"
    orch_config.write_text(f"agent_client: {{token_file: {secret}}}\n")
    orch = orchestrator_args(tmp_path, f"127.0.0.1:{port}", "--config", str(orch_config))
    servers = [("agent", agent, tmp_path / "a.log"), ("orchestrator", orch, tmp_path / "o.log")]
    with serving_all(servers) as (_, orchestrator):
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(
            grpc.insecure_channel(orchestrator.address)
        )
        for job in ("job-a", "job-b"):  # two grants: a switch on the agent, by Grant
            request = opb.AcquireRequest(job_id=job, group_id="g")
            assert stub.Acquire(request, timeout=TIMEOUT_S).success
            stub.Yield(opb.YieldRequest(job_id=job, group_id="g"), timeout=TIMEOUT_S)


async def test_the_async_clients_admin_calls_with_the_admin_credential(
    secure_stack: SecureStack,
) -> None:
    group, address = "async-admin", secure_stack.orchestrator

    def client(identity: str, job: str | None = None) -> tsclient.AsyncClient:
        security = secure_stack.security(identity)
        return tsclient.AsyncClient(address, job_id=job, lease_s=None, security=security)

    async with client("job:job-a", "job-a") as a, client("admin") as admin:
        await a.acquire(group)
        with pytest.raises(errors.NotHolder, match="needs the admin role"):
            await a.drain(group)
        assert await admin.drain(group) == _admin.DrainState(
            draining=True, was_draining=False, locking_job="job-a", switching=False,
            waiter_queue_depth=0,
        )  # fmt: skip
        evicted = await admin.evict(group, "job-a", reason="maintenance")
        assert evicted == (_admin.Eviction(group, _admin.EvictedRole.HOLDER, next_job=""),)
        with pytest.raises(errors.FailedPrecondition, match="maintenance"):
            await a.yield_(group)
        resumed = await admin.resume(group)
        assert resumed.was_draining and not resumed.draining
        with pytest.raises(errors.NotFound, match="neither holds nor waits"):
            await admin.evict(group, "job-a")
        # A waiter of the library (over its Session stream) is told why it left the queue.
        await a.acquire(group)
        async with client("job:job-b", "job-b") as b:
            events = admin.watch_events(group, kinds=[tsclient.EventKind.QUEUED])
            await events.started()
            pending = asyncio.ensure_future(b.acquire(group))
            async for event in events:
                if event.job_id == "job-b":
                    break
            await events.aclose()
            await admin.evict(group, "job-b", reason="over quota")
            with pytest.raises(errors.Aborted, match="by an administrator: over quota"):
                await pending
        await a.yield_(group)
