"""Dynamic context parallelism in the data service: each global step's documents, planned.

Global step k is rows [k*G, (k+1)*G) of the stream (G = rows_per_step = the trainer's global
batch size): the same rows the step holds without dynamic CP, so the set of documents, and
with it the step's loss, does not depend on the layout. Their documents (the non-padding
segments of those rows, a piece of a long document counting as its own, exactly as the
attention of the rows sees it) go to `cp_plan.plan_cp_step` over the dp*cp ranks, and the stream
of dp_cp rank i carries `plan.for_rank(i)`: one message per entry, each with the entry's
documents back to back (no padding; the trainer's `dynamic_cp_inputs` splits them within the
entry's sub-group).

Every stream of one job plans the same steps, so `StepCache` builds each step once (the plan
is a pure function of the step, the ranks and the budget) and hands it to all of them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from typing import Iterable

import numpy as np

import protos
from dataservice.cp_plan import CostModel, MicroBatchPlan, StepPlan, padded_length, plan_cp_step
from dataservice.packing import MicroBatch
from dataservice.plan import Anchor, StreamPlan

__all__ = ["CPRequest", "PlannedStep", "StepCache", "check_cp_request", "cp_messages", "min_token_budget",
           "step_documents"]

pb2, _ = protos.load()

_STEP_CACHE_SIZE = 8  # the ranks of a job stay within a few steps of each other (they sync every step)


def _largest_group(num_ranks: int) -> int:
    return 1 << (int(num_ranks).bit_length() - 1)


def min_token_budget(seq_len: int, num_ranks: int) -> int:
    """The smallest budget under which any document piece (at most seq_len tokens) fits the
    largest aligned group of `num_ranks` ranks: pad(seq_len, 2g)/g tokens per rank."""
    g = _largest_group(num_ranks)
    return int(padded_length(int(seq_len), g)) // g


@dataclass(frozen=True)
class CPRequest:
    """The validated dynamic-CP part of a StreamRequest."""

    index: int  # this stream's dp_cp rank: dp_rank*cp_size + cp_rank
    num_ranks: int  # dp_size*cp_size
    token_budget: int
    rows_per_step: int


def check_cp_request(request, max_message_bytes: int) -> CPRequest | None:
    """Check the CP fields of a StreamRequest; ValueError (the message is for the user) when
    they cannot be served. None without dynamic_cp."""
    cp_size = request.cp_size or 1
    if request.cp_rank >= cp_size:
        raise ValueError(f"cp_rank is {request.cp_rank} but cp_size is {cp_size}; cp_rank must be in [0, {cp_size - 1}]")
    per_micro_step = request.micro_batch_size * request.dp_size
    if request.rows_per_step and request.rows_per_step % per_micro_step:
        raise ValueError(
            f"rows_per_step is {request.rows_per_step}; it must be a multiple of micro_batch_size x dp_size = "
            f"{request.micro_batch_size} x {request.dp_size} = {per_micro_step} (the global batch size of the "
            "same layout without dynamic CP)"
        )
    if not request.dynamic_cp:
        return None
    if not request.rows_per_step:
        raise ValueError("dynamic_cp needs rows_per_step (the rows of one global step, i.e. global_batch_size)")
    n = request.dp_size * cp_size
    need = min_token_budget(request.seq_len, n)
    if request.cp_token_budget < need:
        g = _largest_group(n)
        raise ValueError(
            f"cp_token_budget is {request.cp_token_budget}; a document piece can have seq_len={request.seq_len} tokens, "
            f"which over the largest CP group of {g} of the {n} dp x cp ranks needs {need} tokens per rank: "
            f"give cp_token_budget >= {need}"
        )
    # An entry holds at most g*budget tokens, and no more than the step's rows; each token costs
    # 12 bytes (tokens, labels, positions) and in the worst case is a document of its own
    # (cu_seqlens, seq_lens, hashes, index: 24 more).
    most = min(_largest_group(n) * request.cp_token_budget, request.rows_per_step * request.seq_len)
    worst = 36 * most + 8 * request.rows_per_step + 1024
    if worst > max_message_bytes:
        raise ValueError(
            f"cp_token_budget {request.cp_token_budget} over groups of up to {_largest_group(n)} ranks can need "
            f"{worst} bytes per message, over this server's max message size of {max_message_bytes} bytes "
            "(max_message_bytes); lower cp_token_budget"
        )
    return CPRequest(request.dp_rank * cp_size + request.cp_rank, n, int(request.cp_token_budget),
                     int(request.rows_per_step))


def _iota(lengths: np.ndarray) -> np.ndarray:
    """concat(arange(n) for n in lengths), vectorised."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)


def step_documents(batch: MicroBatch) -> np.ndarray:
    """Indices of the batch's non-padding segments (its documents), in row order.

    Padding is the segment a row ends with when it is not full: hash 0 and ending on a row
    boundary (a real document hashing to 0 would be mistaken for it with odds of 2**-64)."""
    cu = batch.cu_seqlens.astype(np.int64)
    pad = (batch.doc_hashes == 0) & (cu[1:] % batch.seq_len == 0)
    return np.flatnonzero(~pad)


@dataclass(frozen=True, eq=False)
class PlannedStep:
    """One global step: its documents back to back and its plan."""

    step: int
    row_ids: np.ndarray  # int64 [rows_per_step]
    tokens: np.ndarray  # int32, all documents of the step back to back
    labels: np.ndarray  # int32
    position_ids: np.ndarray  # int32
    doc_start: np.ndarray  # int64 [documents]: offset of each document in the arrays above
    doc_len: np.ndarray  # int64 [documents]
    doc_hashes: np.ndarray  # uint64 [documents]
    plan: StepPlan
    waves: list[int]  # plan.waves(), by entry index
    first_anchor: Anchor  # window holding the step's first row
    last_anchor: Anchor  # window holding the step's last row

    def gather(self, entry: MicroBatchPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The entry's documents in its order: (tokens, labels, position_ids, lengths)."""
        lens = self.doc_len[entry.docs]
        index = np.repeat(self.doc_start[entry.docs], lens) + _iota(lens)
        return self.tokens[index], self.labels[index], self.position_ids[index], lens


class StepCache:
    """Planned steps shared by all streams of a server, LRU, each built once (like plans)."""

    def __init__(self, cost: CostModel, size: int = _STEP_CACHE_SIZE, max_tokens: int | None = None) -> None:
        """At most `size` steps, and (beyond the newest) at most `max_tokens` tokens in all."""
        self.cost, self._size = cost, max(1, int(size))
        self._max_tokens = max_tokens
        self._steps: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, plan: StreamPlan, step: int, anchor: Anchor, cp: CPRequest) -> PlannedStep:
        """Step `step` under `cp`'s ranks and budget; `anchor` must start at or before its first row."""
        key = (plan.fingerprint, step, cp.rows_per_step, cp.num_ranks, cp.token_budget)
        mine = False
        with self._lock:
            fut = self._steps.get(key)
            if fut is None:
                fut, mine = Future(), True
                self._steps[key] = fut
                while len(self._steps) > self._size:
                    self._steps.popitem(last=False)
            else:
                self._steps.move_to_end(key)
        if mine:  # built outside the lock; other streams asking for the same step wait on the future
            try:
                fut.set_result(self._build(plan, step, anchor, cp))
            except BaseException as err:
                with self._lock:
                    if self._steps.get(key) is fut:
                        del self._steps[key]
                fut.set_exception(err)
            else:
                self._trim(key)
        return fut.result()

    def _trim(self, newest: tuple) -> None:
        """Evict the oldest built steps while all of them hold more than `max_tokens` tokens."""
        if self._max_tokens is None:
            return
        with self._lock:
            built = [(k, f.result().tokens.size) for k, f in self._steps.items() if f.done() and not f.exception()]
            total = sum(n for _, n in built)
            for k, n in built:
                if total <= self._max_tokens:
                    break
                if k != newest:
                    del self._steps[k]
                    total -= n

    def forget(self, plan_fingerprint: str) -> None:
        """Drop the cached steps of one plan (when no stream reads it any more)."""
        with self._lock:
            for key in [k for k in self._steps if k[0] == plan_fingerprint]:
                del self._steps[key]

    def _build(self, plan: StreamPlan, step: int, anchor: Anchor, cp: CPRequest) -> PlannedStep:
        first_row = step * cp.rows_per_step
        first_anchor = plan.seek(first_row, anchor)  # a pure function of the row: tokens stay reproducible
        rows = np.arange(first_row, first_row + cp.rows_per_step, dtype=np.int64)
        batch, last_anchor = plan.rows(rows, first_anchor)
        seg = step_documents(batch)
        cu = batch.cu_seqlens.astype(np.int64)
        start, length = cu[seg], cu[seg + 1] - cu[seg]
        real = np.repeat(start, length) + _iota(length)
        tokens, labels, positions = batch.tokens[real], batch.labels[real], batch.position_ids[real]
        step_plan = plan_cp_step(length, cp.num_ranks, cp.token_budget, self.cost)
        return PlannedStep(step, rows, tokens, labels, positions, np.cumsum(length) - length, length,
                           batch.doc_hashes[seg], step_plan, step_plan.waves(), first_anchor, last_anchor)


def _raw(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def cp_messages(planned: PlannedStep, cp: CPRequest, seq_len: int, again: str, done: str) -> Iterable:
    """The PackedBatch messages of one rank for one planned step (see the .proto)."""
    entries = planned.plan.for_rank(cp.index)
    waves = planned.waves
    common = dict(step=planned.step, micro_batch_size=1, seq_len=seq_len, row_ids=_raw(planned.row_ids, "<i8"),
                  cp_microbatches_in_step=len(entries), cp_step_microbatches=len(planned.plan.microbatches),
                  cp_step_documents=int(planned.doc_len.size), cp_step_waves=max(waves, default=-1) + 1)
    if not entries:
        yield pb2.PackedBatch(resume_token=done, efficiency=1.0, cp_group_size=0, **common)
        return
    for k, entry in enumerate(entries):
        tokens, labels, positions, lens = planned.gather(entry)
        cu = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        padded = entry.tokens_per_rank * entry.group_size
        yield pb2.PackedBatch(
            tokens=_raw(tokens, "<i4"),
            labels=_raw(labels, "<i4"),
            position_ids=_raw(positions, "<i4"),
            cu_seqlens=_raw(cu, "<i4"),
            seq_lens=_raw(lens, "<i4"),
            doc_hashes=_raw(planned.doc_hashes[entry.docs], "<u8"),
            num_tokens=int(tokens.size),
            efficiency=float(tokens.size / padded) if padded else 1.0,
            resume_token=done if k == len(entries) - 1 else again,
            cp_group_start=entry.group_start,
            cp_group_size=entry.group_size,
            cp_microbatch=entry.index,
            cp_entry=k,
            cp_documents=_raw(entry.docs, "<i4"),
            cp_tokens_per_rank=int(entry.tokens_per_rank),
            cp_wave=waves[entry.index],
            **common,
        )
