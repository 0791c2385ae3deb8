"""``tslice admin reset-fault|drain|resume|evict`` against an orchestrator with
authentication on: the admin's certificate may, a job's may not (one line naming the role
it needs)."""

from __future__ import annotations

import pytest

import tslice
from tests.security.conftest import SecureStack
from tslice.cli import main


def _run(
    stack: SecureStack, identity: str, monkeypatch: pytest.MonkeyPatch, *args: str
) -> int | str | None:
    for name, value in stack.certs.env(identity).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        main.main(["admin", "reset-fault", "reset-me", "--addr", stack.orchestrator, *args])
    return exited.value.code


def _made(stack: SecureStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group exists once a job acquired it (local mode), and is idle again after."""
    for name, value in stack.certs.env("job:job-a").items():
        monkeypatch.setenv(name, value)
    with tslice.Client(stack.orchestrator, job_id="job-a", lease_s=None) as job:
        job.acquire("reset-me")
        job.yield_("reset-me")


def test_reset_fault_needs_the_admin_role(
    secure_stack: SecureStack,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _made(secure_stack, monkeypatch)
    assert _run(secure_stack, "job:job-a", monkeypatch) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the admin role" in err[0], err
    assert _run(secure_stack, "admin", monkeypatch, "--json") == 0
    assert '"cleared": []' in capsys.readouterr().out


def test_evict_drain_and_resume_need_the_admin_role(
    secure_stack: SecureStack,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = ["--addr", secure_stack.orchestrator]
    commands = [
        ["admin", "drain", "reset-me"],
        ["admin", "resume", "reset-me"],
        ["admin", "evict", "reset-me", "job-a"],
    ]
    _made(secure_stack, monkeypatch)
    for command in commands:
        with pytest.raises(SystemExit) as exited:
            main.main([*command, *address])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 1 and len(err) == 1 and "needs the admin role" in err[0], err
    for name, value in secure_stack.certs.env("admin").items():
        monkeypatch.setenv(name, value)
    for command in commands[:2]:
        with pytest.raises(SystemExit) as exited:
            main.main([*command, *address])
        assert exited.value.code == 0, capsys.readouterr()
    assert "resumed" in capsys.readouterr().out
