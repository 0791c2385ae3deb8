"""Slurm identity: the token the prolog writes, the verifier that checks it, the names a
job may act as, and ``tslice slurm prolog`` itself (files, modes, owner; never failing)."""

from __future__ import annotations

import os
import pathlib
import pwd
import subprocess
import sys

import pytest

from tslice.common import errors
from tslice.orchestrator.slurm import identity, jobs, token
from tslice.security import identities

KEY = b"k" * 32


def principal(
    verifier: identity.SlurmVerifier, job: str, user: str, array: str = ""
) -> identities.Principal:
    found = verifier.verify(
        identities.Presented(token=token.mint(KEY, token.Claims(job, array, user)))
    )
    assert found is not None
    return found


def test_a_token_names_its_job_and_user_and_only_the_key_makes_one() -> None:
    minted = token.mint(KEY, token.Claims("12", "10", "alice"))
    assert token.read(KEY, minted) == token.Claims("12", "10", "alice")
    assert token.read(KEY, "some-other-token") is None  # not ours: the next verifier's
    forged = minted.replace(":alice:", ":bob:")
    for bad in (forged, minted[:-1] + "0", token.mint(b"o" * 32, token.Claims("12", "", "a"))):
        with pytest.raises(token.BadToken):
            token.read(KEY, bad)
    with pytest.raises(ValueError, match="is not a number"):
        token.mint(KEY, token.Claims("12;rm", "", "alice"))
    with pytest.raises(ValueError, match="is not a user name"):
        token.mint(KEY, token.Claims("12", "", "a:b"))


def test_a_job_acts_as_its_slurm_ids_and_names_no_other_user_holds() -> None:
    book = jobs.JobBook()
    verifier = identity.SlurmVerifier(KEY, book=book)
    alice = principal(verifier, "12", "alice", array="10")
    assert alice.roles == frozenset({identities.JOB})
    assert alice.may_act_as("12") and alice.may_act_as("10")
    assert not alice.may_act_as("13")  # another Slurm job's id, whoever's
    assert alice.may_act_as("grpo-7")  # a name: now bound to alice's job 12
    bob = principal(verifier, "20", "bob")
    assert not bob.may_act_as("grpo-7")
    assert not bob.may_act_as("12")
    assert principal(verifier, "14", "alice").may_act_as("grpo-7")  # alice's other job
    assert book.bound("grpo-7") == ("alice", frozenset({"12", "14"}))


def test_a_forged_token_and_an_ended_jobs_token_are_refused() -> None:
    book = jobs.JobBook()
    verifier = identity.SlurmVerifier(KEY, book=book)
    minted = token.mint(KEY, token.Claims("12", "", "alice"))
    with pytest.raises(identities.Unauthenticated, match="does not check out"):
        verifier.verify(identities.Presented(token=minted[:-2] + "00"))
    assert verifier.verify(identities.Presented(token="not-ours")) is None
    assert verifier.verify(identities.Presented(identities=("admin",))) is None
    book.update(jobs.parse_jobs("12|12|CANCELLED|alice"))
    with pytest.raises(
        identities.Unauthenticated, match=r"Slurm job 12 is void: the job ended \(CANC"
    ):
        verifier.verify(identities.Presented(token=minted))


def test_the_verifier_factory_reads_the_key_and_names_the_fix(tmp_path: pathlib.Path) -> None:
    key = tmp_path / "job.key"
    key.write_text("ab" * 32 + "\n")
    assert isinstance(identity.verifier({"key_file": str(key)}), identity.SlurmVerifier)
    with pytest.raises(errors.ConfigError, match=r"cannot read the Slurm job key .*openssl rand"):
        identity.verifier({"key_file": str(tmp_path / "missing")})
    key.write_text("short")
    with pytest.raises(errors.ConfigError, match="has 5 bytes; it needs at least 32"):
        identity.verifier({"key_file": str(key)})
    with pytest.raises(errors.ConfigError, match="unknown key 'keyfile'"):
        identity.verifier({"keyfile": str(key)})


def prolog(tmp_path: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tslice", "slurm", "prolog",
         "--key-file", str(tmp_path / "job.key"), "--run-dir", str(tmp_path / "run")],
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip


def test_the_prolog_writes_the_users_credential_and_never_fails(tmp_path: pathlib.Path) -> None:
    (tmp_path / "job.key").write_bytes(KEY)
    nobody = pwd.getpwnam("nobody")
    env = {
        "SLURM_JOB_ID": "55",
        "SLURM_JOB_USER": "nobody",
        "SLURM_JOB_UID": str(nobody.pw_uid),
        "SLURM_JOB_GID": str(nobody.pw_gid),
    }
    done = prolog(tmp_path, env)
    assert done.returncode == 0, done.stderr
    written = tmp_path / "run" / "55" / "token"
    assert token.read(KEY, written.read_text().strip()) == token.Claims("55", "", "nobody")
    assert (written.stat().st_mode & 0o777, written.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    if os.geteuid() == 0:
        assert written.stat().st_uid == written.parent.stat().st_uid == nobody.pw_uid
    # No key: one line on stderr (slurmd's log), exit 0 (a failing Prolog drains the node).
    (tmp_path / "job.key").unlink()
    done = prolog(tmp_path, {**env, "SLURM_JOB_ID": "56"})
    assert done.returncode == 0
    assert "no credential written: cannot read the Slurm job key" in done.stderr
    assert not (tmp_path / "run" / "56").exists()
