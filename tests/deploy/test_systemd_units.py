"""The systemd units of deploy/systemd/: what the issue asks of them, read with a parser
(restart always, state under /var/lib/tslice, hardening, the agent as root and why), and
``systemd-analyze verify`` on each (Debian's systemd runs it without being PID 1;
skipped only where it is not installed: `.ci/run` installs it)."""

from __future__ import annotations

import configparser
import pathlib
import shlex
import subprocess
import sys

import pytest

from tests import debian_tools

UNITS = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "systemd"
INSTALLED = "/usr/local/bin/tslice"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / name).read_text())
    return parser


@pytest.mark.parametrize("name", ["tslice-orchestrator.service", "tslice-agent.service"])
def test_each_unit_restarts_always_keeps_state_under_var_lib_tslice_and_runs_tslice(
    name: str,
) -> None:
    service = unit(name)["Service"]
    assert service["Restart"] == "always"
    role = name.removeprefix("tslice-").removesuffix(".service")
    assert service["StateDirectory"] == f"tslice/{role}"  # /var/lib/tslice/<role>
    argv = shlex.split(service["ExecStart"])
    assert argv[:2] == [INSTALLED, role]
    assert argv[argv.index("--state-dir") + 1] == f"/var/lib/tslice/{role}"
    assert argv[argv.index("--config") + 1] == f"/etc/tslice/{role}.yaml"
    for hardening in ("NoNewPrivileges", "ProtectKernelModules", "ProtectControlGroups"):
        assert service[hardening] == "yes"
    assert unit(name)["Install"]["WantedBy"] == "multi-user.target"


def test_the_orchestrator_runs_unprivileged_and_the_agent_as_root_with_what_that_needs() -> None:
    orchestrator = unit("tslice-orchestrator.service")["Service"]
    assert orchestrator["User"] == "tslice"
    assert orchestrator["CapabilityBoundingSet"] == ""
    assert orchestrator["ProtectSystem"] == "strict"
    assert orchestrator["PrivateDevices"] == "yes"
    agent = unit("tslice-agent.service")["Service"]
    assert agent["User"] == "root"
    # It reaches every GPU and every process: none of what would hide them.
    for hiding in ("PrivateDevices", "ProtectProc", "CapabilityBoundingSet", "SystemCallFilter"):
        assert hiding not in agent
    assert (agent["RuntimeDirectory"], agent["RuntimeDirectoryPreserve"]) == ("tslice", "yes")
    sysusers = (UNITS / "tslice-sysusers.conf").read_text()
    assert "u tslice - " in sysusers


@pytest.mark.parametrize("name", ["tslice-orchestrator.service", "tslice-agent.service"])
def test_systemd_analyze_verify_finds_nothing(name: str, tmp_path: pathlib.Path) -> None:
    # Verified with the tslice of this venv where the unit has /usr/local/bin/tslice (verify
    # checks that the command exists).
    here = str(pathlib.Path(sys.executable).with_name("tslice"))
    copy = tmp_path / name
    copy.write_text((UNITS / name).read_text().replace(INSTALLED, here))
    analyze = debian_tools.binary("systemd-analyze", "systemd")
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert (done.returncode, done.stderr.strip()) == (0, "")
