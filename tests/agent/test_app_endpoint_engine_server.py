"""The local engine dialect server (tslice.sim.engine_server) behaves like the engines it fakes.

Driven with a plain synchronous httpx client so that these tests do not depend on the backend.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tslice.sim import engine_server

GiB = 1 << 30


@pytest.fixture
def vllm() -> Iterator[engine_server.EngineServer]:
    with engine_server.EngineServer(
        dialect="vllm", tags={"weights": 3 * GiB, "kv_cache": GiB}
    ) as server:
        yield server


@pytest.fixture
def sglang() -> Iterator[engine_server.EngineServer]:
    with engine_server.EngineServer(
        dialect="sglang", tags={"weights": 3 * GiB, "kv_cache": GiB}
    ) as server:
        yield server


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10, trust_env=False) as client:
        yield client


def test_vllm_level1_keeps_weights_on_host_and_wakes_in_stages(
    vllm: engine_server.EngineServer, http: httpx.Client
) -> None:
    assert vllm.device_bytes == 4 * GiB and not vllm.is_sleeping
    reply = http.post(f"{vllm.url}/sleep", params={"level": "1"})
    assert reply.status_code == 200
    assert reply.json() == {"freed_bytes": 4 * GiB, "host_bytes": 3 * GiB}
    assert vllm.device_bytes == 0 and vllm.host_bytes == 3 * GiB
    assert http.get(f"{vllm.url}/is_sleeping").json() == {"is_sleeping": True}

    reply = http.post(f"{vllm.url}/wake_up", params={"tags": "weights"})
    assert reply.json() == {"restored_bytes": 3 * GiB, "host_bytes": 0}
    assert vllm.resident_tags == {"weights"} and vllm.is_sleeping
    # vLLM ignores /sleep while any tag still sleeps.
    assert http.post(f"{vllm.url}/sleep", params={"level": "1"}).json()["freed_bytes"] == 0
    assert vllm.resident_tags == {"weights"}

    reply = http.post(f"{vllm.url}/wake_up", params={"tags": "kv_cache"})
    assert reply.json()["restored_bytes"] == GiB
    assert not vllm.is_sleeping and vllm.device_bytes == 4 * GiB


def test_vllm_level2_discards_everything(
    vllm: engine_server.EngineServer, http: httpx.Client
) -> None:
    assert http.post(f"{vllm.url}/sleep?level=2").json() == {
        "freed_bytes": 4 * GiB,
        "host_bytes": 0,
    }
    assert vllm.host_bytes == 0
    assert http.post(f"{vllm.url}/wake_up").json()["restored_bytes"] == 4 * GiB


def test_vllm_no_ops_and_errors_mirror_the_engine(
    vllm: engine_server.EngineServer, http: httpx.Client
) -> None:
    # Awake: wake_up is a no-op.
    assert http.post(f"{vllm.url}/wake_up").json()["restored_bytes"] == 0
    assert http.post(f"{vllm.url}/sleep?level=3").status_code == 400
    http.post(f"{vllm.url}/sleep")  # level defaults to 1
    assert vllm.host_bytes == 3 * GiB
    # A tag that is not asleep makes vLLM ignore the whole wake.
    assert http.post(f"{vllm.url}/wake_up?tags=weights&tags=lora").json()["restored_bytes"] == 0
    assert vllm.resident_tags == set()
    assert http.get(f"{vllm.url}/sleep").status_code == 405
    assert http.post(f"{vllm.url}/release_memory_occupation", json={}).status_code == 404
    assert http.get(f"{vllm.url}/health").status_code == 200


def test_sglang_releases_and_resumes_given_tags(
    sglang: engine_server.EngineServer, http: httpx.Client
) -> None:
    reply = http.post(f"{sglang.url}/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert reply.json() == {"success": True, "freed_bytes": GiB, "host_bytes": 0}
    assert sglang.resident_tags == {"weights"}
    reply = http.post(f"{sglang.url}/release_memory_occupation", json={})
    assert reply.json()["freed_bytes"] == 3 * GiB
    assert sglang.device_bytes == 0 and sglang.host_bytes == 3 * GiB  # weights CPU backup
    reply = http.post(f"{sglang.url}/resume_memory_occupation", json={"tags": ["weights"]})
    assert reply.json()["restored_bytes"] == 3 * GiB
    assert (
        http.post(f"{sglang.url}/resume_memory_occupation", json={}).json()["restored_bytes"] == GiB
    )
    assert sglang.device_bytes == 4 * GiB


def test_sglang_without_cpu_backup_keeps_nothing_on_host(http: httpx.Client) -> None:
    with engine_server.EngineServer(dialect="sglang", weights_cpu_backup=False) as server:
        http.post(f"{server.url}/release_memory_occupation", json={})
        assert server.host_bytes == 0 and server.device_bytes == 0


@pytest.mark.parametrize(
    ("content", "content_type"),
    [(b"{}", "text/plain"), (b"not json", "application/json"), (b"[]", "application/json")],
    ids=["wrong-content-type", "not-json", "not-an-object"],
)
def test_sglang_refuses_a_body_fastapi_would_refuse(
    sglang: engine_server.EngineServer, http: httpx.Client, content: bytes, content_type: str
) -> None:
    reply = http.post(
        f"{sglang.url}/release_memory_occupation",
        content=content,
        headers={"Content-Type": content_type},
    )
    assert reply.status_code == 422
    assert sglang.device_bytes == 4 * GiB


def test_records_every_request_exactly(
    vllm: engine_server.EngineServer, http: httpx.Client
) -> None:
    http.post(f"{vllm.url}/wake_up?tags=a&tags=b", content=b"x")
    (request,) = vllm.requests
    assert request.method == "POST"
    assert request.target == "/wake_up?tags=a&tags=b"
    assert request.path == "/wake_up"
    assert request.query == (("tags", "a"), ("tags", "b"))
    assert request.body == b"x"
    assert vllm.connections == 1


def test_base_path_prefix(http: httpx.Client) -> None:
    with engine_server.EngineServer(dialect="vllm", base_path="/engine0/") as server:
        assert http.post(f"{server.url}/sleep").status_code == 404
        assert http.post(f"{server.url}/engine0/sleep").status_code == 200
        assert server.is_sleeping


def test_faults_count_path_and_apply(vllm: engine_server.EngineServer, http: httpx.Client) -> None:
    vllm.inject_fault(status=503, body="busy", path="/sleep", count=2)
    assert http.post(f"{vllm.url}/wake_up").status_code == 200  # other path: unaffected
    first = http.post(f"{vllm.url}/sleep")
    assert first.status_code == 503 and first.json() == {"error": "busy"}
    assert http.post(f"{vllm.url}/sleep").status_code == 503
    assert not vllm.is_sleeping  # apply=False: nothing happened
    vllm.inject_fault(status=500, apply=True)
    assert http.post(f"{vllm.url}/sleep").status_code == 500
    assert vllm.is_sleeping  # the work was done, the answer was an error


def test_drop_closes_without_an_answer(
    vllm: engine_server.EngineServer, http: httpx.Client
) -> None:
    vllm.inject_fault(drop=True, apply=True)
    with pytest.raises(httpx.RemoteProtocolError):
        http.post(f"{vllm.url}/sleep")
    assert vllm.is_sleeping


def test_gate_holds_a_request_until_released(
    vllm: engine_server.EngineServer, http: httpx.Client
) -> None:
    gate = threading.Event()
    vllm.inject_fault(gate=gate)
    replies: list[int] = []
    client = threading.Thread(
        target=lambda: replies.append(http.post(f"{vllm.url}/sleep").status_code)
    )
    client.start()
    assert vllm.wait_for_requests(1, timeout=10)
    assert not vllm.is_sleeping and replies == []  # arrived, held
    gate.set()
    client.join(10)
    assert replies == [200] and vllm.is_sleeping


def test_stop_releases_held_requests() -> None:
    server = engine_server.EngineServer(dialect="vllm").start()
    gate = threading.Event()
    server.inject_fault(gate=gate, delay_s=60)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            with httpx.Client(trust_env=False, timeout=30) as client:
                client.post(f"{server.url}/sleep")
        except httpx.HTTPError as exc:
            errors.append(exc)

    client = threading.Thread(target=call)
    client.start()
    assert server.wait_for_requests(1, timeout=10)
    server.stop()
    client.join(10)
    assert not client.is_alive() and gate.is_set()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dialect"):
        engine_server.EngineServer(dialect="tgi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_bytes"):
        engine_server.EngineServer(dialect="vllm", memory_bytes=5, tags={"weights": 4})
