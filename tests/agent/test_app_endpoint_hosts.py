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
        (["127.0.0.1:8000"], "http://127.0.0.1:8000", True),
        (["127.0.0.1:8000"], "http://127.0.0.2:8000", False),
        (["localhost:8000"], "http://LOCALHOST.:8000/", True),
        (["[::1]:8000"], "http://[::1]:8000", True),
        (["[::1]:8000"], "http://[0:0::1]:8000", True),
        (["[::1]:8000"], "http://[::1]:8001", False),
        (["127.0.0.1:8000"], "http://127.0.0.1:9000", False),
        (["127.0.0.1:8000-8007"], "http://127.0.0.1:8007", True),
        (["127.0.0.1:8000-8007"], "http://127.0.0.1:8008", False),
        (["127.0.0.1:80"], "http://127.0.0.1/", True),
        (["127.0.0.1:443"], "https://127.0.0.1/", True),
        (["127.0.0.1:443"], "http://127.0.0.1/", False),
        (["10.0.0.0/8:8000"], "http://10.1.2.3:8000", True),
        (["10.0.0.0/8:8000"], "http://11.1.2.3:8000", False),
        (["[fd00::/8]:8000"], "http://[fd12::1]:8000", True),
        (["*.svc.cluster.local:8000"], "http://vllm.ns.svc.cluster.local:8000", True),
        (["*.svc.cluster.local:8000"], "http://svc.cluster.local.evil.com:8000", False),
        (["vllm-*:8000"], "http://vllm-0:8000", True),
        (["vllm-*:8000"], "http://vllm-0:8001", False),
        # The textual host decides, never a resolver: these all reach 127.0.0.1 on Linux.
        (["127.0.0.1:8000"], "http://2130706433:8000", False),
        (["127.0.0.1:8000"], "http://127.1:8000", False),
        (["127.0.0.1:8000"], "http://0x7f.0.0.1:8000", False),
        (["127.0.0.1:8000"], "http://[::ffff:127.0.0.1]:8000", False),
        # A glob over names does not match IP literals by accident, and a CIDR no names.
        (["10.0.0.0/8:80"], "http://10.example.com", False),
        (["*:1234"], "http://example.com:1234", True),
        ([], "http://127.0.0.1:8000", False),
    ],
)
def test_allow_list(patterns: list[str], endpoint: str, expected: bool) -> None:
    assert allowed(patterns, endpoint) is expected


def test_default_allow_list_is_the_engines_ports_on_loopback() -> None:
    assert [p.text for p in LOOPBACK] == list(app_endpoint_hosts.DEFAULT_ALLOWED_HOSTS)
    texts = [p.text for p in LOOPBACK]
    assert texts[:3] == ["127.0.0.1:8000", "localhost:8000", "[::1]:8000"]
    defaults = list(app_endpoint_hosts.DEFAULT_ALLOWED_HOSTS)
    for endpoint in ("http://127.0.0.1:8000", "http://localhost:30000", "http://[::1]:8000"):
        assert allowed(defaults, endpoint)
    for endpoint in (
        "http://127.0.0.1:22",  # another service of an allowed host
        "http://127.0.0.1:8001",
        "http://example.com:8000",
        "http://10.0.0.1:8000",
        "http://169.254.169.254/",
    ):
        assert not allowed(defaults, endpoint)


@pytest.mark.parametrize("text", ["127.0.0.1", "localhost", "::1", "*.svc.cluster.local"])
def test_an_entry_without_a_port_is_refused_naming_the_form(text: str) -> None:
    # Issue 10: a bare host allowed every port of it (any local service). Old configs that
    # list bare hosts fail at start with the entry to write instead.
    with pytest.raises(errors.ConfigError) as info:
        app_endpoint_hosts.AppEndpointSettings.from_mapping({"allowed_hosts": ["ok:1", text]})
    message = str(info.value)
    shown = "[::1]" if text == "::1" else text
    assert "allowed_hosts.1" in message and "names no port" in message
    assert f"{shown}:8000" in message and f"{shown}:30000" in message


@pytest.mark.parametrize(
    "text",
    ["", "  ", "host:http", "host:0", "host:70000", "h:9-8", "h:1-", "[::1", "[::1]x", "a b:1"],
)
def test_bad_host_patterns(text: str) -> None:
    with pytest.raises(ValueError, match=r"host pattern|empty"):
        app_endpoint_hosts.HostPattern.parse(text)


def test_settings_defaults_and_values() -> None:
    settings = app_endpoint_hosts.AppEndpointSettings.from_mapping({})
    assert settings.timeout_s == 300 and settings.connect_timeout_s == 10
    assert [p.text for p in settings.allowed_hosts] == list(
        app_endpoint_hosts.DEFAULT_ALLOWED_HOSTS
    )
    settings = app_endpoint_hosts.AppEndpointSettings.from_mapping(
        {
            "allowed_hosts": ["10.0.0.0/8:80", "*.local:8000"],
            "timeout_s": 900,
            "connect_timeout_s": 1,
        }
    )
    assert [p.text for p in settings.allowed_hosts] == ["10.0.0.0/8:80", "*.local:8000"]
    assert settings.timeout_s == 900 and settings.connect_timeout_s == 1


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"allowed_hosts": ["ok:1", "a/b:1"]}, "allowed_hosts.1"),
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
        (endpoint_config(endpoints=["http://127.0.0.1:8000/v1"]), "without a path"),
        (
            endpoint_config(endpoints=["http://127.0.0.1:8000", "http://127.0.0.1:8000/"]),
            "twice",
        ),
        (endpoint_config(tags=["weights", ""]), "empty tag"),
    ],
)
def test_invalid_configs(config: pb.BackendConfig | None, message: str) -> None:
    with pytest.raises(app_endpoint_dialects.InvalidEndpointConfigError, match=message) as info:
        app_endpoint_dialects.plan(config, allowed_hosts=LOOPBACK, job_id="job-1")
    assert not isinstance(info.value, app_endpoint_dialects.EndpointNotAllowedError)


def test_plan_takes_the_base_url_and_the_dialect_its_paths() -> None:
    engines = app_endpoint_dialects.plan(
        endpoint_config(endpoints=["http://127.0.0.1:8000/"], tags=["weights"]),
        allowed_hosts=LOOPBACK,
    )
    (url,) = engines.bases
    request = app_endpoint_dialects.suspend_request(
        engines.dialect, url, level=2, tags=engines.tags
    )
    assert request.describe() == "POST /sleep?level=2"
    assert str(app_endpoint_dialects.resume_request(engines.dialect, url, tags=()).url) == (
        "http://127.0.0.1:8000/wake_up"
    )


def test_refusal_message_says_how_to_fix() -> None:
    with pytest.raises(app_endpoint_dialects.EndpointNotAllowedError) as info:
        app_endpoint_dialects.plan(
            endpoint_config(endpoints=["http://10.0.0.1"]), allowed_hosts=LOOPBACK
        )
    text = str(info.value)
    assert "'10.0.0.1' port 80" in text
    assert "allowed_hosts (127.0.0.1:8000, localhost:8000, [::1]:8000, " in text
    assert "as '10.0.0.1:80'" in text
