"""Pure parts of the app-endpoint backend: allow-list patterns, settings, config validation."""

from __future__ import annotations

import pytest

from tslice.agent.backends import app_endpoint, app_endpoint_dialects, app_endpoint_hosts
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import errors

LOOPBACK = app_endpoint_hosts.AppEndpointSettings().allowed_hosts


def allowed(patterns: list[str], endpoint: str) -> bool:
    config = pb.BackendConfig(
        app_endpoint=pb.AppEndpointConfig(app=pb.APP_VLLM, endpoints=[endpoint])
    )
    hosts = [app_endpoint_hosts.HostPattern.parse(p) for p in patterns]
    try:
        app_endpoint_dialects.plan(config, allowed_hosts=hosts)
    except app_endpoint_dialects.EndpointNotAllowedError:
        return False
    return True


@pytest.mark.parametrize(
    ("patterns", "endpoint", "expected"),
    [
        (["127.0.0.1"], "http://127.0.0.1:8000", True),
        (["127.0.0.1"], "http://127.0.0.2:8000", False),
        (["localhost"], "http://LOCALHOST.:8000/", True),
        (["::1"], "http://[::1]:8000", True),
        (["::1"], "http://[0:0::1]:8000", True),
        (["[::1]:8000"], "http://[::1]:8000", True),
        (["[::1]:8000"], "http://[::1]:8001", False),
        (["127.0.0.1:8000"], "http://127.0.0.1:8000/v1", True),
        (["127.0.0.1:8000"], "http://127.0.0.1:9000", False),
        (["127.0.0.1:80"], "http://127.0.0.1/", True),
        (["127.0.0.1:443"], "https://127.0.0.1/", True),
        (["10.0.0.0/8"], "http://10.1.2.3:8000", True),
        (["10.0.0.0/8"], "http://11.1.2.3:8000", False),
        (["fd00::/8"], "http://[fd12::1]:8000", True),
        (["*.svc.cluster.local"], "http://vllm.ns.svc.cluster.local:8000", True),
        (["*.svc.cluster.local"], "http://svc.cluster.local.evil.com:8000", False),
        (["vllm-*:8000"], "http://vllm-0:8000", True),
        (["vllm-*:8000"], "http://vllm-0:8001", False),
        # The textual host decides, never a resolver: these all reach 127.0.0.1 on Linux.
        (["127.0.0.1"], "http://2130706433:8000", False),
        (["127.0.0.1"], "http://127.1:8000", False),
        (["127.0.0.1"], "http://0x7f.0.0.1:8000", False),
        (["127.0.0.1"], "http://[::ffff:127.0.0.1]:8000", False),
        # A glob over names does not match IP literals by accident, and a CIDR no names.
        (["10.0.0.0/8"], "http://10.example.com", False),
        (["*"], "http://example.com:1234", True),
        ([], "http://127.0.0.1:8000", False),
    ],
)
def test_allow_list(patterns: list[str], endpoint: str, expected: bool) -> None:
    assert allowed(patterns, endpoint) is expected


def test_default_allow_list_is_loopback_only() -> None:
    assert [p.text for p in LOOPBACK] == ["127.0.0.1", "localhost", "::1"]
    for endpoint in ("http://example.com:8000", "http://10.0.0.1", "http://169.254.169.254/"):
        assert not allowed(["127.0.0.1", "localhost", "::1"], endpoint)


@pytest.mark.parametrize(
    "text", ["", "  ", "host:http", "host:0", "host:70000", "[::1", "[::1]x", "a b", "a/b"]
)
def test_bad_host_patterns(text: str) -> None:
    with pytest.raises(ValueError, match=r"host pattern|empty"):
        app_endpoint_hosts.HostPattern.parse(text)


def test_settings_defaults_and_values() -> None:
    settings = app_endpoint_hosts.AppEndpointSettings.from_mapping({})
    assert settings.timeout_s == 300 and settings.connect_timeout_s == 10
    assert [p.text for p in settings.allowed_hosts] == ["127.0.0.1", "localhost", "::1"]
    settings = app_endpoint_hosts.AppEndpointSettings.from_mapping(
        {"allowed_hosts": ["10.0.0.0/8", "*.local:8000"], "timeout_s": 900, "connect_timeout_s": 1}
    )
    assert [p.text for p in settings.allowed_hosts] == ["10.0.0.0/8", "*.local:8000"]
    assert settings.timeout_s == 900 and settings.connect_timeout_s == 1


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"allowed_hosts": ["ok", "a/b"]}, "allowed_hosts.1"),
        ({"allowed_hosts": "127.0.0.1"}, "allowed_hosts"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"connect_timeout_s": -1}, "connect_timeout_s"),
        ({"timeout": 5}, "timeout"),
    ],
)
def test_bad_settings_name_the_field(settings: dict[str, object], field: str) -> None:
    with pytest.raises(errors.ConfigError, match=rf"app-endpoint backend settings: {field}\b"):
        app_endpoint.AppEndpointBackend.create(settings)


def endpoint_config(**fields: object) -> pb.BackendConfig:
    values: dict[str, object] = {"app": pb.APP_VLLM, "endpoints": ["http://127.0.0.1:8000"]}
    values.update(fields)
    return pb.BackendConfig(app_endpoint=pb.AppEndpointConfig(**values))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "needs backend_config.app_endpoint"),
        (pb.BackendConfig(cuda=pb.CudaBackendConfig()), "needs backend_config.app_endpoint"),
        (endpoint_config(app=pb.APP_UNSPECIFIED), "unknown or unspecified"),
        (endpoint_config(endpoints=[]), "is empty"),
        (endpoint_config(endpoints=["127.0.0.1:8000"]), "http:// or https://"),
        (endpoint_config(endpoints=["ftp://127.0.0.1/"]), "http:// or https://"),
        (endpoint_config(endpoints=["http:///x"]), "no host"),
        (endpoint_config(endpoints=["http://u:p@127.0.0.1/"]), "credentials"),
        (endpoint_config(endpoints=["http://127.0.0.1/?a=1"]), "query string"),
        (endpoint_config(endpoints=["http://127.0.0.1/#x"]), "fragment"),
        (endpoint_config(endpoints=["http://127.0.0.1:99999/"]), "invalid port"),
        (
            endpoint_config(endpoints=["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"]),
            "twice",
        ),
        (endpoint_config(tags=["weights", ""]), "empty tag"),
    ],
)
def test_invalid_configs(config: pb.BackendConfig | None, message: str) -> None:
    with pytest.raises(app_endpoint_dialects.InvalidEndpointConfigError, match=message) as info:
        app_endpoint_dialects.plan(config, allowed_hosts=LOOPBACK, job_id="job-1")
    assert not isinstance(info.value, app_endpoint_dialects.EndpointNotAllowedError)


def test_plan_normalises_trailing_slash_and_keeps_base_path() -> None:
    engines = app_endpoint_dialects.plan(
        endpoint_config(endpoints=["http://127.0.0.1:8000/engine0//"], tags=["weights"]),
        allowed_hosts=LOOPBACK,
    )
    (url,) = engines.bases
    assert str(url) == "http://127.0.0.1:8000/engine0"
    request = app_endpoint_dialects.suspend_request(
        engines.dialect, url, level=2, tags=engines.tags
    )
    assert request.describe() == "POST /engine0/sleep?level=2"
    assert str(app_endpoint_dialects.resume_request(engines.dialect, url, tags=()).url).endswith(
        "/engine0/wake_up"
    )


def test_refusal_message_says_how_to_fix() -> None:
    with pytest.raises(app_endpoint_dialects.EndpointNotAllowedError) as info:
        app_endpoint_dialects.plan(
            endpoint_config(endpoints=["http://10.0.0.1"]), allowed_hosts=LOOPBACK
        )
    text = str(info.value)
    assert "'10.0.0.1' port 80" in text
    assert "allowed_hosts (127.0.0.1, localhost, ::1)" in text
