"""The verifier's rules without servers: tokens (inline, from a file, rotated), the
certificate convention, literal job ids and explicit prefixes, and config errors that
name the field."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import threading

import pytest
import yaml

from tslice.common import errors
from tslice.security import identities, tls


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_rotated_tokens_file_is_read_again_and_the_old_token_refused(
    tmp_path: pathlib.Path,
) -> None:
    tokens = tmp_path / "tokens.yaml"
    _write(tokens, f"tokens: [{{name: ops, roles: [admin], sha256: {_sha('old')}}}]\n")
    verifier = identities.StaticVerifier(
        tokens_file=tokens, load_yaml=yaml.safe_load, reload_check_s=0
    )
    principal = verifier.verify(identities.Presented(token="old"))
    assert principal == identities.Principal("ops", frozenset({"admin"}), (), "token")
    _write(tokens, f"tokens: [{{name: ops, roles: [admin], sha256: {_sha('new')}}}]\n")
    _reread(verifier)
    assert verifier.verify(identities.Presented(token="new")) == principal
    with pytest.raises(identities.Unauthenticated):
        verifier.verify(identities.Presented(token="old"))
    _write(tokens, "tokens: [{name: ops, roles: [wizard], sha256: 00}]\n")  # a bad edit
    _reread(verifier)
    assert (
        verifier.verify(identities.Presented(token="new")) == principal
    )  # the last good file stays


def _reread(verifier: identities.StaticVerifier) -> None:
    """A call's check starts a re-read (in a thread of its own); wait for it. A re-read
    an earlier call started may still run (it may have looked before the file changed,
    and a call starts none while one runs): that one is waited out first."""
    verifier.settle()
    with contextlib.suppress(identities.Unauthenticated):  # (its own answer is not looked at)
        verifier.verify(identities.Presented(token="any"))
    verifier.settle()


def test_a_client_token_file_is_read_again_when_it_changes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    _write(path, "first\n")
    source = tls.TokenSource(path=path)
    assert source.metadata() == (("authorization", "Bearer first"),)
    _write(path, "second\n")
    assert source.value() == "second"


def test_certificate_identities_follow_the_convention_unless_mapped() -> None:
    mapped = identities.Grant.parse(
        {"name": "ci-bot", "roles": ["job"], "job_prefixes": ["ci/"]}, where="x", token=False
    )
    verifier = identities.StaticVerifier(identities=[mapped])

    def principal(identity: str) -> identities.Principal | None:
        return verifier.verify(identities.Presented(identities=(identity,)))

    assert principal("orchestrator") == identities.Principal(
        "orchestrator", frozenset({"orchestrator"}), (), "certificate"
    )
    job = principal("job:train/7")
    assert job is not None and job.may_act_as("train/7") and not job.may_act_as("train/8")
    bot = principal("ci-bot")
    assert bot is not None and bot.may_act_as("ci/run-1") and not bot.may_act_as("prod/run-1")
    stranger = principal("someone")
    assert stranger is not None and not stranger.roles  # verified, may only read
    assert verifier.verify(identities.Presented()) is None  # nothing presented


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"tokens": [{"name": "a", "roles": ["root"], "sha256": _sha("t")}]},
            "'root' is not a role",
        ),
        ({"tokens": [{"name": "a", "roles": [], "jobs": ["j"], "sha256": _sha("t")}]}, "add it"),
        ({"tokens": [{"name": "a", "roles": ["job"], "sha256": "beef"}]}, "is not a SHA-256"),
        ({"tokens": [{"name": "a", "roles": ["job"]}]}, "needs sha256"),
        ({"token": []}, "unknown key 'token'"),
    ],
)
def test_a_bad_auth_section_names_the_field(section: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        identities.AuthSettings.from_mapping(section)


def test_auth_is_off_without_the_section_or_when_disabled() -> None:
    assert identities.AuthSettings.from_mapping(None) is None
    assert identities.AuthSettings.from_mapping({"enabled": False, "tokens": []}) is None
    assert identities.AuthSettings.from_mapping({}) is not None  # certificates only


class _PodTokens:
    """A stand-in for a Kubernetes verifier: a service-account token whose pod carries
    the label timeslice.io/job-id (here a table instead of a TokenReview)."""

    def __init__(self, settings: dict[str, object]) -> None:
        self._pods = dict(settings["pods"])  # type: ignore[call-overload]

    def verify(self, presented: identities.Presented) -> identities.Principal | None:
        job = self._pods.get(presented.token)
        if job is None:
            return None  # not ours: the static tokens and certificates decide
        return identities.Principal(
            f"pod:{job}", frozenset({identities.JOB}), (str(job),), "kubernetes"
        )


def test_a_plugged_in_verifier_is_asked_first_and_the_static_rules_still_apply() -> None:
    settings = identities.AuthSettings.from_mapping(
        {
            "verifier": f"{__name__}:_PodTokens",
            "verifier_settings": {"pods": {"sa-token-1": "grpo-7b"}},
            "tokens": [{"name": "ops", "roles": ["admin"], "sha256": _sha("ops-token")}],
        }
    )
    assert settings is not None
    verifier = settings.build()
    pod = verifier.verify(identities.Presented(token="sa-token-1"))
    assert pod is not None and pod.via == "kubernetes" and pod.may_act_as("grpo-7b")
    ops = verifier.verify(identities.Presented(token="ops-token"))
    assert ops is not None and ops.roles == {"admin"}
    with pytest.raises(identities.Unauthenticated):
        verifier.verify(identities.Presented(token="neither"))


# ---- the tokens file: rotation, what is read, off the caller's thread (issue 21 §3) ----


def _ops(token: str) -> str:
    return f"tokens: [{{name: ops, roles: [admin], sha256: {_sha(token)}}}]\n"


def test_a_tokens_file_removed_during_a_rotation_keeps_the_last_good_tokens(
    tmp_path: pathlib.Path,
) -> None:
    """`rm` then `cp`: between the two the file is missing; the check that meets the gap
    must neither fail the call nor drop the tokens."""
    tokens = tmp_path / "tokens.yaml"
    _write(tokens, _ops("old"))
    verifier = identities.StaticVerifier(
        tokens_file=tokens, load_yaml=yaml.safe_load, reload_check_s=0
    )
    tokens.unlink()
    _reread(verifier)
    assert verifier.verify(identities.Presented(token="old")) is not None
    _write(tokens, _ops("new"))
    _reread(verifier)
    assert verifier.verify(identities.Presented(token="new")) is not None


@pytest.mark.parametrize("kind", ["device", "fifo", "huge"])
def test_a_tokens_file_that_is_no_small_regular_file_is_not_read(
    tmp_path: pathlib.Path, kind: str
) -> None:
    """/dev/zero was read until the OOM killer came; a FIFO blocked the open."""
    tokens = tmp_path / "tokens.yaml"
    if kind == "device":
        tokens.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(tokens)
    else:
        _write(tokens, _ops("t") + "#" * (identities.MAX_TOKENS_FILE_BYTES + 1))
    message = "larger than" if kind == "huge" else "not a regular file"
    with pytest.raises(errors.ConfigError, match=message):
        identities.StaticVerifier(tokens_file=tokens, load_yaml=yaml.safe_load)
    # At a reload: the last good tokens stay.
    good = tmp_path / "good.yaml"
    _write(good, _ops("t"))
    verifier = identities.StaticVerifier(
        tokens_file=good, load_yaml=yaml.safe_load, reload_check_s=0
    )
    good.unlink()
    os.rename(tokens, good)
    _reread(verifier)
    assert verifier.verify(identities.Presented(token="t")) is not None


def test_a_slow_tokens_file_never_stalls_a_call(tmp_path: pathlib.Path) -> None:
    """The re-read (here a parser that does not return until told) runs beside the calls:
    they are answered meanwhile with the tokens read last."""
    tokens = tmp_path / "tokens.yaml"
    _write(tokens, _ops("old"))
    release = threading.Event()
    parsing = threading.Event()

    def slow_yaml(text: str) -> object:
        if "new" in text or _sha("new") in text:
            parsing.set()
            release.wait(30)
        return yaml.safe_load(text)

    verifier = identities.StaticVerifier(tokens_file=tokens, load_yaml=slow_yaml, reload_check_s=0)
    _write(tokens, _ops("new"))
    answered = threading.Event()

    def call() -> None:
        verifier.verify(identities.Presented(token="old"))
        answered.set()

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    try:
        assert parsing.wait(10), "the re-read did not start"
        assert answered.wait(10), "the call waited for the tokens file to be parsed"
    finally:
        release.set()
    verifier.settle()
    assert verifier.verify(identities.Presented(token="new")) is not None
