"""The verifier's rules without servers: tokens (inline, from a file, rotated), the
certificate convention, job-id patterns, and config errors that name the field."""

from __future__ import annotations

import hashlib
import os
import pathlib

import pytest
import yaml

from tslice.common import auth, tls


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
    verifier = auth.StaticVerifier(tokens_file=tokens, load_yaml=yaml.safe_load, reload_check_s=0)
    principal = verifier.verify(auth.Presented(token="old"))
    assert principal == auth.Principal("ops", frozenset({"admin"}), (), "token")
    _write(tokens, f"tokens: [{{name: ops, roles: [admin], sha256: {_sha('new')}}}]\n")
    assert verifier.verify(auth.Presented(token="new")) == principal
    with pytest.raises(auth.Unauthenticated):
        verifier.verify(auth.Presented(token="old"))
    _write(tokens, "tokens: [{name: ops, roles: [wizard], sha256: 00}]\n")  # a bad edit
    assert verifier.verify(auth.Presented(token="new")) == principal  # the last good file stays


def test_a_client_token_file_is_read_again_when_it_changes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    _write(path, "first\n")
    source = tls.TokenSource(path=path)
    assert source.metadata() == (("authorization", "Bearer first"),)
    _write(path, "second\n")
    assert source.value() == "second"


def test_certificate_identities_follow_the_convention_unless_mapped() -> None:
    mapped = auth.Grant.parse(
        {"name": "ci-bot", "roles": ["job"], "jobs": ["ci/*"]}, where="x", token=False
    )
    verifier = auth.StaticVerifier(identities=[mapped])

    def principal(identity: str) -> auth.Principal | None:
        return verifier.verify(auth.Presented(identities=(identity,)))

    assert principal("orchestrator") == auth.Principal(
        "orchestrator", frozenset({"orchestrator"}), (), "certificate"
    )
    job = principal("job:train/7")
    assert job is not None and job.may_act_as("train/7") and not job.may_act_as("train/8")
    bot = principal("ci-bot")
    assert bot is not None and bot.may_act_as("ci/run-1") and not bot.may_act_as("prod/run-1")
    stranger = principal("someone")
    assert stranger is not None and not stranger.roles  # verified, may only read
    assert verifier.verify(auth.Presented()) is None  # nothing presented


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
        auth.AuthSettings.from_mapping(section)


def test_auth_is_off_without_the_section_or_when_disabled() -> None:
    assert auth.AuthSettings.from_mapping(None) is None
    assert auth.AuthSettings.from_mapping({"enabled": False, "tokens": []}) is None
    assert auth.AuthSettings.from_mapping({}) is not None  # certificates only


class _PodTokens:
    """A stand-in for a Kubernetes verifier: a service-account token whose pod carries
    the label timeslice.io/job-id (here a table instead of a TokenReview)."""

    def __init__(self, settings: dict[str, object]) -> None:
        self._pods = dict(settings["pods"])  # type: ignore[call-overload]

    def verify(self, presented: auth.Presented) -> auth.Principal | None:
        job = self._pods.get(presented.token)
        if job is None:
            return None  # not ours: the static tokens and certificates decide
        return auth.Principal(f"pod:{job}", frozenset({auth.JOB}), (str(job),), "kubernetes")


def test_a_plugged_in_verifier_is_asked_first_and_the_static_rules_still_apply() -> None:
    settings = auth.AuthSettings.from_mapping(
        {
            "verifier": f"{__name__}:_PodTokens",
            "verifier_settings": {"pods": {"sa-token-1": "grpo-7b"}},
            "tokens": [{"name": "ops", "roles": ["admin"], "sha256": _sha("ops-token")}],
        }
    )
    assert settings is not None
    verifier = settings.build()
    pod = verifier.verify(auth.Presented(token="sa-token-1"))
    assert pod is not None and pod.via == "kubernetes" and pod.may_act_as("grpo-7b")
    ops = verifier.verify(auth.Presented(token="ops-token"))
    assert ops is not None and ops.roles == {"admin"}
    with pytest.raises(auth.Unauthenticated):
        verifier.verify(auth.Presented(token="neither"))
