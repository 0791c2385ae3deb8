"""Kubernetes mode's start-up errors say what to do (no traceback)."""

from __future__ import annotations

import pathlib
import sys

import pytest

from tslice.common import errors
from tslice.orchestrator import app, config, kube


def test_without_the_extra_the_mode_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightkube", None)  # as if it were not installed
    for name in ("discovery", "watch"):  # imported again, from nothing
        monkeypatch.delitem(sys.modules, f"tslice.orchestrator.kube.{name}", raising=False)
        monkeypatch.delattr(kube, name, raising=False)
    with pytest.raises(errors.ConfigError, match=r"pip install 'tslice\[kubernetes\]'"):
        app._discovery(config.KubeSettings())


async def test_unreadable_credentials_stop_the_start(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("lightkube")
    from tslice.orchestrator.kube import discovery

    missing = tmp_path / "no-such-kubeconfig"
    found = discovery.Discovery(config.KubeSettings(kubeconfig=missing))
    with pytest.raises(errors.ConfigError) as err:
        await found.start()
    assert f"cannot load Kubernetes credentials ({missing})" in str(err.value)
    assert "give --kubeconfig FILE" in str(err.value)
