"""Self-registration over a real Unix socket, PID from SO_PEERCRED."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tslice.agent.channel import registration
from tslice.workload import process


@pytest.fixture
def sock_path(short_tmp: Path) -> Path:
    return short_tmp / "register.sock"


@pytest.fixture
async def server(sock_path: Path) -> AsyncIterator[registration.RegistrationServer]:
    srv = registration.RegistrationServer(path=sock_path, registry=registration.ProcessRegistry())
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


async def _announce(job_id: str, path: Path, **kwargs: object) -> int:
    # announce_process is synchronous (workload code); keep the loop free for the server.
    return await asyncio.to_thread(process.announce_process, job_id, socket_path=path, **kwargs)  # type: ignore[arg-type]


async def _raw(path: Path, payload: bytes) -> dict[str, object]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(payload)
    await writer.drain()
    line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    answer = json.loads(line)
    assert isinstance(answer, dict)
    return answer


async def test_peer_pid_is_recorded(server: registration.RegistrationServer) -> None:
    pid = await _announce("rl-a", server.path, group="pool-0")
    assert pid == os.getpid()
    assert server.registry.pids("rl-a") == [os.getpid()]
    assert server.registry.job_of(os.getpid()) == "rl-a"
    [reg] = server.registry.registrations()
    assert (reg.group, reg.uid) == ("pool-0", os.getuid())
    # Idempotent.
    assert await _announce("rl-a", server.path) == os.getpid()
    assert server.registry.pids("rl-a") == [os.getpid()]


async def test_socket_mode_is_0660(server: registration.RegistrationServer) -> None:
    mode = server.path.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


async def test_env_variable_names_the_socket(
    server: registration.RegistrationServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(process.SOCKET_ENV, str(server.path))
    assert await asyncio.to_thread(process.announce_process, "rl-env") == os.getpid()
    assert server.registry.pids("rl-env") == [os.getpid()]


async def test_child_processes_register_in_order_and_exit_is_noticed(
    server: registration.RegistrationServer,
) -> None:
    code = textwrap.dedent(f"""
        import sys
        from tslice.workload import process
        pid = process.announce_process("rl-b", socket_path={str(server.path)!r})
        print(pid, flush=True)
        sys.stdin.read()  # stay alive until the test closes stdin
    """)
    children: list[asyncio.subprocess.Process] = []
    try:
        reported = []
        for _ in range(2):  # one after the other, so the registration order is known
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                code,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            children.append(child)
            assert child.stdout is not None
            reported.append(int(await child.stdout.readline()))
        assert reported == [c.pid for c in children]
        assert server.registry.pids("rl-b") == reported
        first = next(c for c in children if c.pid == reported[0])
        first.send_signal(signal.SIGKILL)
        await first.wait()
        assert server.registry.pids("rl-b") == reported[1:]
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
            await child.communicate()  # reaps and closes the pipes
    assert server.registry.pids("rl-b") == []


async def test_process_belongs_to_one_job(server: registration.RegistrationServer) -> None:
    await _announce("rl-a", server.path)
    with pytest.raises(process.RegistrationError, match="already registered to job 'rl-a'"):
        await _announce("rl-b", server.path)
    server.registry.forget("rl-a")
    assert await _announce("rl-b", server.path) == os.getpid()


async def test_a_process_that_names_another_group_moves_there_in_place(
    server: registration.RegistrationServer,
) -> None:
    other = await asyncio.create_subprocess_exec("sleep", "300")
    try:
        server.registry.register(job_id="rl-a", pid=other.pid)
        await _announce("rl-a", server.path, group="trainer")
        await _announce("rl-a", server.path, group="sampler")
        regs = server.registry.registrations()
        assert [(r.pid, r.group) for r in regs] == [(other.pid, ""), (os.getpid(), "sampler")]
        server.registry.forget("rl-a", "sampler")
        assert server.registry.pids("rl-a") == [other.pid]
    finally:
        other.kill()
        await other.wait()


async def test_a_malformed_group_is_refused_with_the_agent_s_reason(
    server: registration.RegistrationServer,
) -> None:
    with pytest.raises(process.RegistrationError, match="group 'bad group' is malformed"):
        await _announce("rl-a", server.path, group="bad group")
    assert server.registry.registrations() == []


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "JSON object"),
        (b'{"group": "g"}\n', "job_id"),
        (b'{"job_id": "bad id!"}\n', "malformed"),
        (b'{"job_id": ""}\n', "required"),
        (b'{"job_id": "rl-a", "pid": 1}\n', "can only register itself"),
        (b'{"job_id": "rl-a", "group": 5}\n', "group must be a string"),
    ],
    ids=["not-json", "not-object", "no-job", "bad-job", "empty-job", "other-pid", "bad-group"],
)
async def test_bad_registrations_are_refused_with_a_reason(
    server: registration.RegistrationServer, payload: bytes, error: str
) -> None:
    answer = await _raw(server.path, payload)
    assert answer["ok"] is False
    assert error in str(answer["error"])
    assert server.registry.registrations() == []


async def test_overlong_line_is_refused(server: registration.RegistrationServer) -> None:
    answer = await _raw(server.path, b'{"job_id": "' + b"a" * 10_000 + b'"}\n')
    assert answer["ok"] is False
    assert "longer than" in str(answer["error"])


def test_workload_side_errors_are_actionable(tmp_path: Path) -> None:
    with pytest.raises(process.RegistrationError, match="no agent registration socket"):
        process.announce_process("rl-a", socket_path=tmp_path / "absent.sock")
    with pytest.raises(process.RegistrationError, match="malformed"):
        process.announce_process("bad id!", socket_path=tmp_path / "absent.sock")


async def test_stale_socket_is_replaced_and_other_files_are_not(sock_path: Path) -> None:
    stale = registration.RegistrationServer(path=sock_path)
    await stale.start()
    # Simulate a killed agent: the server goes away, the socket file stays.
    assert stale._server is not None
    stale._server.close()
    await stale._server.wait_closed()
    assert await asyncio.to_thread(sock_path.exists)
    fresh = registration.RegistrationServer(path=sock_path, registry=registration.ProcessRegistry())
    async with fresh:
        assert await _announce("rl-a", sock_path) == os.getpid()
    assert not await asyncio.to_thread(sock_path.exists)  # close() removes it

    await asyncio.to_thread(sock_path.write_text, "not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        await registration.RegistrationServer(path=sock_path).start()


def test_registry_refuses_a_process_that_is_not_there() -> None:
    registry = registration.ProcessRegistry()
    dead = subprocess.Popen(["true"])  # exits at once
    dead.wait()
    with pytest.raises(registration.RegistrationError, match="not visible"):
        registry.register(job_id="rl-a", pid=dead.pid)


def test_default_registry_is_shared() -> None:
    assert registration.default_registry() is registration.default_registry()
    assert registration.RegistrationServer(path="/tmp/x.sock").registry is (
        registration.default_registry()
    )
