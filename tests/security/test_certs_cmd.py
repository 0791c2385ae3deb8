"""``tslice certs`` as a user runs it: the files, their names and modes, what the
certificates name, and a second run that keeps the CA (and, without --force, the rest)."""

from __future__ import annotations

import pathlib
import stat

import pytest
from cryptography import x509

from tslice.cli import main
from tslice.common import errors
from tslice.security import tls


def _certs(*args: str) -> int | str | None:
    with pytest.raises(SystemExit) as exited:
        main.main(["certs", *args])
    return exited.value.code


def _sans(path: pathlib.Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(getattr(n, "value", n)) for n in names]


def test_certs_makes_a_ca_a_server_and_client_certificates(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "pki"
    assert _certs("--out", str(out), "--host", "gpu-a.cluster", "--host", "10.0.0.3",
                  "--client", "job:team/a", "--client", "orchestrator") == 0  # fmt: skip
    made = sorted(p.name for p in out.iterdir())
    assert made == sorted(
        f"{stem}.{ext}" for stem in ("ca", "server", "job-team-a", "orchestrator")
        for ext in ("pem", "key")
    )  # fmt: skip
    for key in out.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert _sans(out / "server.pem") == [
        "localhost",
        "127.0.0.1",
        "::1",
        "gpu-a.cluster",
        "10.0.0.3",
    ]
    assert _sans(out / "job-team-a.pem") == ["tslice:job:team/a"]
    ca, server = (out / "ca.pem").read_bytes(), (out / "server.pem").read_bytes()
    assert _certs("--out", str(out), "--client", "admin") == 0
    assert (out / "ca.pem").read_bytes() == ca and (out / "server.pem").read_bytes() == server
    assert (out / "admin.pem").exists()
    assert _certs("--out", str(out), "--force", "--client", "admin") == 0
    assert (out / "ca.pem").read_bytes() == ca and (out / "server.pem").read_bytes() != server


def test_an_identity_that_is_not_an_id_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _certs("--out", str(tmp_path), "--client", "job a") == 2
    assert "an identity is e.g. orchestrator, admin or job:<job-id>" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TSLICE_TLS_CERT": "c.pem"}, "needs its key"),
        ({"TSLICE_TOKEN": "a", "TSLICE_TOKEN_FILE": "f"}, "keep one of them"),
        ({"TSLICE_TLS_CA": "/nonexistent/ca.pem"}, "cannot read the CA certificate"),
    ],
)
def test_client_settings_that_cannot_work_are_refused_naming_them(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(errors.ConfigError, match=message):
        tls.ClientSecurity.from_env(env)
