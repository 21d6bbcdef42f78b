"""DataClient: a trainer rank's view of the data service, as an iterator of torch batches.

A background thread reads the gRPC stream into a bounded queue, so the training loop's
`next()` is a queue pop. When a replica goes away (UNAVAILABLE, a dropped connection, a
deadline) the thread reconnects with exponential backoff, trying the given replica
addresses in turn, and asks for the stream from the resume token of the last batch it
RECEIVED: batches already queued stay valid, and nothing is served twice or skipped.
Requests the server refuses (INVALID_ARGUMENT, DATA_LOSS, ...) surface at the caller's `next()`
as a DataServiceError with the status and message; so does a batch with a token id outside the
vocabulary (DATA_LOSS), checked on every message against the vocabulary the replica states.

A replica that stalls (a stopped process, a wedged host: the connection stays up and nothing
comes) is treated like one that went away: with `idle_timeout` set, a stream that delivers no
message for that many seconds while the client waits for one is cancelled and read on from the
next replica (or the same one again), from the same resume token. Time the prefetch thread spends
waiting for room in the queue (a slow trainer) does not count. The client gives up after
`max_retries` failed attempts in a row, or, with `retry_s` set, once an outage has lasted that
many seconds.

An outage is logged (logger `dataservice.client`, warnings): one line when an open stream is
lost, one when it is back, with how long it took.

`state_dict()` holds the token of the last batch DELIVERED to the caller, so a
checkpoint taken after step k resumes at step k+1, on any replica, even with another
dp_size or micro_batch_size when the row offset allows it.

With dynamic context parallelism (`dynamic_cp=True`) each batch is one entry of this rank's
plan for a global step (the `cp_*` fields; `ends_step` marks a step's last one), tensors are
[1, tokens], `max_batches` counts steps, and a stream restarts at step boundaries: after a
reconnect in the middle of a step the entries already received are dropped, not repeated.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import grpc
import numpy as np
import torch

import protos
from dataservice.rpc import (  # check_address, server_info: also for the trainer (core.train.data)
    MAX_RECEIVE_BYTES,
    RETRYABLE,
    Channels,
    ClientAuth,
    DataServiceError,
    client_options,
    failure_reason,
    get_info,
)

pb2, pb2_grpc = protos.load()
log = logging.getLogger(__name__)

# Batch tensors are read-only views of the received message bytes (zero copy). torch warns
# that writing to them would be undefined; trainers only read inputs, and copying every
# batch to make them writable would cost the very copy we avoid. torch gives that warning
# once per process, so we spend it here, silenced, rather than install a warnings filter
# (filters are global and get reset by any `catch_warnings` around our import).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(4), dtype=torch.int32)


@dataclass
class Batch:
    """One packed micro-batch, [B, S] unless noted; tensors are read-only except `labels`."""

    tokens: torch.Tensor        # int32 [B, S]
    labels: torch.Tensor        # int64 [B, S], -100 where the loss ignores (what cross_entropy wants)
    position_ids: torch.Tensor  # int32 [B, S], restart at 0 in each document piece
    cu_seqlens: torch.Tensor    # int32 [segments + 1], over the flattened batch
    seq_lens: torch.Tensor      # int32 [segments]
    row_ids: torch.Tensor       # int64 [B], global packed-row indices
    doc_hashes: torch.Tensor    # uint64 [segments], 0 for padding
    num_tokens: int
    efficiency: float
    step: int
    resume_token: str
    # Dynamic CP only (see protos/dataservice.proto); zero otherwise.
    cp_group_start: int = 0
    cp_group_size: int = 0              # 0 in an idle rank's message
    cp_microbatch: int = 0              # index in the step's global execution order
    cp_microbatches_in_step: int = 0    # this rank's entries in the step (0: idle this step)
    cp_entry: int = 0                   # index of this batch among them
    cp_step_microbatches: int = 0       # entries of the whole step; > 0 marks a dynamic-CP batch
    cp_step_documents: int = 0
    cp_tokens_per_rank: int = 0
    cp_documents: torch.Tensor | None = None  # int32 [documents]: indices in the step's document list
    cp_wave: int = 0                    # the entry's wave (StepPlan.waves)
    cp_step_waves: int = 0              # waves in the step; 0 from a server that predates them

    @property
    def max_seqlen(self) -> int:
        """Longest segment, as varlen attention kernels want it."""
        return int(self.seq_lens.max()) if self.seq_lens.numel() else 0

    @property
    def dynamic_cp(self) -> bool:
        return self.cp_step_microbatches > 0

    @property
    def ends_step(self) -> bool:
        """True on the last batch of a global step (every batch without dynamic CP)."""
        return not self.dynamic_cp or self.cp_entry + 1 >= self.cp_microbatches_in_step


def to_batch(msg) -> Batch:
    """Turn a PackedBatch message into a Batch: views on the message's bytes, labels widened."""
    dynamic = msg.cp_step_microbatches > 0
    b, s = (1, len(msg.tokens) // 4) if dynamic else (msg.micro_batch_size, msg.seq_len)

    def view(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)

    labels32 = np.frombuffer(msg.labels, dtype="<i4")
    return Batch(
        tokens=view(msg.tokens, torch.int32).view(b, s),
        labels=torch.from_numpy(labels32.astype(np.int64)).view(b, s),
        position_ids=view(msg.position_ids, torch.int32).view(b, s),
        cu_seqlens=view(msg.cu_seqlens, torch.int32),
        seq_lens=view(msg.seq_lens, torch.int32),
        row_ids=view(msg.row_ids, torch.int64),
        doc_hashes=view(msg.doc_hashes, torch.uint64),
        num_tokens=int(msg.num_tokens),
        efficiency=float(msg.efficiency),
        step=int(msg.step),
        resume_token=msg.resume_token,
        cp_group_start=int(msg.cp_group_start),
        cp_group_size=int(msg.cp_group_size),
        cp_microbatch=int(msg.cp_microbatch),
        cp_microbatches_in_step=int(msg.cp_microbatches_in_step),
        cp_entry=int(msg.cp_entry),
        cp_step_microbatches=int(msg.cp_step_microbatches),
        cp_step_documents=int(msg.cp_step_documents),
        cp_tokens_per_rank=int(msg.cp_tokens_per_rank),
        cp_documents=view(msg.cp_documents, torch.int32) if dynamic else None,
        cp_wave=int(msg.cp_wave),
        cp_step_waves=int(msg.cp_step_waves),
    )


def check_token_range(msg, vocab_size: int, address: str) -> None:
    """DataServiceError (DATA_LOSS) if a message carries a token id outside [0, vocab_size):
    a damaged shard or replica must not reach the embedding lookup. vocab_size 0: unknown."""
    tokens = np.frombuffer(msg.tokens, dtype="<i4")
    if not (vocab_size and tokens.size):
        return
    high, low = int(tokens.max()), int(tokens.min())
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise DataServiceError(f"data service at {address} sent token id {bad} in step {msg.step}, outside the "
                               f"vocabulary of {vocab_size} ids: its data is damaged", grpc.StatusCode.DATA_LOSS)


_END = object()


@dataclass(frozen=True)
class _Settings:
    """What the prefetch thread needs, copied so that it holds no reference to the DataClient
    (a client dropped without close() is then collected, and its __del__ stops the thread)."""

    addresses: tuple[str, ...]
    request: dict
    prefetch: int
    max_batches: int
    max_retries: int
    retry_s: float  # > 0: give up after an outage of this many seconds (instead of counting retries)
    idle_timeout: float  # > 0: a stream silent this long while waited on is cancelled and retried
    backoff: float
    max_backoff: float
    vocab_size: int  # 0: ask each replica (GetInfo) before its first stream


class DataClient:
    """Iterate packed micro-batches for one data-parallel rank from one or more replicas.

    One consumer thread at a time: `next()`, `state_dict()` and `load_state_dict()` are
    meant to be called from the training loop, not concurrently.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        seq_len: int,
        micro_batch_size: int,
        seed: int = 0,
        consumer: str = "trainer",
        blend: dict[str, float] | None = None,
        resume_token: str | None = None,
        prefetch: int = 4,
        max_batches: int = 0,
        max_retries: int = 8,
        retry_s: float = 0.0,
        idle_timeout: float = 0.0,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        max_receive_bytes: int = MAX_RECEIVE_BYTES,
        cp_rank: int = 0,
        cp_size: int = 1,
        dynamic_cp: bool = False,
        cp_token_budget: int = 0,
        rows_per_step: int = 0,
        auth: ClientAuth | None = None,
        vocab_size: int = 0,
    ) -> None:
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("DataClient needs at least one address (host:port)")
        if prefetch < 1:
            raise ValueError(f"prefetch is {prefetch}; it must be at least 1")
        if max_retries < 0:
            raise ValueError(f"max_retries is {max_retries}; it must be >= 0")
        if retry_s < 0 or idle_timeout < 0:
            raise ValueError(f"retry_s={retry_s} and idle_timeout={idle_timeout} must be >= 0 (0: off)")
        self._request = dict(
            consumer=consumer, dp_rank=dp_rank, dp_size=dp_size, seq_len=seq_len,
            micro_batch_size=micro_batch_size, seed=seed,
            blend=[pb2.DatasetWeight(name=k, weight=v) for k, v in (blend or {}).items()],
            cp_rank=cp_rank, cp_size=cp_size, dynamic_cp=dynamic_cp, cp_token_budget=cp_token_budget,
            rows_per_step=rows_per_step,
        )
        self._blend = dict(blend or {})
        if vocab_size < 0:
            raise ValueError(f"vocab_size is {vocab_size}; it must be >= 0 (0: as the server says)")
        self._settings = _Settings(tuple(self.addresses), self._request, prefetch, max_batches,
                                   max_retries, retry_s, idle_timeout, backoff, max_backoff, vocab_size)
        self._channels = Channels(client_options(max_receive_bytes), auth)  # auth: TLS and the bearer token
        self._delivered_token = resume_token or ""
        self._delivered = 0
        self._worker: _Prefetcher | None = None
        self._closed = False

    # ---- iteration --------------------------------------------------------------------

    def __iter__(self) -> "DataClient":
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise RuntimeError("DataClient is closed")
        if self._worker is None:
            self._worker = _Prefetcher(self._settings, self._channels, self._delivered_token, self._delivered)
        item = self._worker.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._delivered_token = item.resume_token
        self._delivered += int(item.ends_step)  # steps, under dynamic CP
        return item

    @property
    def address(self) -> str | None:
        """The replica the current (or last) stream was read from; None before the first."""
        return self._worker.address if self._worker is not None else None

    # ---- state ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the caller stands: the token after the last batch it received from next()."""
        return {
            "resume_token": self._delivered_token,
            "delivered": self._delivered,
            "dp_rank": self._request["dp_rank"],
            "dp_size": self._request["dp_size"],
            "seq_len": self._request["seq_len"],
            "micro_batch_size": self._request["micro_batch_size"],
            "seed": self._request["seed"],
            "blend": dict(self._blend),
            "cp_rank": self._request["cp_rank"],
            "cp_size": self._request["cp_size"],
            "dynamic_cp": self._request["dynamic_cp"],
            "cp_token_budget": self._request["cp_token_budget"],
            "rows_per_step": self._request["rows_per_step"],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state["resume_token"]`; batches already prefetched are dropped.

        Only the token is taken: this client's own layout (dp_rank, dp_size, ...) applies,
        which is how a job resumes on a different number of ranks.
        """
        self._stop_worker()
        self._delivered_token = state.get("resume_token", "") or ""
        self._delivered = int(state.get("delivered", 0))

    def info(self, timeout: float = 10.0) -> dict:
        """The server's GetInfo as a dict; tries each replica in turn."""
        return get_info(self._channels, self.addresses, timeout)

    def _stop_worker(self, wait: bool = True) -> None:
        if self._worker is not None:
            self._worker.stop(wait)
            self._worker = None

    def close(self) -> None:
        """Stop prefetching and close the channels."""
        self._stop_worker()
        self._channels.close()
        self._closed = True

    def __enter__(self) -> "DataClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # no join: the collector may run this on any thread, the prefetch thread included
            self._stop_worker(wait=False)
        except Exception:
            pass


class _Prefetcher:
    """One background reader: stream -> Batch -> bounded queue, with reconnect and failover."""

    def __init__(self, settings: _Settings, channels: Channels, token: str, delivered: int) -> None:
        self._settings, self._channels = settings, channels
        self._queue: queue.Queue = queue.Queue(maxsize=settings.prefetch)
        self._stopped = threading.Event()
        self._call = None
        self._waiting_since: float | None = None  # while the reader waits for the server's next message
        self._idle_cancelled = None  # the call the idle watch cancelled
        self._final = None  # the end or the error, kept so that later get()s repeat it
        self.address: str | None = None
        self._lock = threading.Lock()
        self._token = token  # of the last batch RECEIVED: where a reconnect starts
        # Dynamic CP: (step, entries received) while inside a step; a reconnect replays the
        # step from its start, and these entries are dropped.
        self._partial: tuple[int, int] | None = None
        self._remaining = settings.max_batches - delivered if settings.max_batches else 0
        self._vocab: dict[str, int] = {}
        self._thread = None
        if settings.max_batches and self._remaining <= 0:
            self._queue.put(_END)
            return
        self._thread = threading.Thread(target=self._run, name="DataClient-prefetch", daemon=True)
        self._thread.start()
        if settings.idle_timeout > 0:
            threading.Thread(target=self._watch_idle, name="DataClient-idle", daemon=True).start()

    def _watch_idle(self) -> None:
        """Cancel the open call when the reader has waited `idle_timeout` s for a message."""
        limit = self._settings.idle_timeout
        while not self._stopped.wait(min(0.5, limit / 4)):
            with self._lock:
                since, call = self._waiting_since, self._call
                if since is not None and call is not None and time.monotonic() - since > limit:
                    self._idle_cancelled = call
                    self._waiting_since = None
                    call.cancel()

    def get(self):
        """The next Batch, or _END, or the exception that ended the stream (again and again)."""
        if self._final is not None:
            return self._final
        item = self._queue.get()
        if item is _END or isinstance(item, BaseException):
            self._final = item
        return item

    def _put(self, item) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        c = self._settings
        failures, index, tried = 0, 0, []
        outage_start = 0.0  # of the failures in a row, for retry_s
        received = False  # a batch came: a failure from now on is an outage, and said so
        lost_at = None  # when the stream was lost, until it is back
        who = f"dp rank {c.request['dp_rank']}"
        if c.request["cp_size"] > 1:
            who += f", cp rank {c.request['cp_rank']}"
        while not self._stopped.is_set():
            address = c.addresses[index % len(c.addresses)]
            request = pb2.StreamRequest(resume_token=self._token, max_batches=self._remaining, **c.request)
            try:
                vocab = c.vocab_size or self._vocab_of(address)
                with self._lock:
                    if self._stopped.is_set():
                        return
                    self._call = pb2_grpc.DataServiceStub(self._channels.get(address)).StreamBatches(request)
                    self.address = address
                for msg in self._messages(self._call):
                    check_token_range(msg, vocab, address)
                    if lost_at is not None:
                        log.warning("data stream of %s back from %s after %.1f s (%d reconnect attempt(s))", who,
                                    address, time.monotonic() - lost_at, failures)
                        lost_at = None
                    received = True
                    failures, tried = 0, []
                    if self._partial and msg.step == self._partial[0] and msg.cp_entry < self._partial[1]:
                        continue  # received before the reconnect
                    batch = to_batch(msg)
                    self._token = msg.resume_token
                    self._partial = None if batch.ends_step else (batch.step, batch.cp_entry + 1)
                    if not self._put(batch):
                        return
                    if not batch.ends_step:
                        continue  # max_batches counts steps under dynamic CP
                    if self._remaining:
                        self._remaining -= 1
                        if self._remaining == 0:
                            break
                self._put(_END)
                return
            except grpc.RpcError as err:
                if self._stopped.is_set():
                    return
                code, details = err.code(), err.details()
                reason = failure_reason(err)
                if self._idle_cancelled is not None and self._idle_cancelled is self._call:
                    code, reason = grpc.StatusCode.DEADLINE_EXCEEDED, f"no message for {c.idle_timeout:g} s"
                if code not in RETRYABLE:
                    self._put(DataServiceError(f"data service at {address} refused the stream: "
                                               f"{code.name}: {details}", code))
                    return
                failures += 1
                if failures == 1:
                    outage_start = time.monotonic()
                tried.append(f"{address} ({reason})")
                budget = f"for up to {c.retry_s:g} s" if c.retry_s else f"up to {c.max_retries} retries"
                if received and lost_at is None:
                    lost_at = time.monotonic()
                    log.warning("data stream of %s from %s lost (%s); reconnecting, %s", who, address, reason, budget)
                spent = time.monotonic() - outage_start
                if (spent > c.retry_s) if c.retry_s else (failures > c.max_retries):
                    after = f"for {spent:.0f} s ({failures} attempts)" if c.retry_s else f"after {c.max_retries} retries"
                    self._put(DataServiceError(f"no data service replica answered {after}; tried "
                                               + "; ".join(dict.fromkeys(tried)), code))
                    return
                index += 1
                delay = min(c.max_backoff, c.backoff * 2 ** (failures - 1)) * (1 + 0.25 * random.random())
                if c.retry_s:  # the last attempt comes as the budget ends, not a backoff after it
                    delay = min(delay, max(0.0, c.retry_s - spent) + 0.01)
                self._stopped.wait(delay)  # jitter: replicas see no herd
            except Exception as err:  # a malformed message, a bug: give it to the caller
                self._put(err)
                return

    def _messages(self, call):
        """The call's messages, with `_waiting_since` set while each is awaited (the idle watch)."""
        while True:
            with self._lock:
                self._waiting_since = time.monotonic()
            try:
                msg = next(call)
            except StopIteration:
                return
            finally:
                with self._lock:
                    self._waiting_since = None
            yield msg

    def _vocab_of(self, address: str) -> int:
        """The vocabulary size `address` serves, asked once per replica (grpc.RpcError if unreachable)."""
        if address not in self._vocab:
            reply = pb2_grpc.DataServiceStub(self._channels.get(address)).GetInfo(
                pb2.InfoRequest(), timeout=min(30.0, self._settings.idle_timeout or 30.0))
            self._vocab[address] = int(reply.vocab_size)
        return self._vocab[address]

    def stop(self, wait: bool = True) -> None:
        with self._lock:
            self._stopped.set()
            if self._call is not None:
                self._call.cancel()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
