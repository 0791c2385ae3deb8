"""TLS, mutual TLS and bearer tokens on tslice's gRPC connections (grpc only: the job
side imports this module).

Servers (:class:`ServerTLS`) serve a certificate and key from files and, given a client
CA, require every client to present a certificate signed by it (mutual TLS). The files
are read again when they change, without a restart: grpc asks for the certificate
configuration at every new connection (``grpc.dynamic_ssl_server_credentials``), and
:class:`_ReloadingFiles` answers from a ``stat`` of the files, re-reading them only when
one changed. Connections open at that moment keep the old certificate; new ones get the
new one.

Clients (:class:`ClientSecurity`) verify the server against a CA, present a certificate
of their own for mutual TLS, and send a bearer token (``authorization: Bearer ...``)
with every call. Job processes configure it by environment (:data:`TLS_CA_ENV`...);
servers that call other servers (the orchestrator calling agents) from their config.

A server refuses to listen on a non-loopback address without TLS unless told it is
meant (:func:`check_listen`); loopback and Unix sockets need no TLS.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import grpc

from tslice.common import errors

log = logging.getLogger(__name__)

#: CA certificate (PEM) a client verifies servers against; unset: plaintext.
TLS_CA_ENV: Final = "TSLICE_TLS_CA"
#: Client certificate and key (PEM) for mutual TLS.
TLS_CERT_ENV: Final = "TSLICE_TLS_CERT"
TLS_KEY_ENV: Final = "TSLICE_TLS_KEY"
#: The name the server's certificate is checked against when it is not the address's host.
TLS_SERVER_NAME_ENV: Final = "TSLICE_TLS_SERVER_NAME"
#: A bearer token, or a file holding one (re-read when it changes).
TOKEN_ENV: Final = "TSLICE_TOKEN"
TOKEN_FILE_ENV: Final = "TSLICE_TOKEN_FILE"

#: The metadata key of a bearer token (lower case, as gRPC metadata keys are).
AUTHORIZATION: Final = "authorization"
BEARER: Final = "Bearer "

ChannelOption = tuple[str, Any]


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise errors.ConfigError(
            f"cannot read the {what} {path} ({err.strerror or err}); fix the path or its "
            "permissions"
        ) from err


def _stamp(paths: Sequence[Path]) -> tuple[tuple[int, int, int], ...]:
    """What tells a changed file: inode, size, modification time (a rename counts)."""
    stamps = []
    for path in paths:
        st = path.stat()
        stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def channel_credentials(
    ca: Path | None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """TLS channel credentials: servers checked against ``ca`` (None: the system's
    roots); ``cert`` and ``key`` (both or neither) are presented for mutual TLS."""
    if (cert is None) != (key is None):
        raise errors.ConfigError(
            "a client certificate needs its key and a key its certificate: give both "
            f"(${TLS_CERT_ENV} and ${TLS_KEY_ENV}, or cert and key in the config) or neither"
        )
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca is None else _read(ca, "CA certificate"),
        private_key=None if key is None else _read(key, "client key"),
        certificate_chain=None if cert is None else _read(cert, "client certificate"),
    )


class TokenSource:
    """A bearer token: given as is, or read from a file, again whenever the file changes
    (a rotated token is sent from the next call on)."""

    def __init__(self, *, token: str | None = None, path: Path | None = None) -> None:
        if (token is None) == (path is None):
            raise ValueError("give a token or the path of a file holding one")
        self.path = path
        self._token = token.strip() if token is not None else ""
        self._stamp: tuple[tuple[int, int, int], ...] = ()
        self._guard = threading.Lock()
        if not self.value():
            raise errors.ConfigError(
                f"the token {'file ' + str(path) if path else 'given'} is empty; write the "
                "token there (one line)"
            )

    def value(self) -> str:
        if self.path is None:
            return self._token
        with self._guard:
            try:
                stamp = _stamp([self.path])
            except OSError as err:
                if self._token:  # being replaced: keep the one we have
                    return self._token
                raise errors.ConfigError(
                    f"cannot read the token file {self.path} ({err.strerror or err}); fix "
                    f"the path (${TOKEN_FILE_ENV} or token_file)"
                ) from err
            if stamp != self._stamp:
                self._token = _read(self.path, "token file").decode().strip()
                self._stamp = stamp
            return self._token

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTHORIZATION, BEARER + self.value()),)


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    """How a client checks the server and proves itself (files, PEM)."""

    #: CA the server's certificate must chain to (None: the system's roots).
    ca: Path | None = None
    #: Client certificate and key, for servers that require mutual TLS.
    cert: Path | None = None
    key: Path | None = None
    #: Checked against the server's certificate instead of the address's host.
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca, self.cert, self.key)

    def stamp(self) -> tuple[tuple[int, int, int], ...] | None:
        """What tells renewed files (None: one cannot be read now, mid-renewal)."""
        try:
            return _stamp([p for p in (self.ca, self.cert, self.key) if p is not None])
        except OSError:
            return None

    def channel_options(self) -> list[ChannelOption]:
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def _path(value: object, where: str) -> Path | None:
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{where} must be a file path, not {type(value).__name__}")
    return Path(value).expanduser()


def _known_keys(data: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(known)} "
            "(check its spelling)"
        )


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """TLS and token of a client; both off: a plaintext channel, no token."""

    tls: ClientTLS | None = None
    token: TokenSource | None = None

    #: Keys of the config-file form (:meth:`from_mapping`).
    KEYS: ClassVar[tuple[str, ...]] = ("ca", "cert", "key", "server_name", "token_file")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSecurity:
        """From ``$TSLICE_TLS_CA``, ``$TSLICE_TLS_CERT``, ``$TSLICE_TLS_KEY``,
        ``$TSLICE_TLS_SERVER_NAME``, ``$TSLICE_TOKEN`` / ``$TSLICE_TOKEN_FILE``."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return env.get(name, "").strip() or None

        ca, cert, key = (_path(get(n), n) for n in (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV))
        tls = None
        if ca or cert or key:
            tls = ClientTLS(ca=ca, cert=cert, key=key, server_name=get(TLS_SERVER_NAME_ENV))
            tls.credentials()  # files checked now: the error names the variables
        token_text, token_file = get(TOKEN_ENV), get(TOKEN_FILE_ENV)
        if token_text and token_file:
            raise errors.ConfigError(
                f"both ${TOKEN_ENV} and ${TOKEN_FILE_ENV} are set; keep one of them"
            )
        token = None
        if token_text:
            token = TokenSource(token=token_text)
        elif token_file:
            token = TokenSource(path=Path(token_file).expanduser())
        return cls(tls=tls, token=token)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, *, where: str) -> ClientSecurity:
        """The config-file form: ``{ca, cert, key, server_name, token_file}``, each optional.

        Raises ValueError (the config loaders name the field) for unknown keys.
        """
        if not data:
            return cls()
        _known_keys(data, cls.KEYS, where)
        ca, cert, key = (_path(data.get(k), f"{where}.{k}") for k in ("ca", "cert", "key"))
        tls = None
        if ca or cert or key:
            name = data.get("server_name")
            tls = ClientTLS(ca=ca, cert=cert, key=key, server_name=str(name) if name else None)
        token_file = _path(data.get("token_file"), f"{where}.token_file")
        return cls(tls=tls, token=TokenSource(path=token_file) if token_file else None)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries (the token, if any)."""
        return self.token.metadata() if self.token is not None else ()

    def channel(self, target: str, options: Sequence[ChannelOption] = ()) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(target, options=list(options))
        return grpc.secure_channel(
            target, self.tls.credentials(), options=[*options, *self.tls.channel_options()]
        )

    def aio_channel(self, target: str, options: Sequence[ChannelOption] = ()) -> grpc.aio.Channel:
        """Create it inside the event loop that will use it."""
        if self.tls is None:
            return grpc.aio.insecure_channel(target, options=list(options))
        return grpc.aio.secure_channel(
            target, self.tls.credentials(), options=[*options, *self.tls.channel_options()]
        )

    def connect_hint(self) -> str:
        """What to check when a first connection fails (TLS on one side only...)."""
        if self.tls is None:
            return (
                f"if the server serves TLS, set ${TLS_CA_ENV} to its CA certificate "
                f"(and ${TLS_CERT_ENV}/${TLS_KEY_ENV} if it requires client certificates)"
            )
        if self.tls.cert is None:
            return (
                "the server may not serve TLS (unset the TLS settings), or may require a "
                f"client certificate (set ${TLS_CERT_ENV} and ${TLS_KEY_ENV})"
            )
        return (
            "the server may not serve TLS, may not trust this client certificate's CA, or "
            "its certificate may not name this address (set $TSLICE_TLS_SERVER_NAME)"
        )


def mismatch_hint(detail: str, security: ClientSecurity, *, settings: str) -> str | None:
    """What a failed connection's ``detail`` says about TLS on the two sides (None:
    nothing), naming the client's ``settings`` to change (``agent_client`` ...).

    A server that closes the connection at once ("Socket closed") may serve TLS to a
    plaintext client or require a client certificate: that one is a guess, said so
    (:mod:`tslice.orchestrator.switch.check` makes it certain with a handshake)."""
    low = detail.lower()
    if "wrong_version_number" in low:
        return (
            f"TLS mismatch: the server does not serve TLS, but {settings} connects with TLS "
            "(drop its ca/cert/key, or serve TLS there)"
        )
    if "certificate_verify_failed" in low or "certificate signature failure" in low:
        return (
            "TLS mismatch: the server's certificate is not signed by the CA "
            f"{settings} trusts (its ca)"
        )
    if "hostname verification" in low or "peer name" in low:
        return (
            "TLS mismatch: the server's certificate does not name the address connected "
            f"to (give {settings} a server_name, or add the name to the certificate)"
        )
    if "socket closed" in low or "connection reset" in low:
        if security.tls is None:
            return (
                "TLS mismatch? the server closed the connection at once, as a TLS server "
                f"does to a plaintext client: if it serves TLS, give {settings} its ca "
                "(and cert/key for mutual TLS)"
            )
        if security.tls.cert is None:
            return (
                "TLS mismatch? the server closed the connection at once, as a server that "
                f"requires client certificates does: give {settings} cert and key"
            )
        return (
            "TLS mismatch? the server closed the connection at once: it may not trust the "
            f"CA of {settings}'s client certificate"
        )
    return None


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """Certificate and key a server serves; with ``client_ca``, mutual TLS."""

    cert: Path
    key: Path
    #: CA that client certificates must chain to; set: clients must present one.
    client_ca: Path | None = None

    KEYS: ClassVar[tuple[str, ...]] = ("cert", "key", "client_ca")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, *, where: str) -> ServerTLS | None:
        """The config-file form ``{cert, key, client_ca}``; None/empty: no TLS."""
        if not data:
            return None
        _known_keys(data, cls.KEYS, where)
        cert, key = _path(data.get("cert"), f"{where}.cert"), _path(data.get("key"), f"{where}.key")
        if cert is None or key is None:
            raise ValueError(f"{where} needs both cert and key (PEM files); client_ca is optional")
        return cls(cert=cert, key=key, client_ca=_path(data.get("client_ca"), f"{where}.client_ca"))

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that pick up renewed files at the next connection."""
        files = _ReloadingFiles(self)
        return grpc.dynamic_ssl_server_credentials(
            files.load(),
            files.fetch,
            require_client_authentication=self.mutual,
        )


class _ReloadingFiles:
    """The certificate configuration of a :class:`ServerTLS`, re-read on change."""

    def __init__(self, tls: ServerTLS) -> None:
        self._tls = tls
        self._paths = [p for p in (tls.cert, tls.key, tls.client_ca) if p is not None]
        self._stamp: tuple[tuple[int, int, int], ...] = ()

    def load(self) -> Any:
        """Read every file now (at start: an error stops the server, naming the file)."""
        try:
            stamp = _stamp(self._paths)
        except OSError as err:
            raise errors.ConfigError(
                f"cannot read TLS file {err.filename} ({err.strerror or err}); fix the path "
                "(tls.cert, tls.key, tls.client_ca or --tls-cert, --tls-key, --tls-client-ca)"
            ) from err
        tls = self._tls
        config = grpc.ssl_server_certificate_configuration(
            [(_read(tls.key, "TLS key"), _read(tls.cert, "TLS certificate"))],
            root_certificates=None if tls.client_ca is None else _read(tls.client_ca, "client CA"),
        )
        self._stamp = stamp
        return config

    def fetch(self) -> Any:
        """grpc's question at each new connection: a new configuration, or None."""
        try:
            if _stamp(self._paths) == self._stamp:
                return None
            config = self.load()
        except (OSError, errors.ConfigError) as err:
            # Caught mid-renewal (a file missing for a moment): serve what we have.
            log.warning("TLS files not reloaded, the current certificate stays: %s", err)
            return None
        log.info("TLS certificate reloaded from %s", self._tls.cert)
        return config


_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_listen(host: str, *, tls: ServerTLS | None, insecure: bool, what: str) -> None:
    """Refuse plaintext on an address other machines reach, unless ``insecure``."""
    if tls is not None or insecure or is_loopback(host):
        return
    shown = host or "0.0.0.0"
    raise errors.ConfigError(
        f"refusing to serve the {what} on {shown} without TLS: anyone who reaches it could "
        "drive it; give --tls-cert and --tls-key (tslice certs makes them), or "
        "--insecure (insecure: true) on a trusted network"
    )


def peer_is_unix(peer: str) -> bool:
    """Whether a servicer context's ``peer()`` is a Unix-socket caller."""
    return peer.startswith("unix:")
