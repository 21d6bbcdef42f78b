"""Who may talk to the data service: bearer tokens, TLS and client certificates, loopback.

Server side: `read_token_file` (one token per line, so a rotation lists the old and the new
token until every client has the new one), `TokenInterceptor` (every RPC but the health
service must carry ``authorization: Bearer TOKEN``) and `ServerTLS` (a certificate, its key
and, for mutual TLS, the CA that signs client certificates). Client side: `ClientAuth`, the
token and the TLS files a caller presents (dataservice.rpc builds its channels from it).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import grpc

#: Methods that need no token: the standard health service (see TokenInterceptor).
OPEN_PREFIX = "/grpc.health.v1.Health/"
MISSING_TOKEN = "this data service requires a bearer token: send metadata 'authorization: Bearer TOKEN' (data.auth_token_file)"
WRONG_TOKEN = "the bearer token is not one this data service accepts"


class AuthError(ValueError):
    """A token, certificate or key file that cannot be used; the message names the file and why."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`: addresses no other machine can reach."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def read_secret_file(path: str | Path, what: str) -> bytes:
    """The bytes of a file holding a secret; AuthError if it is missing or anyone may read it."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        data = file.read_bytes()
    except OSError as err:
        raise AuthError(f"{what} {str(file)!r}: {err.strerror}") from None
    if mode & stat.S_IROTH:
        raise AuthError(f"{what} {str(file)!r} is readable by every user; make it private (chmod o-r {file})")
    return data


def read_token_file(path: str | Path) -> list[str]:
    """The tokens of a token file: one per line, blank lines and `#` comments ignored.
    AuthError if the file is world-readable, holds no token, or a token has blanks in it."""
    text = read_secret_file(path, "token file").decode("utf-8", errors="replace")
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.split("#", 1)[0].strip()
        if not token:
            continue
        if len(token.split()) > 1:
            raise AuthError(f"token file {str(path)!r} line {number}: a token is one word without blanks")
        tokens.append(token)
    if not tokens:
        raise AuthError(f"token file {str(path)!r} holds no token (one per line; '#' starts a comment)")
    return tokens


def _digest(token: str | bytes) -> bytes:
    # Compared as digests: equal lengths, so compare_digest's time says nothing of the token's length.
    return hashlib.sha256(token.encode("utf-8") if isinstance(token, str) else token).digest()


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call without one of `tokens` as its bearer token.

    The standard health service stays open: load balancers, systemd and the SLURM scripts
    probe it without a secret, and it tells only SERVING or NOT_SERVING. (Under mutual TLS
    the handshake still demands a client certificate for it, like for every call.)
    """

    def __init__(self, tokens: Sequence[str], on_refused: Callable[[], None] | None = None) -> None:
        if not tokens:
            raise ValueError("TokenInterceptor needs at least one token")
        self._digests = [_digest(t) for t in tokens]
        self._on_refused = on_refused

    def accepts(self, metadata) -> str | None:
        """None when `metadata` carries an accepted token, else why not (one sentence)."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            return MISSING_TOKEN
        scheme, _, token = (value.decode("latin-1") if isinstance(value, bytes) else value).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MISSING_TOKEN
        given = _digest(token.strip())
        match = False
        for expected in self._digests:  # every token compared, so the time does not tell which matched
            match |= hmac.compare_digest(given, expected)
        return None if match else WRONG_TOKEN

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_PREFIX):
            return continuation(handler_call_details)
        problem = self.accepts(handler_call_details.invocation_metadata)
        if problem is None:
            return continuation(handler_call_details)
        if self._on_refused is not None:
            self._on_refused()
        return _refusal(continuation(handler_call_details), problem)


def _refusal(handler, message: str):
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def deny_stream(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # a generator: the method streams its answer

    if handler is not None and handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key (PEM) and, for mutual TLS, the client CA."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str, key: str, client_ca: str | None = None) -> "ServerTLS":
        """Read the PEM files; AuthError naming a missing, malformed or mismatched file or a world-readable key."""
        tls = cls(_read_public(cert, "TLS certificate"), read_secret_file(key, "TLS key"),
                  _read_public(client_ca, "client CA") if client_ca else None)
        check_pem(cert, key, client_ca or "")
        return tls

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials; a client CA makes a client certificate signed by it mandatory."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


def check_pem(cert: str = "", key: str = "", ca: str = "") -> None:
    """AuthError unless `cert` and `key` are PEM and belong together and `ca` holds PEM
    certificates: checked here, because gRPC only logs such faults and then fails to bind or connect."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for files, load in (((cert, key), lambda: context.load_cert_chain(cert, key)),
                        ((ca,), lambda: context.load_verify_locations(cafile=ca))):
        if not files[0]:
            continue
        try:
            load()
        except (ssl.SSLError, ValueError, OSError) as err:
            what = f"{cert!r} with key {key!r}: not a PEM certificate and its private key" if len(files) == 2 \
                else f"{ca!r}: not a PEM CA certificate"
            raise AuthError(f"{what} ({getattr(err, 'reason', None) or err})") from None


def _read_public(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise AuthError(f"{what} {path!r}: {err.strerror}") from None


@dataclass(frozen=True)
class ClientAuth:
    """What a caller presents: a bearer token and/or TLS (the CA it trusts; a certificate and key for mTLS)."""

    token: str = ""
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(cls, token_file: str = "", ca_file: str = "", cert_file: str = "",
                   key_file: str = "") -> "ClientAuth | None":
        """None when no file is given; AuthError for a file that cannot be used. The first
        token of the token file is sent (the server accepts any of its own file's)."""
        if bool(cert_file) != bool(key_file):
            raise AuthError("a client certificate and its key go together: give both files or neither")
        if (cert_file or key_file) and not ca_file:
            raise AuthError("a client certificate needs TLS: give the CA file that signed the server's certificate too")
        if not (token_file or ca_file):
            return None
        auth = cls(
            token=read_token_file(token_file)[0] if token_file else "",
            ca=_read_public(ca_file, "TLS CA file") if ca_file else None,
            cert=_read_public(cert_file, "TLS certificate") if cert_file else None,
            key=read_secret_file(key_file, "TLS key") if key_file else None,
        )
        check_pem(cert_file, key_file, ca_file)
        return auth

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def channel(self, address: str, options) -> grpc.Channel:
        """A channel to `address`: TLS when a CA is given, the token on every call."""
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                                 certificate_chain=self.cert)
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token:
            channel = grpc.intercept_channel(channel, _BearerToken(self.token))
        return channel


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer TOKEN`` to each call (works on plain channels too, unlike call credentials)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._header],
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object

