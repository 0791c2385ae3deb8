"""First contact as a new user makes it: addresses as people write them, and a wrong
address that fails fast and says so (instead of retrying silently forever)."""

from __future__ import annotations

import contextlib
import pathlib
import socket
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import pytest

import tslice
from tests.client.client_fakes import ServerThread
from tests.client.servers import Servers
from tslice.client import _address, compat
from tslice.common import errors

#: The bound the tests give the first connection, and the slack allowed on top of it.
CONNECT_S = 0.5
SLACK_S = 2.0


# -- addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "target"),
    [
        ("localhost", "localhost:50051"),
        ("localhost:7000", "localhost:7000"),
        ("  10.0.0.5  ", "10.0.0.5:50051"),
        ("orch.example.com:1", "orch.example.com:1"),
        ("[::1]:50052", "[::1]:50052"),
        ("[::1]", "[::1]:50051"),
        ("::1", "[::1]:50051"),
        ("fe80::1", "[fe80::1]:50051"),
        ("unix:/run/tslice/orch.sock", "unix:/run/tslice/orch.sock"),
        ("unix:///run/tslice/orch.sock", "unix:///run/tslice/orch.sock"),
        ("dns:///orch:50051", "dns:///orch:50051"),
        ("ipv4:127.0.0.1:9", "ipv4:127.0.0.1:9"),
    ],
)
def test_addresses_as_people_write_them(written: str, target: str) -> None:
    assert _address.grpc_target(written, default_port=50051, source="address") == target
    assert tslice.Client(written, job_id="j").address == target


@pytest.mark.parametrize(
    ("written", "advice"),
    [
        ("http://orch:50051", "write 'orch:50051' (host:port)"),
        ("https://orch.example.com", "without TLS): write 'orch.example.com:50051'"),
        ("grpc://10.0.0.5:7/path", "write '10.0.0.5:7'"),
        ("orch:http", "port 'http' is not a port number"),
        ("orch:0", "port '0' is not a port number"),
        ("orch:70000", "port '70000' is not a port number"),
        (":50051", "names no host; write e.g. 127.0.0.1:50051"),
        ("[::1", "is not [ipv6]:port"),
        ("[::1]x", "is not [ipv6]:port"),
        ("[nope]:1", "'nope' is not an IPv6 address"),
        ("1:2:3", "'1:2:3' is not an IPv6 address"),
        ("orch/grpc:1", "is not a host name or address"),
    ],
)
def test_addresses_that_cannot_work_are_refused_with_the_fix(written: str, advice: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        tslice.Client(written, job_id="j")
    assert advice in str(caught.value)
    assert f"address={written!r}" in str(caught.value)


def test_a_url_in_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICE_ORCH_ADDR", "http://localhost:50051/")
    with pytest.raises(
        errors.ConfigError,
        match=r"\$TIMESLICE_ORCH_ADDR='http://localhost:50051/' is a URL.*'localhost:50051'",
    ):
        tslice.AsyncClient(job_id="j")


def test_agent_addresses_default_to_the_agent_port(agent: ServerThread) -> None:
    assert _address.grpc_target("node-1", default_port=_address.AGENT_PORT, source="e") == (
        "node-1:9001"
    )
    with pytest.raises(errors.ConfigError, match="is a URL"):
        compat.SnapshotAgentClient("http://node-1:9001")
    with compat.SnapshotAgentClient(f"localhost:{agent.port}") as client:
        assert client.check_health().status == "SERVING"


# -- a wrong address fails fast, naming it ----------------------------------------------------


@contextlib.contextmanager
def closed_port() -> Iterator[str]:
    """A loopback port that was bound a moment ago and is closed now: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield f"127.0.0.1:{port}"


@contextlib.contextmanager
def bound_port() -> Iterator[str]:
    """A port bound but not listening (kept so nobody else takes it): refused too."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@contextlib.contextmanager
def silent_port() -> Iterator[str]:
    """A port that accepts TCP connections but never speaks gRPC: the connection hangs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


PORTS = [closed_port, bound_port, silent_port]
PORT_IDS = ["closed", "bound-not-listening", "silent"]

SYNC_CALLS: dict[str, Callable[[tslice.Client], Any]] = {
    "acquire": lambda c: c.acquire("g"),
    "status": lambda c: c.status("g"),
    "list_groups": lambda c: c.list_groups(),
    "yield": lambda c: c.yield_("g"),
    "slice": lambda c: c.slice("g").__enter__(),
    "watch_events": lambda c: next(iter(c.watch_events("g"))),
}


def expect_unreachable(address: str, started: float, err: errors.Unavailable) -> None:
    took = time.monotonic() - started
    assert took < CONNECT_S + SLACK_S, f"the error took {took:.1f} s"
    assert err.status.name == "UNAVAILABLE"
    message = str(err)
    assert f"failed to connect to the orchestrator at {address} within 0.5 s" in message
    assert "TSLICE_CONNECT_TIMEOUT_S" in message


@pytest.mark.parametrize("port", PORTS, ids=PORT_IDS)
@pytest.mark.parametrize("call", list(SYNC_CALLS))
def test_sync_calls_to_a_wrong_address_fail_within_the_connect_bound(
    port: Callable[[], contextlib.AbstractContextManager[str]], call: str
) -> None:
    with port() as address, tslice.Client(address, job_id="j", connect_timeout=CONNECT_S) as c:
        started = time.monotonic()
        with pytest.raises(errors.Unavailable) as caught:
            SYNC_CALLS[call](c)
        expect_unreachable(address, started, caught.value)


def test_a_refused_connection_says_so() -> None:
    with (
        closed_port() as address,
        tslice.Client(address, job_id="j", connect_timeout=0.5) as c,
        pytest.raises(errors.Unavailable, match="Connection refused"),
    ):
        c.acquire("g")


@pytest.mark.parametrize("port", PORTS, ids=PORT_IDS)
async def test_async_calls_to_a_wrong_address_fail_within_the_connect_bound(
    port: Callable[[], contextlib.AbstractContextManager[str]],
) -> None:
    with port() as address:
        async with tslice.AsyncClient(address, job_id="j", connect_timeout=CONNECT_S) as c:
            for call in (
                lambda: c.acquire("g"),
                lambda: c.status("g"),
                c.list_groups,
                lambda: c.watch_events("g").started(),
            ):
                started = time.monotonic()
                with pytest.raises(errors.Unavailable) as caught:
                    await call()
                expect_unreachable(address, started, caught.value)


def test_the_connect_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TSLICE_CONNECT_TIMEOUT_S", "0.5")
    with closed_port() as address, tslice.Client(address, job_id="j") as client:
        assert client.config.connect_timeout == 0.5
        started = time.monotonic()
        with pytest.raises(errors.Unavailable) as caught:
            client.acquire("g")
        expect_unreachable(address, started, caught.value)
    assert tslice.Client("h", job_id="j", connect_timeout=2).config.connect_timeout == 2
    monkeypatch.setenv("TSLICE_CONNECT_TIMEOUT_S", "none")
    assert tslice.Client("h", job_id="j").config.connect_timeout is None
    monkeypatch.setenv("TSLICE_CONNECT_TIMEOUT_S", "soon")
    with pytest.raises(errors.ConfigError, match="TSLICE_CONNECT_TIMEOUT_S='soon' is not"):
        tslice.Client("h", job_id="j")
    monkeypatch.delenv("TSLICE_CONNECT_TIMEOUT_S")
    assert tslice.Client("h", job_id="j").config.connect_timeout == 5.0
    with pytest.raises(ValueError, match="connect_timeout must be > 0"):
        tslice.Client("h", job_id="j", connect_timeout=0)


def test_a_shorter_call_deadline_bounds_the_connect_wait_too() -> None:
    with silent_port() as address, tslice.Client(address, job_id="j", connect_timeout=30) as c:
        started = time.monotonic()
        # (It names the wait it had: the call's time left when it began to connect.)
        with pytest.raises(errors.Unavailable, match=r"within 0\.(3|2\d+) s"):
            c.status("g", timeout=0.3)
        assert time.monotonic() - started < 0.3 + SLACK_S


def test_the_llm_d_client_reports_an_llm_d_connection_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TSLICE_CONNECT_TIMEOUT_S", "0.5")
    with closed_port() as address, compat.TimeSliceOrchestratorClient(address, "j", "g") as c:
        started = time.monotonic()
        with pytest.raises(compat.OrchestratorConnectionError, match="failed to connect"):
            c.acquire()
        assert time.monotonic() - started < CONNECT_S + SLACK_S
    with (
        closed_port() as address,
        compat.SnapshotAgentClient(address) as agent,
        pytest.raises(compat.SnapshotAgentError, match="snapshot agent at"),
    ):
        agent.status()


def test_a_server_that_comes_up_within_the_bound_is_used(
    tmp_path: pathlib.Path, executor: futures.ThreadPoolExecutor
) -> None:
    """Starting the client a moment before the orchestrator is fine: the first call waits."""
    servers = Servers(tmp_path)
    try:
        servers.start_agent("node-a", default_backend="noop")
        with closed_port() as address:
            port = int(address.rsplit(":", 1)[1])
            with tslice.Client(address, job_id="j", connect_timeout=30) as client:
                listing = executor.submit(client.list_groups)
                with pytest.raises(futures.TimeoutError):
                    listing.result(0.3)  # refused, and waiting for the orchestrator
                servers.start_orchestrator(port=port, groups={"g": ("node-a",)})
                assert listing.result(30) == ("g",)
    finally:
        servers.close()
