"""The data service's gRPC server: streams packed micro-batches, one stream per trainer rank.

Every batch is a pure function of (datasets, blend, seed, seq_len, global rows), so the
server keeps no per-client state: a request names its layout (dp_rank, dp_size,
micro_batch_size) and where to start (a resume token), and any replica over the same
shards answers it identically. Plans are cached by (blend, seed, seq_len) because
building one may scan every document length; a stream holds a worker thread for its
whole life, so the pool is sized for many concurrent trainers.

With dynamic context parallelism (`StreamRequest.dynamic_cp`) a stream carries one rank's
entries of each global step's CP plan instead of fixed micro-batches (dataservice.cp_stream).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import protos
from dataservice.auth import ServerTLS, TokenInterceptor
from dataservice.cp_plan import H200_COST, CostModel
from dataservice.cp_stream import CPRequest, StepCache, check_cp_request, cp_messages
from dataservice.limits import DEFAULT_LIMITS, RequestLimits, check_request
from dataservice.metrics import ServiceMetrics
from dataservice.plan import Anchor, ScanCancelled, ScanLimitError, StreamPlan, rows_for
from dataservice.send_watch import SendWatch
from dataservice.shards import DataLossError, DatasetError, ShardedDataset, verify_dataset
from dataservice.tokens import (
    DEFAULT_TOKEN_SECRET,
    ResumeToken,
    TokenError,
    datasets_fingerprint,
)

pb2, pb2_grpc = protos.load()
log = logging.getLogger(__name__)

SERVICE_NAME = "tessera.dataservice.v1.DataService"
MAX_SEQ_LEN = DEFAULT_LIMITS.max_seq_len
MAX_MICRO_BATCH_SIZE = DEFAULT_LIMITS.max_micro_batch_size
MAX_MESSAGE_BYTES = 128 << 20
DEFAULT_WORKERS = 128
#: Seconds a stream may wait on a client that reads nothing before it is dropped. A dropped
#: trainer reconnects from its last token when it reads again (CANCELLED is retryable), so this
#: only has to outlast ordinary gaps between reads while freeing a stuck stream's thread and
#: message (up to max_message_bytes) within two minutes.
DEFAULT_SEND_TIMEOUT_S = 120.0
#: Longest client-supplied text (e.g. `consumer`) that reaches the log.
_LOG_TEXT_CHARS = 80
#: Worker threads kept free of streams so that GetInfo and health checks always get one.
_RESERVED_WORKERS = 4
_PLAN_CACHE_SIZE = 16


def worst_case_message_bytes(micro_batch_size: int, seq_len: int) -> int:
    """Upper bound on a PackedBatch's size: 12 bytes per token for tokens/labels/positions,
    and in the worst case (one-token documents) one segment per token at 16 bytes each."""
    n = micro_batch_size * seq_len
    return 12 * n + 16 * n + 4 + 8 * micro_batch_size + 1024


class RequestError(ValueError):
    """A request the service cannot serve; the message goes to the client as INVALID_ARGUMENT."""


class _Malformed:
    """Stands in for a request whose bytes do not parse, so that it gets INVALID_ARGUMENT."""

    def __init__(self, kind: str) -> None:
        self.kind = kind


def _lenient(message_class):
    """A request deserializer that never raises: gRPC would answer a parse failure INTERNAL."""
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception:  # any parse failure: a malformed message from the client
            return _Malformed(message_class.__name__)
    return parse


def printable(text: str, limit: int = _LOG_TEXT_CHARS) -> str:
    """Client-supplied `text` made safe for one log line: control characters (newlines
    included) become '?', and it is cut to `limit` characters."""
    clean = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


@dataclass
class _Dataset:
    data: ShardedDataset
    path: str
    weight: float


@dataclass
class _Stream:
    """A validated request: the plan to read from, the layout and where to start."""

    plan: StreamPlan
    dp_rank: int
    dp_size: int
    micro_batch_size: int
    seq_len: int
    start_step: int
    anchor: Anchor
    identity: dict  # the fields a resume token carries besides row and anchor
    cp: CPRequest | None = None  # dynamic CP: the stream carries plan entries, one step at a time

    @property
    def plan_key(self) -> tuple:
        return (self.identity["blend"], self.identity["seed"], self.identity["seq_len"])


class _PlanEntry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.plan: StreamPlan | None = None
        self.users = 0  # open streams reading this plan (under the servicer's plans lock)


def normalise_blend(blend: Sequence[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """A blend as the server keys its plans: (name, weight) sorted by name, weights summing to 1."""
    total = sum(w for _, w in blend)
    return tuple(sorted((name, w / total) for name, w in blend))


def blend_plan(datasets: Mapping[str, ShardedDataset], blend: Sequence[tuple[str, float]], seed: int, seq_len: int,
               max_scan_windows: int | None = None) -> StreamPlan:
    """The StreamPlan the server streams for `blend` (normalised, of names in `datasets`), `seed`
    and `seq_len`: also what `tessera-data show-row` reads offline, so both show the same rows."""
    blend = normalise_blend(blend)
    return StreamPlan([datasets[name] for name, _ in blend], [weight for _, weight in blend], seed=seed,
                      seq_len=seq_len, max_scan_windows=max_scan_windows)


class DataServicer(pb2_grpc.DataServiceServicer):
    """Serves StreamBatches and GetInfo over a fixed set of opened datasets."""

    def __init__(
        self,
        datasets: Sequence[tuple[ShardedDataset, str, float]],
        *,
        token_secret: str | bytes = DEFAULT_TOKEN_SECRET,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_streams: int = DEFAULT_WORKERS - _RESERVED_WORKERS,
        cp_cost: CostModel = H200_COST,
        metrics: ServiceMetrics | None = None,
        limits: RequestLimits = DEFAULT_LIMITS,
        send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
        max_concurrent_rpcs: int = DEFAULT_WORKERS,
    ) -> None:
        if not datasets:
            raise ValueError("the data service needs at least one dataset")
        self._datasets: dict[str, _Dataset] = {}
        for data, path, weight in datasets:
            if data.name in self._datasets:
                raise ValueError(
                    f"two datasets are named {data.name!r} ({self._datasets[data.name].path} and "
                    f"{path}); dataset names must be unique within one server"
                )
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"dataset {data.name!r} has weight {weight!r}; weights must be finite and > 0")
            self._datasets[data.name] = _Dataset(data, str(path), float(weight))
        first = next(iter(self._datasets.values())).data
        for entry in self._datasets.values():
            for attr in ("vocab_size", "pad_id", "bos_id", "eos_id"):
                if getattr(entry.data, attr) != getattr(first, attr):
                    raise ValueError(
                        f"datasets {first.name!r} and {entry.data.name!r} disagree on {attr} "
                        f"({getattr(first, attr)} vs {getattr(entry.data, attr)}); blended datasets "
                        "must share one tokenizer"
                    )
        self._secret = token_secret
        self._vocab_size = first.vocab_size
        self._max_message_bytes = int(max_message_bytes)
        self._datasets_fp = datasets_fingerprint([(n, d.data.fingerprint) for n, d in self._datasets.items()])
        self._default_blend = self._normalise([(n, d.weight) for n, d in self._datasets.items()])
        self._plans: OrderedDict[tuple, _PlanEntry] = OrderedDict()
        self._plans_lock = threading.Lock()
        # Two of the largest steps: the ranks of a job read the same step and at most the next.
        self._cp_steps = StepCache(cp_cost, max_tokens=2 * limits.max_step_tokens)
        self._stream_slots = threading.BoundedSemaphore(max_streams)
        self._max_streams = max_streams
        self.limits = limits
        self._max_concurrent_rpcs = int(max_concurrent_rpcs)
        self.stopping = threading.Event()
        self.metrics = metrics or ServiceMetrics()
        self.send_watch = SendWatch(send_timeout, lambda who: self.metrics.error(grpc.StatusCode.CANCELLED))

    # ---- requests ---------------------------------------------------------------------

    @staticmethod
    def _normalise(blend: Sequence[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
        return normalise_blend(blend)

    def _blend(self, request) -> tuple[tuple[str, float], ...]:
        if not request.blend:
            return self._default_blend
        seen: dict[str, float] = {}
        for item in request.blend:
            if item.name not in self._datasets:
                raise RequestError(
                    f"blend names unknown dataset {item.name!r}; this server has "
                    f"{sorted(self._datasets)}"
                )
            if item.name in seen:
                raise RequestError(f"blend names dataset {item.name!r} twice; name each dataset once")
            if not (math.isfinite(item.weight) and item.weight > 0):
                raise RequestError(
                    f"blend weight for {item.name!r} is {item.weight!r}; weights must be finite and > 0"
                )
            seen[item.name] = item.weight
        return self._normalise(list(seen.items()))

    def _plan(self, blend: tuple[tuple[str, float], ...], seed: int, seq_len: int) -> StreamPlan:
        """The plan of (blend, seed, seq_len), counted as used by one more stream until `_release`."""
        key = (blend, seed, seq_len)
        with self._plans_lock:
            entry = self._plans.get(key)
            if entry is None:
                entry = self._plans[key] = _PlanEntry()
                # Evict the least recently used plans that no stream reads; plans in use stay.
                for old in [k for k, e in self._plans.items() if e.users == 0 and k != key]:
                    if len(self._plans) <= _PLAN_CACHE_SIZE:
                        break
                    del self._plans[old]
            else:
                self._plans.move_to_end(key)
            entry.users += 1
        try:
            return self._build_plan(key, entry)
        except BaseException:
            self._release(key)
            raise

    def _release(self, key: tuple) -> None:
        """A stream of plan `key` ended: with no stream left on it, free its windows and CP steps."""
        with self._plans_lock:
            entry = self._plans.get(key)
            if entry is None:
                return
            entry.users -= 1
            idle = entry.users == 0 and entry.plan is not None
        if idle:
            entry.plan.release_windows()
            self._cp_steps.forget(entry.plan.fingerprint)

    def _build_plan(self, key: tuple, entry: _PlanEntry) -> StreamPlan:
        blend, seed, seq_len = key
        # One lock per key: a slow build blocks only the streams that wait for that plan.
        with entry.lock:
            if entry.plan is None:
                try:
                    entry.plan = blend_plan({name: d.data for name, d in self._datasets.items()}, blend, seed,
                                            seq_len, max_scan_windows=self.limits.max_scan_windows)
                except ValueError as err:
                    with self._plans_lock:
                        if self._plans.get(key) is entry:
                            del self._plans[key]
                    raise RequestError(str(err)) from err
            return entry.plan

    def check(self, request) -> CPRequest | None:
        """The cheap checks of a StreamRequest (no plan, no scan): RequestError if it cannot be
        served; its dynamic-CP part (None without dynamic_cp)."""
        if isinstance(request, _Malformed):
            raise RequestError(f"the request is not a valid {request.kind} message")
        try:
            check_request(request, self.limits)
        except ValueError as err:
            raise RequestError(str(err)) from None
        if request.dp_size < 1:
            raise RequestError(f"dp_size is {request.dp_size}; it must be at least 1")
        if request.dp_rank >= request.dp_size:
            raise RequestError(
                f"dp_rank is {request.dp_rank} but dp_size is {request.dp_size}; dp_rank must be "
                f"in [0, {request.dp_size - 1}]"
            )
        need = worst_case_message_bytes(request.micro_batch_size, request.seq_len)
        if need > self._max_message_bytes:
            raise RequestError(
                f"micro_batch_size {request.micro_batch_size} x seq_len {request.seq_len} can need "
                f"{need} bytes per message, over this server's max message size of "
                f"{self._max_message_bytes} bytes (max_message_bytes); lower micro_batch_size or seq_len"
            )
        try:
            cp = check_cp_request(request, self._max_message_bytes)
        except ValueError as err:
            raise RequestError(str(err)) from None
        self._blend(request)
        return cp

    def resolve(self, request, context=None) -> _Stream:
        """Validate a StreamRequest and find where its stream starts; RequestError if it cannot,
        ScanLimitError if its resume point lies too far from its anchor, ScanCancelled if
        `context` ends during the scan. The stream holds its plan until `_release(stream.plan_key)`."""
        cp = self.check(request)
        blend = self._blend(request)
        plan = self._plan(blend, request.seed, request.seq_len)
        key = (blend, request.seed, request.seq_len)
        try:
            return self._locate(request, plan, blend, cp, context)
        except BaseException:
            self._release(key)
            raise

    def _locate(self, request, plan: StreamPlan, blend, cp: CPRequest | None, context) -> _Stream:
        identity = dict(
            plan=plan.fingerprint, datasets=self._datasets_fp, blend=blend,
            seed=request.seed, seq_len=request.seq_len,
        )
        per_step = cp.rows_per_step if cp else request.micro_batch_size * request.dp_size
        if not request.resume_token:
            return _Stream(plan, request.dp_rank, request.dp_size, request.micro_batch_size, request.seq_len, 0,
                           plan.start_anchor(), identity, cp)
        try:
            token = ResumeToken.decode(request.resume_token, self._secret)
        except TokenError as err:
            raise RequestError(str(err)) from None
        problem = token.mismatch(**identity)
        if problem:
            raise RequestError(problem)
        if token.row % per_step:
            layout = (f"rows_per_step {per_step}" if cp else
                      f"micro_batch_size {request.micro_batch_size} x dp_size {request.dp_size} = {per_step} rows per step")
            raise RequestError(
                f"resume token points at global row {token.row}, which is not a step boundary for "
                f"{layout}; pick a layout whose rows per step divide {token.row}"
            )
        try:
            anchor = Anchor.from_dict(token.anchor, len(plan.datasets))
            anchor = plan.seek(token.row, anchor, active=context.is_active if context is not None else None)
        except (ValueError, KeyError, TypeError) as err:
            raise RequestError(f"resume token's anchor does not fit this plan: {err}") from None
        return _Stream(plan, request.dp_rank, request.dp_size, request.micro_batch_size,
                       request.seq_len, token.row // per_step, anchor, identity, cp)

    # ---- RPCs -------------------------------------------------------------------------

    def _abort_scan(self, context, err: ScanLimitError) -> None:
        self.metrics.error(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))

    def _refuse(self, context, who: str, code: grpc.StatusCode, err) -> None:
        log.info("refused %s: %s", who, printable(str(err), 400))
        self.metrics.error(code)
        context.abort(code, str(err))

    def StreamBatches(self, request, context):
        if isinstance(request, _Malformed):
            who = f"?@{context.peer()}"
        else:
            who = f"{printable(request.consumer or '?')}@{context.peer()} dp {request.dp_rank}/{request.dp_size}"
        started = time.perf_counter()
        metrics = self.metrics
        if self.stopping.is_set():  # draining: new streams go to another replica at once
            metrics.error(grpc.StatusCode.UNAVAILABLE)
            context.abort(grpc.StatusCode.UNAVAILABLE, "data service is draining; use another replica")
        try:
            self.check(request)
        except RequestError as err:
            self._refuse(context, who, grpc.StatusCode.INVALID_ARGUMENT, err)
        # The slot comes before the plan and the scan: a flood of requests cannot pin more workers.
        if not self._stream_slots.acquire(blocking=False):
            log.warning("refused %s: all %d stream slots busy", who, self._max_streams)
            metrics.error(grpc.StatusCode.UNAVAILABLE)
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this replica already serves {self._max_streams} streams (its limit); retry on "
                "another replica or start this one with more --workers",
            )
        metrics.streams_active.inc()
        sent, stream = 0, None
        try:
            try:
                stream = self.resolve(request, context)
            except RequestError as err:
                self._refuse(context, who, grpc.StatusCode.INVALID_ARGUMENT, err)
            except ScanLimitError as err:
                self._refuse(context, who, grpc.StatusCode.RESOURCE_EXHAUSTED, err)
            except ScanCancelled:
                log.info("stream %s cancelled by its client while finding its resume point", who)
                return
            log.info("stream %s: B %d, seq_len %d, seed %d, from step %d", who, stream.micro_batch_size,
                     stream.seq_len, request.seed, stream.start_step)
            metrics.streams.inc()
            rows = 0 if stream.cp is not None else stream.micro_batch_size
            messages = self._batches(stream, request.max_batches, context)
            while True:
                t0 = time.perf_counter()
                message = next(messages, None)
                if message is None:
                    break
                now = time.perf_counter()
                metrics.sent(now - (started if sent == 0 else t0), rows, message.num_tokens, sent == 0)
                ticket = self.send_watch.sending(context, who)
                try:
                    yield message  # returns once gRPC has taken the message (flow control permitting)
                finally:
                    self.send_watch.sent(ticket)
                sent += 1
        finally:
            metrics.streams_active.dec()
            self._stream_slots.release()
            if stream is not None:
                self._release(stream.plan_key)
                log.info("stream %s ended after %d batches", who, sent)

    def _batches(self, stream: _Stream, max_batches: int, context) -> Iterable:
        if stream.cp is not None:
            yield from self._cp_batches(stream, max_batches, context)
            return
        b, n = stream.micro_batch_size, stream.dp_size
        anchor, step, sent = stream.anchor, stream.start_step, 0
        while max_batches == 0 or sent < max_batches:
            if self.stopping.is_set():
                self.metrics.drained.inc()
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "data service is shutting down; reconnect with the last resume token",
                )
            if not context.is_active():
                return
            rows = rows_for(step, stream.dp_rank, n, b)
            code, failure = grpc.StatusCode.INTERNAL, None
            try:
                batch, anchor = stream.plan.rows(rows, anchor)
                self._check_vocab(batch.tokens)
            except ScanLimitError as err:  # a forged anchor whose windows hold no rows
                self._abort_scan(context, err)
            except DataLossError as err:
                log.error("step %d for dp_rank %d/%d: %s", step, stream.dp_rank, n, err)
                code, failure = grpc.StatusCode.DATA_LOSS, str(err)
            except Exception as err:  # a bug: say so, keep the server up
                log.exception("building step %d for dp_rank %d/%d failed", step, stream.dp_rank, n)
                failure = f"building step {step} for dp_rank {stream.dp_rank} failed: {err!r}"
            if failure:
                self.metrics.error(code)
                context.abort(code, failure)
            token = ResumeToken(row=(step + 1) * b * n, anchor=anchor.to_dict(), **stream.identity)
            yield self._message(batch, step, b, stream.seq_len, token.encode(self._secret))
            step += 1
            sent += 1

    def _cp_batches(self, stream: _Stream, max_steps: int, context) -> Iterable:
        """Dynamic CP: per global step, this rank's plan entries (an idle message if none)."""
        cp, anchor, step, sent = stream.cp, stream.anchor, stream.start_step, 0
        while max_steps == 0 or sent < max_steps:
            if self.stopping.is_set():
                self.metrics.drained.inc()
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "data service is shutting down; reconnect with the last resume token",
                )
            if not context.is_active():
                return
            code, failure = grpc.StatusCode.INTERNAL, None
            try:
                planned = self._cp_steps.get(stream.plan, step, anchor, cp)
                self._check_vocab(planned.tokens)
            except ScanLimitError as err:  # a forged anchor whose windows hold no rows
                self._abort_scan(context, err)
            except DataLossError as err:
                log.error("dynamic-CP step %d: %s", step, err)
                code, failure = grpc.StatusCode.DATA_LOSS, str(err)
            except Exception as err:  # a bug: say so, keep the server up
                log.exception("building dynamic-CP step %d failed", step)
                failure = f"building dynamic-CP step {step} for dp_cp rank {cp.index}/{cp.num_ranks} failed: {err!r}"
            if failure:
                self.metrics.error(code)
                context.abort(code, failure)
            anchor = planned.last_anchor
            # Mid-step messages resume at their step's first row: streams restart at step boundaries.
            again = ResumeToken(row=step * cp.rows_per_step, anchor=planned.first_anchor.to_dict(),
                                **stream.identity).encode(self._secret)
            done = ResumeToken(row=(step + 1) * cp.rows_per_step, anchor=anchor.to_dict(),
                               **stream.identity).encode(self._secret)
            yield from cp_messages(planned, cp, stream.seq_len, again, done)
            step += 1
            sent += 1

    def _check_vocab(self, tokens: np.ndarray) -> None:
        """DataLossError unless every token id lies in [0, vocab_size): the last guard against
        damaged bytes that slipped past the checksums (e.g. with --skip-verify)."""
        if tokens.size and (int(tokens.max()) >= self._vocab_size or int(tokens.min()) < 0):
            bad = int(tokens.max()) if int(tokens.max()) >= self._vocab_size else int(tokens.min())
            raise DataLossError(f"token id {bad} lies outside the vocabulary of {self._vocab_size} ids; "
                                "a shard is damaged (run tessera-data inspect on the datasets)", "")

    @staticmethod
    def _message(batch, step: int, micro_batch_size: int, seq_len: int, token: str):
        return pb2.PackedBatch(
            step=step,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            tokens=_raw(batch.tokens, "<i4"),
            labels=_raw(batch.labels, "<i4"),
            position_ids=_raw(batch.position_ids, "<i4"),
            cu_seqlens=_raw(batch.cu_seqlens, "<i4"),
            seq_lens=_raw(batch.seq_lens, "<i4"),
            row_ids=_raw(batch.row_ids, "<i8"),
            doc_hashes=_raw(batch.doc_hashes, "<u8"),
            num_tokens=int(batch.num_tokens),
            efficiency=float(batch.efficiency),
            resume_token=token,
        )

    def GetInfo(self, request, context):
        if isinstance(request, _Malformed):
            self.metrics.error(grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {request.kind} message")
        first = next(iter(self._datasets.values())).data
        tokenizer = first.manifest.get("tokenizer", {})
        kind, name = tokenizer.get("kind", ""), tokenizer.get("name", "")
        weights = dict(self._default_blend)
        reply = pb2.InfoReply(
            format_version=int(first.manifest.get("format_version", 1)),
            tokenizer=f"{kind}:{name}" if name and name != kind else str(kind),
            vocab_size=first.vocab_size,
            pad_id=first.pad_id,
            eos_id=first.eos_id,
            bos_id=first.bos_id,
            fingerprint=blend_fingerprint(self._datasets_fp, self._default_blend),
            max_message_bytes=self._max_message_bytes,
            max_seq_len=self.limits.max_seq_len,
            limits=pb2.RequestLimits(
                **self.limits.as_dict(),
                max_concurrent_rpcs=self._max_concurrent_rpcs,
                max_streams=self._max_streams,
                stream_send_timeout_s=self.send_watch.timeout,
            ),
        )
        for name, entry in self._datasets.items():
            reply.datasets.add(
                name=name,
                path=entry.path,
                fingerprint=entry.data.fingerprint,
                num_documents=int(entry.data.num_documents),
                num_tokens=int(entry.data.num_tokens),
                weight=weights[name],
            )
        return reply


def _service_handler(servicer: DataServicer):
    """The DataService's methods, with deserializers that turn malformed bytes into INVALID_ARGUMENT."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches, request_deserializer=_lenient(pb2.StreamRequest),
            response_serializer=pb2.PackedBatch.SerializeToString),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo, request_deserializer=_lenient(pb2.InfoRequest),
            response_serializer=pb2.InfoReply.SerializeToString),
    })


def blend_fingerprint(datasets_fp: str, blend: Sequence[tuple[str, float]]) -> str:
    """Identity of a blend: the datasets' contents and the normalised weights."""
    text = datasets_fp + ";" + ";".join(f"{name}={weight!r}" for name, weight in blend)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _raw(array: np.ndarray, dtype: str) -> bytes:
    # The wire is little-endian; on little-endian hosts this is a no-copy view before tobytes.
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel arguments of the server: message limits, keep-alive, exclusive port."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", 1 << 20),  # requests are tiny
        # Ping idle clients so dead trainers free their stream (and its thread) within a minute.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Accept clients' keep-alive pings down to every 10 s, even between streams.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Without this, Linux lets a second server bind the same port and steal half the clients.
        ("grpc.so_reuseport", 0),
    ]


class DataServer:
    """A running data service: the gRPC server, its servicer and its health status."""

    def __init__(self, server: grpc.Server, servicer: DataServicer, health_servicer, port: int,
                 metrics_port: int | None = None, owned: Sequence[ShardedDataset] = ()) -> None:
        self.server, self.servicer, self.health, self.port = server, servicer, health_servicer, port
        self.metrics_port = metrics_port
        # Datasets `serve` opened from paths: closed with the server, since every shard is held
        # open and LMDB allows one environment per folder in a process.
        self.owned = list(owned)

    @property
    def metrics(self) -> ServiceMetrics:
        return self.servicer.metrics

    def active_streams(self) -> int:
        return int(self.metrics.registry.get_sample_value("tessera_data_streams_active") or 0)

    def drain(self, grace: float = 5.0) -> int:
        """Report NOT_SERVING, refuse new streams and end each open stream at its next message
        with UNAVAILABLE (its client continues from its last resume token on another replica, or
        on this address once it is back); wait up to `grace` s for them. Returns the streams
        still open after the wait (they are cancelled by `stop`)."""
        self.health.enter_graceful_shutdown()
        self.metrics.draining.set(1)
        self.servicer.stopping.set()
        deadline = time.monotonic() + grace
        while self.active_streams() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.active_streams()

    def stop(self, grace: float = 5.0) -> None:
        """Drain (see `drain`), then stop the gRPC server and the metrics endpoint."""
        self.drain(grace)
        self.server.stop(0).wait()
        self.servicer.send_watch.close()
        self.metrics.close()
        for data in self.owned:
            data.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (or timeout); True if it stopped."""
        return self.server.wait_for_termination(timeout)


def open_datasets(specs: Iterable[str | Path | tuple[str | Path, float]],
                  verify: bool = True) -> list[tuple[ShardedDataset, str, float]]:
    """Open each dataset folder; a spec is a path or (path, weight) with weight 1 by default.

    With `verify` every shard's checksum is checked (the cost of reading the shards once);
    either way shard sizes are. A damaged shard does not stop the server: it is logged, and
    the requests that read it get DATA_LOSS naming it.
    """
    opened = []
    for spec in specs:
        path, weight = (spec, 1.0) if isinstance(spec, (str, Path)) else spec
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"dataset folder {str(folder)!r} does not exist")
        data = ShardedDataset.open(folder)
        if verify:
            # The index, targets and manifest map every shard: without them nothing can be served.
            problems = verify_dataset(folder, data.manifest, shards=False)
            if problems:
                data.close()
                raise DatasetError(f"dataset {str(folder)!r} failed verification: {problems[0]}")
        started = time.perf_counter()
        for problem in data.verify_shards() if verify else data.damage():
            log.warning("dataset %r: shard %s; requests that read it get DATA_LOSS", data.name, problem)
        if verify:
            size = sum(int(s.get("bytes", 0)) for s in data.manifest["shards"])
            log.info("dataset %r: %d shards (%.1f MiB) verified in %.2f s", data.name,
                     len(data.manifest["shards"]), size / (1 << 20), time.perf_counter() - started)
        opened.append((data, str(folder), float(weight)))
    return opened


def serve(
    datasets,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    workers: int = DEFAULT_WORKERS,
    token_secret: str | bytes | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    cp_cost: CostModel = H200_COST,
    metrics_port: int | None = None,
    metrics_host: str | None = None,
    auth_tokens: Sequence[str] = (),
    tls: ServerTLS | None = None,
    limits: RequestLimits = DEFAULT_LIMITS,
    send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
) -> tuple[DataServer, int]:
    """Start a data service in this process; returns (server, bound port). Port 0 picks a free one.

    `datasets`: paths, (path, weight) pairs, or already opened (ShardedDataset, path, weight).
    `cp_cost`: the cost model of dynamic-CP plans (the trainer's model on its GPUs).
    `metrics_port`: serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: a free
    port, None: no endpoint; `DataServer.metrics_port` has the bound one); host default loopback.
    `token_secret`: the resume tokens' HMAC secret (None: the project-wide default, fit for loopback
    only; empty is an error). `auth_tokens`: bearer tokens of which every call but health must
    carry one (none: no token asked). `tls`: serve TLS, mutual when it has a client CA.
    `limits`: the caps on one request (dataservice.limits); `send_timeout`: seconds a stream may
    wait on a client that reads nothing before it is dropped. At most `workers` RPCs run at
    once; beyond that gRPC answers RESOURCE_EXHAUSTED at once instead of queueing them.
    """
    if workers < _RESERVED_WORKERS + 1:
        raise ValueError(f"workers is {workers}; it must be at least {_RESERVED_WORKERS + 1}")
    if token_secret is not None and not token_secret:
        raise ValueError("the resume-token secret is empty; give a non-empty one or none (the loopback default)")
    specs = list(datasets)
    given = bool(specs) and isinstance(specs[0], tuple) and isinstance(specs[0][0], ShardedDataset)
    opened = specs if given else open_datasets(specs)
    servicer = DataServicer(
        opened,
        token_secret=DEFAULT_TOKEN_SECRET if token_secret is None else token_secret,
        max_message_bytes=max_message_bytes,
        max_streams=workers - _RESERVED_WORKERS,
        cp_cost=cp_cost,
        metrics=ServiceMetrics(),
        limits=limits,
        send_timeout=send_timeout,
        max_concurrent_rpcs=workers,
    )
    refused = functools.partial(servicer.metrics.error, grpc.StatusCode.UNAUTHENTICATED)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dataservice"),
        options=server_options(max_message_bytes),
        interceptors=[TokenInterceptor(auth_tokens, refused)] if auth_tokens else None,
        maximum_concurrent_rpcs=workers,  # one thread each; more would queue behind streams that last hours
    )
    server.add_generic_rpc_handlers((_service_handler(servicer),))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = (server.add_secure_port(f"{host}:{port}", tls.credentials()) if tls is not None
                 else server.add_insecure_port(f"{host}:{port}"))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind the data service to {host}:{port} (address in use or invalid)")
    bound_metrics = None
    if metrics_port is not None:
        try:
            bound_metrics = servicer.metrics.serve_http(metrics_host or "127.0.0.1", metrics_port)
        except OSError as err:
            server.stop(0)
            raise OSError(f"could not serve metrics on {metrics_host or '127.0.0.1'}:{metrics_port}: {err.strerror or err}") \
                from None
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("data service on %s:%d with datasets %s", host, bound, list(servicer._datasets))
    return DataServer(server, servicer, health_servicer, bound, bound_metrics,
                      owned=() if given else [data for data, _, _ in opened]), bound
