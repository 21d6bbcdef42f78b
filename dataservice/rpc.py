"""The data service's gRPC plumbing on the caller's side, without torch: replica addresses,
channels and their options (TLS and a bearer token when a `ClientAuth` is given), GetInfo, and
the errors. `tessera-data serve`, `health` and `peek` use it directly (so they start without
importing torch); `dataservice.client` builds on it.
"""

from __future__ import annotations

import threading
from typing import Sequence

import grpc

import protos
from dataservice.auth import ClientAuth

pb2, pb2_grpc = protos.load()

#: Default receive limit: twice the server's default send limit, so a server configured
#: somewhat higher still gets through.
MAX_RECEIVE_BYTES = 256 << 20
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,  # the server cancelled (e.g. killed mid-stream); our own cancel is filtered
})


class DataServiceError(RuntimeError):
    """The data service refused the stream, or no replica could be reached; `code` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def check_address(address: str) -> str:
    """`address` without surrounding blanks if it reads HOST:PORT (or unix:PATH); else
    ValueError saying what a replica address looks like."""
    text = address.strip()
    if text.startswith(("unix:", "unix-abstract:")):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"address {address!r} must read HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:50051")
    return text


def failure_reason(err: grpc.RpcError, timeout: float | None = None) -> str:
    """A failed call's cause in a few words."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        return f"no answer within {timeout:g} s"
    for marker, words in (("Connection refused", "connection refused"), ("Domain name not found", "unknown host"),
                          ("resolving", "unknown host"), ("No route to host", "no route to host")):
        if marker in details:
            return words
    return f"{code.name}: {details}" if details else code.name


def get_info(channels: "Channels", addresses: Sequence[str], timeout: float) -> dict:
    errors = []
    for address in addresses:
        try:
            reply = pb2_grpc.DataServiceStub(channels.get(address)).GetInfo(pb2.InfoRequest(), timeout=timeout)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # replicas share their tokens: no use trying on
                raise DataServiceError(f"data service at {address} refused this caller: UNAUTHENTICATED: {err.details()}",
                                       err.code()) from None
            errors.append(f"{address} ({failure_reason(err, timeout)})")
            continue
        return {
            "format_version": reply.format_version,
            "tokenizer": reply.tokenizer,
            "vocab_size": reply.vocab_size,
            "pad_id": reply.pad_id,
            "eos_id": reply.eos_id,
            "bos_id": reply.bos_id,
            "fingerprint": reply.fingerprint,
            "max_message_bytes": reply.max_message_bytes,
            "max_seq_len": reply.max_seq_len,
            "datasets": [
                {"name": d.name, "path": d.path, "fingerprint": d.fingerprint,
                 "num_documents": d.num_documents, "num_tokens": d.num_tokens, "weight": d.weight}
                for d in reply.datasets
            ],
        }
    raise DataServiceError("no data service answers at " + ", ".join(errors), grpc.StatusCode.UNAVAILABLE)


def server_info(addresses: str | Sequence[str], timeout: float = 5.0, auth: ClientAuth | None = None) -> dict:
    """GetInfo of the first replica that answers within `timeout` seconds (a connection
    refused fails at once); DataServiceError naming each replica's cause when none does.
    `auth`: the token and TLS files to present (None: a plain channel, no token)."""
    addresses = [addresses] if isinstance(addresses, str) else list(addresses)
    channels = Channels(client_options(MAX_RECEIVE_BYTES), auth)
    try:
        return get_info(channels, addresses, timeout)
    finally:
        channels.close()


def client_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """Channel arguments: explicit limits, keep-alive that notices a dead server, fast reconnect,
    a bounded read-ahead."""
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", 1 << 20),  # requests are tiny
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Our own loop does the backoff between replicas; keep gRPC's own reconnect short.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # The prefetch queue is the read-ahead. Without this, HTTP/2 window probing lets a replica
        # push megabytes per stream ahead of it (hundreds of small batches), which a killed or
        # draining replica's successor sends again; with it, a 64 KiB window (or one message) is in flight.
        ("grpc.http2.bdp_probe", 0),
    ]


class Channels:
    """One gRPC channel per replica address, shared by the client and its prefetch thread;
    TLS and the bearer token of `auth` when given."""

    def __init__(self, options: list[tuple[str, int]], auth: ClientAuth | None = None) -> None:
        self._options, self._lock, self._open = options, threading.Lock(), {}
        self._auth = auth

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._open:
                self._open[address] = (self._auth.channel(address, self._options) if self._auth is not None
                                       else grpc.insecure_channel(address, options=self._options))
            return self._open[address]

    def close(self) -> None:
        with self._lock:
            channels, self._open = list(self._open.values()), {}
        for channel in channels:
            channel.close()
