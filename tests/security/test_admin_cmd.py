"""``tslice admin reset-fault`` (ClearDegraded) against an orchestrator with authentication
on: the admin's certificate may, a job's may not (one line naming the role it needs)."""

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


def test_reset_fault_needs_the_admin_role(
    secure_stack: SecureStack,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The group exists once a job acquired it (local mode), and is idle again after.
    for name, value in secure_stack.certs.env("job:job-a").items():
        monkeypatch.setenv(name, value)
    with tslice.Client(secure_stack.orchestrator, job_id="job-a", lease_s=None) as job:
        job.acquire("reset-me")
        job.yield_("reset-me")
    assert _run(secure_stack, "job:job-a", monkeypatch) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the admin role" in err[0], err
    assert _run(secure_stack, "admin", monkeypatch, "--json") == 0
    assert '"cleared": []' in capsys.readouterr().out
