"""Who is calling: one pluggable verifier maps what a caller presented to a principal.

A caller proves who it is with a bearer token (``authorization: Bearer <token>``) or
with its mutual-TLS certificate (:func:`presented_by` reads both off a call); a
:class:`Verifier` maps what it presented to a :class:`Principal` (a name, roles, the job
ids it may act as):

- tokens: static entries (``tokens:`` inline or a ``tokens_file``, re-read when it
  changes) that keep only the token's SHA-256, compared in constant time;
- certificates: the identity a certificate names (URI SAN ``tslice:<identity>``, else
  its common name) under a convention (``orchestrator`` has the orchestrator role,
  ``admin`` the admin role, ``job:<id>`` the job role for job ``<id>``) or as the
  ``identities:`` entries map it;
- anything else (Kubernetes service-account tokens...): ``verifier: module:factory``,
  asked first.

Identities are literal (DESIGN.md, invariant 6): a job id a certificate names or a grant
lists is compared as a string, never as a pattern (a certificate ``job:*`` signed by an
outside PKI must not act as every job). A grant may name ``job_prefixes:`` explicitly
instead. The ``auth:`` section of a server's config is :class:`AuthSettings`; what each
role may call is ``tslice.security.roles``'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import importlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tslice.common import errors, validation
from tslice.security import tls

log = logging.getLogger(__name__)

JOB = "job"
ORCHESTRATOR = "orchestrator"
ADMIN = "admin"
ROLES = (JOB, ORCHESTRATOR, ADMIN)
#: The URI scheme of an identity in a client certificate (``tslice certs`` writes it).
IDENTITY_SCHEME = "tslice:"
_JOB_PREFIX = "job:"
#: How often a tokens file is looked at for changes, seconds.
_RELOAD_CHECK_S = 1.0
#: The largest tokens file read (thousands of entries fit; /dev/zero does not).
MAX_TOKENS_FILE_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Principal:
    """A verified caller."""

    name: str
    roles: frozenset[str] = frozenset()
    #: Job ids it may act as with the job role, compared literally.
    jobs: tuple[str, ...] = ()
    #: How it proved itself: "token", "certificate", or a custom verifier's word.
    via: str = "token"
    #: Prefixes of the job ids it may also act as (only where a grant names them).
    job_prefixes: tuple[str, ...] = ()

    def may_act_as(self, job_id: str) -> bool:
        return JOB in self.roles and (
            job_id in self.jobs or any(job_id.startswith(p) for p in self.job_prefixes)
        )

    def __str__(self) -> str:
        return f"{self.name!r} ({self.via})"


@dataclasses.dataclass(frozen=True)
class Presented:
    """What a caller presented: a bearer token, the identities its certificate names."""

    token: str | None = None
    identities: tuple[str, ...] = ()
    #: The peer as gRPC names it (``ipv4:127.0.0.1:5000``, ``unix:``...).
    peer: str = ""


class Verifier(Protocol):
    """Maps what a caller presented to a principal; None: not recognised."""

    def verify(self, presented: Presented) -> Principal | None: ...


class Unauthenticated(Exception):
    """What was presented is wrong (an unknown token): refused, naming what to check."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclasses.dataclass(frozen=True)
class Grant:
    """One entry of ``tokens:`` or ``identities:``: who, with which roles and jobs."""

    name: str
    roles: frozenset[str]
    jobs: tuple[str, ...]
    #: SHA-256 of the token (tokens only).
    digest: bytes = b""
    job_prefixes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, data: object, *, where: str, token: bool) -> Grant:
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a mapping ({{name, roles, jobs, ...}})")
        keys = (
            "name",
            "roles",
            "jobs",
            "job_prefixes",
            *(("sha256", "token_file") if token else ()),
        )
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(keys)}")
        try:
            name = validation.check_id("name", str(data.get("name", "")))
        except validation.InvalidIdError as err:
            raise ValueError(f"{where}.name: {err}") from None
        roles = frozenset(_strings(data.get("roles", []), f"{where}.roles"))
        if roles - set(ROLES):
            bad = sorted(roles - set(ROLES))[0]
            raise ValueError(f"{where}.roles: {bad!r} is not a role; use {', '.join(ROLES)}")
        jobs = tuple(_job_ids(data.get("jobs", []), f"{where}.jobs"))
        prefixes = tuple(_job_prefixes(data.get("job_prefixes", []), f"{where}.job_prefixes"))
        if (jobs or prefixes) and JOB not in roles:
            raise ValueError(f"{where}: jobs are given but roles has no {JOB!r}; add it")
        digest = _token_digest(data, where) if token else b""
        return cls(name, roles, jobs, digest, prefixes)

    def principal(self, via: str) -> Principal:
        return Principal(self.name, self.roles, self.jobs, via, self.job_prefixes)


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings")
    return list(value)


def _job_ids(value: object, where: str) -> list[str]:
    """Job ids, each a valid id: compared literally, a ``*`` is no wildcard."""
    found = _strings(value, where)
    for i, job in enumerate(found):
        try:
            validation.check_id("job id", job)
        except validation.InvalidIdError as err:
            prefix = job.rstrip("*?")
            hint = (
                f"; jobs are compared literally: for every job id starting with {prefix!r} "
                f"write job_prefixes: [{prefix!r}]"
                if prefix != job and prefix
                else ""
            )
            raise ValueError(f"{where}[{i}]: {err}{hint}") from None
    return found


def _job_prefixes(value: object, where: str) -> list[str]:
    """Prefixes of job ids: not empty (that would be every job), id characters only."""
    found = _strings(value, where)
    for i, prefix in enumerate(found):
        if not prefix:
            raise ValueError(f"{where}[{i}] is empty, which would be every job: name a prefix")
        try:
            validation.check_id("job id prefix", prefix + "x")  # a prefix completes to an id
        except validation.InvalidIdError as err:
            raise ValueError(f"{where}[{i}]: {err}") from None
    return found


def _read_small_file(path: Path, limit: int) -> tuple[os.stat_result, str]:
    """A regular file's status and text, if it holds at most ``limit`` bytes (raises
    ValueError otherwise: a device, a FIFO or a runaway file is never read whole)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not block the open
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"is larger than {limit} bytes")
    try:
        return st, data.decode()
    except UnicodeDecodeError as err:
        raise ValueError(f"is not UTF-8 text ({err.reason})") from None


def _token_digest(data: Mapping[str, Any], where: str) -> bytes:
    sha, path = data.get("sha256"), data.get("token_file")
    if (sha is None) == (path is None):
        raise ValueError(
            f"{where} needs sha256 (of the token: printf %s TOKEN | sha256sum) or token_file "
            "(a file holding the token), one of them"
        )
    if path is not None:
        return _digest(tls.TokenSource(path=Path(str(path)).expanduser()).value())
    try:
        digest = bytes.fromhex(str(sha))
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise ValueError(f"{where}.sha256 is not a SHA-256 in hex (64 characters)")
    return digest


def certificate_principal(identity: str, mapped: Mapping[str, Grant]) -> Principal:
    """The principal of a certificate identity: as ``identities:`` maps it, else by the
    convention (``orchestrator``, ``admin``, ``job:<id>``; any other name has no role)."""
    grant = mapped.get(identity)
    if grant is not None:
        return grant.principal("certificate")
    if identity in (ORCHESTRATOR, ADMIN):
        return Principal(identity, frozenset({identity}), (), "certificate")
    if identity.startswith(_JOB_PREFIX):
        job = identity[len(_JOB_PREFIX) :]
        try:
            validation.check_id("the job id", job)
        except validation.InvalidIdError as err:
            # Refused, not merely role-less: such a certificate was issued by mistake.
            raise Unauthenticated(
                f"the client certificate names identity {identity!r}, and {err}; a job "
                "identity is one job id, compared literally (no wildcards): issue the "
                "certificate for job:<job id>"
            ) from None
        return Principal(identity, frozenset({JOB}), (job,), "certificate")
    return Principal(identity, frozenset(), (), "certificate")


class StaticVerifier:
    """Static tokens (inline and from a file re-read on change) and certificate identities.

    The tokens file is read at start (an error stops the server). Later, at most every
    ``reload_check_s``, a call's verification starts a re-read in a thread of its own
    and goes on with the tokens read last: a slow or huge file never stalls the event
    loop, and a file that is missing (``rm`` then ``cp`` during a rotation), unreadable
    or malformed keeps the last good tokens.
    """

    def __init__(
        self,
        *,
        tokens: Sequence[Grant] = (),
        tokens_file: Path | None = None,
        identities: Sequence[Grant] = (),
        load_yaml: Callable[[str], Any] | None = None,
        reload_check_s: float = _RELOAD_CHECK_S,
    ) -> None:
        self._reload_check_s = reload_check_s
        self._inline = tuple(tokens)
        self._file = tokens_file
        self._load_yaml = load_yaml
        self._identities = {g.name: g for g in identities}
        self._guard = threading.Lock()
        self._from_file: tuple[Grant, ...] = ()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._reload: threading.Thread | None = None
        if tokens_file is not None:
            self._from_file = self._read_file()

    def _read_file(self) -> tuple[Grant, ...]:
        assert self._file is not None
        if self._load_yaml is None:
            raise errors.ConfigError("a tokens file needs the server's YAML loader (load_yaml)")
        path = self._file
        try:
            st, text = _read_small_file(path, MAX_TOKENS_FILE_BYTES)
            data = self._load_yaml(text)
        except OSError as err:
            raise errors.ConfigError(
                f"cannot read the tokens file {path} ({err.strerror or err}); fix auth.tokens_file"
            ) from err
        except ValueError as err:  # not a regular file, too large, not UTF-8, not YAML
            raise errors.ConfigError(f"tokens file {path}: {err}") from err
        tokens = data.get("tokens") if isinstance(data, Mapping) else None
        if not isinstance(tokens, list):
            raise errors.ConfigError(
                f"tokens file {path} must hold `tokens: [{{name, roles, ...}}]`"
            )
        try:
            grants = tuple(
                Grant.parse(t, where=f"{path}: tokens[{i}]", token=True)
                for i, t in enumerate(tokens)
            )
        except ValueError as err:
            raise errors.ConfigError(str(err)) from err
        self._stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        return grants

    def _tokens(self) -> tuple[Grant, ...]:
        if self._file is None:
            return self._inline
        with self._guard:
            now = time.monotonic()
            if now - self._checked >= self._reload_check_s and self._reload is None:
                self._checked = now
                self._reload = threading.Thread(
                    target=self._reload_if_changed, name="tslice-tokens-reload", daemon=True
                )
                self._reload.start()
            return self._inline + self._from_file

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait for a re-read of the tokens file in progress (tests, and a clean stop)."""
        reload = self._reload
        if reload is not None:
            reload.join(timeout_s)

    def _reload_if_changed(self) -> None:
        assert self._file is not None
        try:
            try:
                st = self._file.stat()
                if (st.st_ino, st.st_size, st.st_mtime_ns) == self._stamp:
                    return
            except OSError as err:
                # Between an `rm` and a `cp`: the tokens read last stay.
                log.warning(
                    "tokens file %s not read (%s); the previous tokens stay",
                    self._file,
                    err.strerror or err,
                )
                return
            try:
                grants = self._read_file()
            except errors.ConfigError as err:
                # A bad edit must not lock everyone out: the tokens read last stay.
                log.error("tokens file not reloaded, the previous tokens stay: %s", err)
                return
            with self._guard:
                self._from_file = grants
            log.info("tokens reloaded from %s (%d tokens)", self._file, len(grants))
        except Exception:  # a thread's failure would be lost: say it, keep the tokens
            log.exception("tokens file %s not reloaded; the previous tokens stay", self._file)
        finally:
            with self._guard:
                self._reload = None

    def verify(self, presented: Presented) -> Principal | None:
        if presented.token is not None:
            digest = _digest(presented.token)
            found: Grant | None = None
            for grant in self._tokens():  # every entry compared: no early exit to time
                if hmac.compare_digest(digest, grant.digest) and found is None:
                    found = grant
            if found is None:
                raise Unauthenticated("the token presented is not known")
            return found.principal("token")
        if presented.identities:
            return certificate_principal(presented.identities[0], self._identities)
        return None


class ChainVerifier:
    """The first verifier that recognises the caller decides."""

    def __init__(self, verifiers: Sequence[Verifier]) -> None:
        self._verifiers = tuple(verifiers)

    def verify(self, presented: Presented) -> Principal | None:
        for verifier in self._verifiers:
            principal = verifier.verify(presented)
            if principal is not None:
                return principal
        return None


@dataclasses.dataclass(frozen=True)
class AuthSettings:
    """The ``auth:`` section of a server's config (absent or ``enabled: false``: off)."""

    tokens: tuple[Grant, ...] = ()
    tokens_file: Path | None = None
    identities: tuple[Grant, ...] = ()
    #: ``module:factory``: ``factory(settings)`` returns a Verifier asked before the others.
    verifier: str | None = None
    #: The section's own ``verifier_settings``, for that factory.
    verifier_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Parses the tokens file (the server's YAML loader: this module imports no yaml).
    load_yaml: Callable[[str], Any] | None = None

    KEYS = ("enabled", "tokens", "tokens_file", "identities", "verifier", "verifier_settings")

    @classmethod
    def from_mapping(
        cls,
        data: Mapping[str, Any] | None,
        *,
        where: str = "auth",
        load_yaml: Callable[[str], Any] | None = None,
    ) -> AuthSettings | None:
        """Raises ValueError naming the field; None: authentication is off."""
        if data is None or not data.get("enabled", True):
            return None
        unknown = sorted(set(data) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(cls.KEYS)}"
            )
        tokens = data.get("tokens") or []
        identities = data.get("identities") or []
        if not isinstance(tokens, list) or not isinstance(identities, list):
            raise ValueError(f"{where}.tokens and {where}.identities are lists of entries")
        tokens_file = data.get("tokens_file")
        settings = data.get("verifier_settings") or {}
        if not isinstance(settings, Mapping):
            raise ValueError(f"{where}.verifier_settings must be a mapping")
        return cls(
            tokens=tuple(
                Grant.parse(t, where=f"{where}.tokens[{i}]", token=True)
                for i, t in enumerate(tokens)
            ),
            tokens_file=Path(str(tokens_file)).expanduser() if tokens_file else None,
            identities=tuple(
                Grant.parse(g, where=f"{where}.identities[{i}]", token=False)
                for i, g in enumerate(identities)
            ),
            verifier=str(data["verifier"]) if data.get("verifier") else None,
            verifier_settings=dict(settings),
            load_yaml=load_yaml,
        )

    def build(self) -> Verifier:
        """The verifier (reads the tokens file now: an error stops the server's start)."""
        static = StaticVerifier(
            tokens=self.tokens,
            tokens_file=self.tokens_file,
            identities=self.identities,
            load_yaml=self.load_yaml,
        )
        if self.verifier is None:
            return static
        module, _, name = self.verifier.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as err:
            raise errors.ConfigError(
                f"auth.verifier {self.verifier!r} cannot be loaded ({err}); write module:factory"
            ) from err
        return ChainVerifier([factory(self.verifier_settings), static])


def presented_by(context: Any) -> Presented:
    """What the caller of ``context`` (a grpc.aio.ServicerContext) presented; raises
    :class:`Unauthenticated` for a call with more than one ``authorization`` header
    (which one counts would be a guess)."""
    token = None
    headers = [v for k, v in context.invocation_metadata() or () if k == tls.AUTHORIZATION]
    if len(headers) > 1:
        raise Unauthenticated(
            f"the call carries {len(headers)} '{tls.AUTHORIZATION}' headers; send one"
        )
    for value in headers:
        if isinstance(value, str):
            scheme, _, rest = value.partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                token = rest.strip()
    found = context.auth_context() or {}
    names = [
        v.decode(errors="replace")[len(IDENTITY_SCHEME) :]
        for v in found.get("x509_subject_alternative_name", ())
        if v.startswith(IDENTITY_SCHEME.encode())
    ]
    if not names:
        names = [v.decode(errors="replace") for v in found.get("x509_common_name", ())]
    return Presented(token=token, identities=tuple(names), peer=context.peer() or "")
