"""Who may register a workload (issue 10 §1): real grpc.aio servers, real sockets, real
processes.

- a second workload of a (job, group) never takes over a live one (it did: a second
  process re-registering as another job answered that job's snapshot), nor a lost one
  within its grace; only the same workload (its instance token) comes back;
- over the agent's Unix socket the registering process is bound by its peer credentials
  (through the register socket) and must be one of the job's known processes;
- over TCP the ``pid`` field is never trusted, and a job credential, where
  authentication is on, must allow the job.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path

import grpc
import pytest

from tests.agent.raw_workload import HubServer, HubServicer, RawWorkload, start_hub
from tslice.agent import channel
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.security import identities, roles

#: Far longer than any test: a workload that is let in during it did not wait the grace out.
LONG_GRACE_S = 120.0


@pytest.fixture
async def servers() -> AsyncIterator[list[HubServer]]:
    made: list[HubServer] = []
    yield made
    for running in made:
        await running.hub.close()
        await running.server.stop(grace=None)


@pytest.fixture
async def register_sockets() -> AsyncIterator[list[registration.RegistrationServer]]:
    made: list[registration.RegistrationServer] = []
    yield made
    for server in made:
        await server.close()


async def _hub(servers: list[HubServer], bind: str = "127.0.0.1:0", **options: object) -> HubServer:
    running = await start_hub(channel.ChannelHub(ping_interval_s=5.0, **options), bind)  # type: ignore[arg-type]
    servers.append(running)
    return running


async def _refused(workload: RawWorkload) -> tuple[grpc.StatusCode, str]:
    return await workload.final_status(), await workload.call.details() or ""


# ---- one live registration per (job, group) ------------------------------------------------


async def test_a_second_workload_never_takes_over_a_live_one(servers: list[HubServer]) -> None:
    running = await _hub(servers, lost_grace_s=LONG_GRACE_S)
    owner = RawWorkload(running.address, instance="owner-instance")
    intruder = RawWorkload(running.address, instance="intruder-instance")
    llmd_like = RawWorkload(running.address)  # sends no instance token at all
    try:
        await owner.register("job-a")
        for other in (intruder, llmd_like):
            await other.register("job-a", pid=os.getpid(), ack=False)
            code, details = await _refused(other)
            assert code == grpc.StatusCode.ALREADY_EXISTS, details
            assert "job 'job-a' (group 'g') already has a live workload registration" in details
            assert "Close the first (WorkloadHandle.close()" in details
        # The job's snapshot still goes to its own workload, which answers it.
        task = asyncio.create_task(running.hub.snapshot("job-a", "g", timeout_s=10))
        command = await owner.next_command()
        await owner.answer(command, device_bytes=7)
        assert (await task).device_bytes == 7
    finally:
        for workload in (owner, intruder, llmd_like):
            await workload.close()


@pytest.mark.parametrize("instance", ["has space", "x" * 300, "-leading-dash"])
async def test_a_malformed_instance_token_is_refused(
    servers: list[HubServer], instance: str
) -> None:
    running = await _hub(servers)
    raw = RawWorkload(running.address, instance=instance)
    try:
        await raw.register("job-a", ack=False)
        code, details = await _refused(raw)
    finally:
        await raw.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "tslice-workload-instance" in details and len(details) < 1024


async def test_a_lost_workload_comes_back_only_as_itself(servers: list[HubServer]) -> None:
    running = await _hub(servers, lost_grace_s=LONG_GRACE_S)
    first = RawWorkload(running.address, instance="instance-1")
    other = RawWorkload(running.address, instance="instance-2")
    back = RawWorkload(running.address, instance="instance-1")
    try:
        await first.register("job-a")
        await running.hub.wait_registered("job-a", "g", timeout=10)
        first.call.cancel()  # lost, not closed: it may come back within the grace
        await running.hub.wait_unregistered("job-a", "g", timeout=10)
        await other.register("job-a", ack=False)
        code, details = await _refused(other)
        assert code == grpc.StatusCode.ALREADY_EXISTS, details
        assert "lost its workload channel" in details and "may still come back" in details
        assert "once its lost_grace_s has passed" in details
        await back.register("job-a")  # the same workload: accepted, nothing departed
        await back.sync()
        assert running.hub.departure("job-a", "g") is None
    finally:
        for workload in (first, other, back):
            await workload.close()


async def test_once_the_grace_ran_out_another_workload_may_register(
    servers: list[HubServer],
) -> None:
    running = await _hub(servers, lost_grace_s=0.2)
    left: asyncio.Event = asyncio.Event()
    running.hub.add_listener(lambda event: left.set() if event.kind == "left" else None)
    first = RawWorkload(running.address, instance="instance-1")
    second = RawWorkload(running.address, instance="instance-2")
    try:
        await first.register("job-a")
        await running.hub.wait_registered("job-a", "g", timeout=10)
        first.call.cancel()
        await asyncio.wait_for(left.wait(), 10)  # counted as gone
        await second.register("job-a")
        await second.sync()
        assert running.hub.session_state("job-a", "g") is not None
    finally:
        await first.close()
        await second.close()


# ---- the Unix socket: the process, by its peer credentials ---------------------------------


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tslice-") as tmp:  # short: AF_UNIX paths
        yield Path(tmp)


async def _unix_hub(
    servers: list[HubServer],
    register_sockets: list[registration.RegistrationServer],
    socket_dir: Path,
) -> HubServer:
    """A hub on a Unix socket with the agent's register socket next to it."""
    processes = registration.ProcessRegistry()
    announcements = registration.RegistrationServer(
        path=socket_dir / "register.sock", registry=processes
    )
    await announcements.start()
    register_sockets.append(announcements)
    return await _hub(servers, f"unix:{socket_dir / 'agent.sock'}", processes=processes)


async def test_an_unbound_registration_over_the_unix_socket_is_refused(
    servers: list[HubServer],
    register_sockets: list[registration.RegistrationServer],
    socket_dir: Path,
) -> None:
    running = await _unix_hub(servers, register_sockets, socket_dir)
    for instance in ("", "never-bound"):
        raw = RawWorkload(running.address, instance=instance)
        try:
            await raw.register("job-a", pid=os.getpid(), ack=False)
            code, details = await _refused(raw)
        finally:
            await raw.close()
        assert code == grpc.StatusCode.UNAUTHENTICATED, details
        assert "must come from a process bound by its peer credentials" in details
        assert "must connect over TCP" in details
    assert running.hub.known_sessions() == []


# A job's process: announces itself (its job's known process), registers its workload over
# the Unix socket, says its pid and stays until its stdin closes.
_OWNER = """
import sys
from tslice.workload import process, register_workload
process.announce_process("job-a", socket_path=sys.argv[1] + "/register.sock")
handle = register_workload("unix:" + sys.argv[1] + "/agent.sock", "job-a", "g",
                           on_snapshot=lambda mode, tags: None, on_restore=lambda tags: None)
assert handle.wait_registered(20), handle.error
print("ready", flush=True)
sys.stdin.read()
handle.close()
"""
# Another process of the node claiming the same job (and group).
_INTRUDER = """
import sys
from tslice.workload import register_workload
handle = register_workload("unix:" + sys.argv[1] + "/agent.sock", "job-a", "g",
                           on_snapshot=lambda mode, tags: None, on_restore=lambda tags: None)
handle.wait_stopped(20)
print(handle.error, flush=True)
"""


def _python(code: str, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        text=True,
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        **kwargs,  # type: ignore[call-overload]
    )


async def test_over_the_unix_socket_only_the_jobs_own_process_registers(
    servers: list[HubServer],
    register_sockets: list[registration.RegistrationServer],
    socket_dir: Path,
) -> None:
    running = await _unix_hub(servers, register_sockets, socket_dir)
    owner = _python(_OWNER, str(socket_dir))
    try:
        assert owner.stdout is not None
        assert (await asyncio.to_thread(owner.stdout.readline)).strip() == "ready"
        state = await running.hub.wait_registered("job-a", "g", timeout=10)
        assert state.pid == owner.pid  # from the kernel, through the register socket
        intruder = _python(_INTRUDER, str(socket_dir))
        out, _ = await asyncio.to_thread(intruder.communicate, None, 60)
        assert intruder.returncode == 0
        # Its binding was refused (not one of job-a's processes), and so its registration.
        assert "refused the registration of job 'job-a' (group 'g')" in out, out
        assert "bound by its peer credentials" in out, out
        assert f"process {intruder.pid} is not one of the processes of job 'job-a'" in out, out
        after = running.hub.session_state("job-a", "g")
        assert after is not None and after.pid == owner.pid
    finally:
        await asyncio.to_thread(owner.communicate, "", 30)


async def test_a_binding_names_its_job_and_group(
    servers: list[HubServer],
    register_sockets: list[registration.RegistrationServer],
    socket_dir: Path,
) -> None:
    running = await _unix_hub(servers, register_sockets, socket_dir)
    processes = running.hub.admission.processes
    assert processes is not None
    processes.bind_channel(instance="bound-for-b", job_id="job-b", pid=os.getpid(), group="g")
    raw = RawWorkload(running.address, instance="bound-for-b")
    try:
        await raw.register("job-a", ack=False)
        code, details = await _refused(raw)
    finally:
        await raw.close()
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "bound for job 'job-b' (group 'g'), not job 'job-a' (group 'g')" in details


# ---- TCP: the pid is never trusted; a job credential where authentication is on ------------


async def test_over_tcp_a_claimed_pid_is_not_trusted(servers: list[HubServer]) -> None:
    running = await _hub(servers)
    raw = RawWorkload(running.address, instance="w")
    try:
        await raw.register("job-a", pid=1)  # claims to be init
        state = await running.hub.wait_registered("job-a", "g", timeout=10)
    finally:
        await raw.close()
    assert state.pid == 0


async def test_over_tcp_the_job_credential_must_allow_the_job(
    servers: list[HubServer],
) -> None:
    def credentials(context: object) -> Collection[str]:
        return {"job-b"}  # what the caller's credential may act as

    running = await _hub(servers, credentials=credentials)
    wrong, right = RawWorkload(running.address), RawWorkload(running.address)
    try:
        await wrong.register("job-a", ack=False)
        code, details = await _refused(wrong)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert "may act as jobs ['job-b'], not 'job-a'" in details
        await right.register("job-b")
        await right.sync()
    finally:
        await wrong.close()
        await right.close()


async def test_with_authentication_a_tcp_registration_needs_its_jobs_credential(
    servers: list[HubServer],
) -> None:
    # The agent's own pieces: the authenticating interceptor (static tokens) and the hub's
    # credential hook, on a real server.
    tokens = {"job-b": "token-of-job-b", "orchestrator": "token-of-the-orchestrator"}
    verifier = identities.StaticVerifier(
        tokens=[
            identities.Grant(
                "job-b-cred", frozenset({identities.JOB}), ("job-b",), _sha(tokens["job-b"])
            ),
            identities.Grant(
                "orch", frozenset({identities.ORCHESTRATOR}), (), _sha(tokens["orchestrator"])
            ),
        ]
    )
    hub = channel.ChannelHub(ping_interval_s=5.0, credentials=roles.job_credentials)
    server = grpc.aio.server(
        interceptors=[roles.Interceptor(verifier, roles.AGENT_RULES, server="agent")]
    )
    pb_grpc.add_SnapshotAgentServiceServicer_to_server(HubServicer(hub), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    running = HubServer(hub, f"127.0.0.1:{port}", server)
    servers.append(running)

    async def attempt(job_id: str, token: str | None) -> tuple[grpc.StatusCode, str]:
        raw = RawWorkload(running.address, token=token)
        try:
            await raw.register(job_id, ack=False)
        except grpc.aio.AioRpcError as err:  # refused before the registration was read
            return err.code(), err.details() or ""
        else:
            return await _refused(raw)
        finally:
            await raw.close()

    code, details = await attempt("job-a", None)
    assert code == grpc.StatusCode.UNAUTHENTICATED, details
    code, details = await attempt("job-a", tokens["orchestrator"])  # not the job role
    assert code == grpc.StatusCode.PERMISSION_DENIED and "needs the job role" in details
    code, details = await attempt("job-a", tokens["job-b"])  # another job's credential
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "may act as jobs ['job-b'], not 'job-a'" in details
    assert running.hub.known_sessions() == []
    own = RawWorkload(running.address, token=tokens["job-b"])
    try:
        await own.register("job-b")
        await own.sync()
        assert running.hub.known_sessions() == [("job-b", "g")]
    finally:
        await own.close()


def _sha(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
