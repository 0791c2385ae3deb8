"""Kubernetes mode's start-up errors say what to do (no traceback)."""

from __future__ import annotations

import json
import pathlib
import socket
import sys

import pytest

from tests.harness.servers import Server
from tslice.common import errors
from tslice.orchestrator import app, config, kube


def test_without_the_extra_the_mode_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightkube", None)  # as if it were not installed
    for name in ("discovery", "watch"):  # imported again, from nothing
        monkeypatch.delitem(sys.modules, f"tslice.orchestrator.kube.{name}", raising=False)
        monkeypatch.delattr(kube, name, raising=False)
    with pytest.raises(errors.ConfigError, match=r"pip install 'tslice\[kubernetes\]'"):
        app._discovery(
            config.OrchestratorConfig(topology=config.Topology(), kubernetes=config.KubeSettings())
        )


async def test_unreadable_credentials_stop_the_start(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("lightkube")
    from tslice.orchestrator.kube import discovery

    missing = tmp_path / "no-such-kubeconfig"
    found = discovery.Discovery(config.KubeSettings(kubeconfig=missing))
    with pytest.raises(errors.ConfigError) as err:
        await found.start()
    assert f"cannot load Kubernetes credentials ({missing})" in str(err.value)
    assert "give --kubeconfig FILE" in str(err.value)


def test_sigterm_while_the_api_server_does_not_answer_stops_at_once(
    tmp_path: pathlib.Path,
) -> None:
    pytest.importorskip("lightkube")
    with socket.socket() as unused:  # a port where nothing listens
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    args = [
        "orchestrator", "--kubernetes", "--kubeconfig", str(kubeconfig), "--port", "0",
        "--metrics-port", "0", "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    server = Server(args[0], args[1:], tmp_path / "orchestrator.log")
    try:
        # It says why it waits, and what to check.
        server.wait_for(r"watch of nodes failed .*check the API server address")
        server.terminate()
        assert server.proc.wait(timeout=15) == 0
        server.wait_for(r"orchestrator stopped")
    finally:
        server.stop()
