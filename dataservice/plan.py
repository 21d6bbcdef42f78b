"""The global packed-row stream of a blend: a pure function of (datasets, weights, seed, seq_len).

Rows are addressed by a global index 0, 1, 2, ... that does not depend on the data-parallel
size or the micro-batch size. The stream is cut into windows (see dataservice.sampling for
the blending, dataservice.packing for the packing). Where window w starts depends on the
windows before it, so it is named by an `Anchor`: (window index, first global row, per-dataset
stream positions, per-dataset carries) -- small, JSON-safe, and what a resume token holds.

Rows of window w: blend documents by token quota, shuffle them with rng(seed, w), split long
documents, best-fit-decreasing pack, shuffle the rows with rng(seed, w, 1).
"""

from __future__ import annotations

import json
import threading
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from dataservice.packing import IGNORE_INDEX, MicroBatch, RowStats, build_microbatch, pack_rows
from dataservice.sampling import DocumentStream, blend_window, normalise_weights, stable_permutation, window_quotas

__all__ = [
    "ALGORITHM_VERSION", "MAX_SEQ_LEN", "Anchor", "PackedWindow", "ScanCancelled", "ScanLimitError", "StreamPlan",
    "rows_for", "default_window_tokens",
]

ALGORITHM_VERSION = 2  # bump on any change that alters the row stream (2: NumPy-independent shuffles)
MAX_SEQ_LEN = 1 << 20
WINDOW_ROWS = 256  # measured: BFD wastes about one row per window, so 256 rows fill >= 99.6%
MIN_WINDOW_TOKENS = 1 << 21  # short rows: more rows per window costs little (~1 ms per 2M tokens)


def default_window_tokens(seq_len: int) -> int:
    """Token budget of a window when none is given: 256 rows, and at least 2M tokens."""
    return max(WINDOW_ROWS * seq_len, MIN_WINDOW_TOKENS)


def rows_for(step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> np.ndarray:
    """Global rows of `dp_rank` at micro-step `step`: step*B*n + dp_rank + j*n for j < B.

    Ranks interleave so the rows of one step are a contiguous range whatever the split.
    """
    for name, v, lo in (("step", step, 0), ("dp_rank", dp_rank, 0), ("dp_size", dp_size, 1),
                        ("micro_batch_size", micro_batch_size, 1)):
        if int(v) != v or v < lo:
            raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be < dp_size={dp_size}")
    n, B = int(dp_size), int(micro_batch_size)
    return int(step) * B * n + int(dp_rank) + np.arange(B, dtype=np.int64) * n


class ScanLimitError(RuntimeError):
    """A seek would build more windows than its caller allows (the server's RESOURCE_EXHAUSTED)."""


class ScanCancelled(RuntimeError):
    """A seek stopped because its caller no longer wants the answer (a cancelled stream)."""


@dataclass(frozen=True)
class Anchor:
    """Where a window starts: its index, its first global row, and each dataset's stream state."""

    window: int
    first_row: int
    positions: tuple[int, ...]
    carries: tuple[int, ...]  # tokens taken beyond the cumulative quota, >= 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (ints and lists only)."""
        return {
            "window": self.window, "first_row": self.first_row,
            "positions": list(self.positions), "carries": list(self.carries),
        }

    @classmethod
    def from_dict(cls, d: Any, num_datasets: int | None = None) -> Anchor:
        """Parse and validate `to_dict` output; ValueError says which field is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"anchor must be a dict, got {type(d).__name__}")
        try:
            window, first_row, positions, carries = d["window"], d["first_row"], d["positions"], d["carries"]
        except KeyError as e:
            raise ValueError(f"anchor is missing field {e.args[0]!r}") from None

        def ok(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        if not ok(window) or not ok(first_row):
            raise ValueError(f"anchor window={window!r}, first_row={first_row!r} must be integers >= 0")
        if not isinstance(positions, list) or not isinstance(carries, list) or len(positions) != len(carries):
            raise ValueError("anchor positions and carries must be lists of equal length")
        if not all(ok(v) for v in positions + carries):
            raise ValueError(f"anchor positions {positions} and carries {carries} must be integers >= 0")
        if num_datasets is not None and len(positions) != num_datasets:
            raise ValueError(f"anchor has {len(positions)} dataset positions; this blend has {num_datasets} datasets")
        return cls(window, first_row, tuple(positions), tuple(carries))


@dataclass(frozen=True, eq=False)
class PackedWindow(RowStats):
    """The packed rows of one window; segments of local row r are row_ptr[r]:row_ptr[r+1]."""

    anchor: Anchor
    next_anchor: Anchor
    seg_dataset: np.ndarray  # int64 [segments]
    seg_doc: np.ndarray  # int64 [segments]
    seg_offset: np.ndarray  # int64 [segments], token offset of the piece in its document
    seg_len: np.ndarray  # int64 [segments]
    row_ptr: np.ndarray  # int64 [rows + 1]
    seq_len: int


def _check_int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ValueError(f"{name}={v!r} must be an integer in [{lo}, {hi}]")
    return int(v)


class StreamPlan:
    """The deterministic stream of packed rows over a blend of datasets.

    Thread-safe: windows are LRU-cached and a window asked for by several threads at once is
    built once. ValueError (the server's INVALID_ARGUMENT) for any bad argument.
    """

    _CHAIN_CAP = 4096  # anchors kept to speed up seek; the stride doubles when full

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], seed: int, seq_len: int,
                 window_tokens: int | None = None, cache_windows: int = 64, max_scan_windows: int | None = None):
        datasets = list(datasets)
        if not datasets:
            raise ValueError("no datasets given; a stream plan needs at least one dataset")
        if len(weights) != len(datasets):
            raise ValueError(
                f"{len(weights)} blend weights for {len(datasets)} datasets; give one weight per dataset"
            )
        self.weights = normalise_weights(weights)
        self.seed = _check_int("seed", seed, 0, (1 << 64) - 1)
        self.seq_len = _check_int("seq_len", seq_len, 2, MAX_SEQ_LEN)
        if window_tokens is None:
            window_tokens = default_window_tokens(self.seq_len)
        self.window_tokens = _check_int("window_tokens", window_tokens, self.seq_len, 1 << 40)
        first = datasets[0]
        for ds in datasets[1:]:
            for attr in ("vocab_size", "pad_id", "eos_id"):
                if getattr(ds, attr) != getattr(first, attr):
                    a, b = getattr(first, "name", "#0"), getattr(ds, "name", "?")
                    raise ValueError(
                        f"datasets {a!r} and {b!r} have different tokenizers ({attr} {getattr(first, attr)} "
                        f"vs {getattr(ds, attr)}); blended datasets must share one"
                    )
        self.datasets = datasets
        self.pad_id = int(first.pad_id)
        self.eos_id = int(first.eos_id)
        self._lengths = [np.asarray(ds.lengths) for ds in datasets]
        self._hashes = [np.asarray(ds.hashes, dtype=np.uint64) for ds in datasets]
        for ds, ln in zip(datasets, self._lengths):
            if ln.size and int(ln.min()) < 1:
                name = getattr(ds, "name", "?")
                raise ValueError(f"dataset {name!r} has an empty document; lengths must be >= 1")
        self._streams = [DocumentStream(ln, ds.fingerprint, self.seed) for ds, ln in zip(datasets, self._lengths)]
        self._shares = [w * self.window_tokens for w in self.weights]
        fps = [str(ds.fingerprint) for ds in datasets]
        ident = [ALGORITHM_VERSION, fps, list(self.weights), self.seed, self.seq_len, self.window_tokens]
        self.fingerprint: str = xxhash.xxh3_128_hexdigest(json.dumps(ident).encode())

        self._cache_size = max(1, int(cache_windows))
        # Every seek's bound, also those inside `rows`: windows of a forged anchor may hold no rows.
        self.max_scan_windows = max_scan_windows
        self._cache: OrderedDict[Anchor, Future] = OrderedDict()
        self._lock = threading.Lock()
        # Anchors known to lie on the chain from start_anchor: every `_stride`-th window, plus recent ones.
        # Kept sorted by window; first rows are then non-decreasing too, so a bisect finds the best.
        self._chain: list[Anchor] = [self.start_anchor()]
        self._chain_windows: list[int] = [0]
        self._chain_rows: list[int] = [0]
        self._stride = 16
        self._recent: OrderedDict[Anchor, None] = OrderedDict({self.start_anchor(): None})

    def start_anchor(self) -> Anchor:
        """Anchor of window 0."""
        k = len(self.datasets)
        return Anchor(0, 0, (0,) * k, (0,) * k)

    def _check_anchor(self, anchor: Anchor) -> None:
        if not isinstance(anchor, Anchor):
            raise ValueError(f"expected an Anchor, got {type(anchor).__name__}")
        if len(anchor.positions) != len(self.datasets) or len(anchor.carries) != len(self.datasets):
            raise ValueError(f"anchor is for {len(anchor.positions)} datasets; this plan has {len(self.datasets)}")

    def window(self, anchor: Anchor) -> PackedWindow:
        """The packed rows of the window that `anchor` starts (a pure function of it; cached)."""
        self._check_anchor(anchor)
        mine = False
        with self._lock:
            fut = self._cache.get(anchor)
            if fut is not None:
                self._cache.move_to_end(anchor)
            else:
                fut, mine = Future(), True
                self._cache[anchor] = fut
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if mine:  # built outside the lock; other threads asking for it wait on the future
            try:
                fut.set_result(self._build_window(anchor))
            except BaseException as e:
                with self._lock:  # do not cache a failure
                    if self._cache.get(anchor) is fut:
                        del self._cache[anchor]
                fut.set_exception(e)
        return fut.result()

    def release_windows(self) -> None:
        """Drop the cached windows (rebuilt on demand): what a plan no stream reads should not keep."""
        with self._lock:
            self._cache.clear()

    def _build_window(self, anchor: Anchor) -> PackedWindow:
        w = anchor.window
        quotas = window_quotas(self._shares, w)
        docs, positions, carries = blend_window(self._streams, anchor.positions, anchor.carries, quotas)
        item_ds = np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d in docs])
        item_doc = np.concatenate(docs)
        item_len = np.concatenate([ln[d] for ln, d in zip(self._lengths, docs)]).astype(np.int64)
        mix = stable_permutation([self.seed, w], item_doc.size)
        item_ds, item_doc, item_len = item_ds[mix], item_doc[mix], item_len[mix]
        rows = pack_rows(item_len, self.seq_len, [self.seed, w, 1])
        nxt = Anchor(w + 1, anchor.first_row + rows.num_rows, positions, carries)
        return PackedWindow(anchor, nxt, item_ds[rows.seg_item], item_doc[rows.seg_item], rows.seg_offset,
                            rows.seg_len, rows.row_ptr, self.seq_len)

    def next_anchor(self, anchor: Anchor) -> Anchor:
        """Anchor of the window after `anchor`'s."""
        nxt = self.window(anchor).next_anchor
        with self._lock:
            if anchor in self._recent:
                self._recent[nxt] = None
                while len(self._recent) > 256:
                    self._recent.popitem(last=False)
                if nxt.window % self._stride == 0:
                    self._remember(nxt)
        return nxt

    def _remember(self, anchor: Anchor) -> None:
        """Add an anchor known to be on the chain from the start to the seek index (lock held)."""
        k = bisect_left(self._chain_windows, anchor.window)
        if k < len(self._chain) and self._chain_windows[k] == anchor.window:
            return
        self._chain.insert(k, anchor)
        if len(self._chain) > self._CHAIN_CAP:  # keep every other stride: bounded memory, longer scans
            self._stride *= 2
            self._chain = [a for a in self._chain if a.window % self._stride == 0]
        self._chain_windows = [a.window for a in self._chain]
        self._chain_rows = [a.first_row for a in self._chain]

    def seek(self, row: int, anchor: Anchor | None = None, *, max_windows: int | None = None,
             active: Callable[[], bool] | None = None) -> Anchor:
        """Anchor of the window holding global row `row`, scanning forward from `anchor` (or the start).

        Raises ValueError if `anchor` starts after `row`. Known anchors on the chain from the
        start let a scan skip ahead; that gives the same answer, only sooner. A scan that would
        build more than `max_windows` windows (default: the plan's `max_scan_windows`) raises ScanLimitError; one whose `active()` turns
        False raises ScanCancelled (both checked once per window).
        """
        row = _check_int("row", row, 0, 1 << 62)
        if anchor is None:
            anchor = self.start_anchor()
        self._check_anchor(anchor)
        if anchor.first_row > row:
            raise ValueError(f"anchor of window {anchor.window} starts at row {anchor.first_row}, after row {row}")
        if row < self.window(anchor).next_anchor.first_row:
            return anchor  # the common case: the row is in the anchor's own window
        with self._lock:
            k = bisect_left(self._chain_windows, anchor.window)
            on_chain = anchor in self._recent or (k < len(self._chain) and self._chain[k] == anchor)
            if on_chain:
                best = bisect_right(self._chain_rows, row) - 1
                if best >= 0 and self._chain[best].window > anchor.window:
                    anchor = self._chain[best]
                self._recent[anchor] = None
                self._recent.move_to_end(anchor)
        scanned = 0
        if max_windows is None:
            max_windows = self.max_scan_windows
        while True:
            win = self.window(anchor)
            if row < win.next_anchor.first_row:
                return anchor
            scanned += 1
            if max_windows is not None and scanned > max_windows:
                raise ScanLimitError(
                    f"row {row} lies more than {max_windows} windows after window {anchor.window - scanned + 1} "
                    f"(max_scan_windows); a genuine resume token lands within a few windows of its anchor"
                )
            if active is not None and not active():
                raise ScanCancelled(f"seek to row {row} cancelled at window {anchor.window}")
            anchor = self.next_anchor(anchor)

    def rows(self, row_ids: Sequence[int], anchor: Anchor) -> tuple[MicroBatch, Anchor]:
        """Materialise global rows `row_ids` (ascending, all >= anchor.first_row) as a MicroBatch.

        Returns the batch and the anchor of the window holding the last row (to continue from).
        Tokens are read with one `read_many` per dataset.
        """
        ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("row_ids is empty; ask for at least one row")
        if bool(np.any(np.diff(ids) < 0)):
            raise ValueError("row_ids must be in ascending order")
        self._check_anchor(anchor)
        if int(ids[0]) < anchor.first_row:
            raise ValueError(f"row {int(ids[0])} is before the anchor's first row {anchor.first_row}")
        seg_row, seg_ds, seg_doc, seg_off, seg_len, anchor = self._segments(ids, anchor)
        real, seg_next, seg_hash, target = self._read_segments(seg_ds, seg_doc, seg_off, seg_len)
        batch = build_microbatch(real, seg_row, seg_len, seg_next, seg_hash, ids, self.seq_len, self.pad_id,
                                 target=target)
        return batch, anchor

    def row_segments(self, row: int, anchor: Anchor | None = None) -> tuple[np.ndarray, ...]:
        """Where global row `row`'s segments come from, in row order: (dataset index, document,
        token offset in the document, length), int64 arrays (padding is not a segment)."""
        ids = np.array([_check_int("row", row, 0, 1 << 62)], dtype=np.int64)
        _, seg_ds, seg_doc, seg_off, seg_len, _ = self._segments(ids, self.seek(row, anchor))
        return seg_ds, seg_doc, seg_off, seg_len

    def _segments(self, ids: np.ndarray, anchor: Anchor):
        """Segment tables of rows `ids` (batch row, dataset, document, offset, length), window by window."""
        parts: list[tuple[np.ndarray, ...]] = []
        i = 0
        while i < ids.size:
            anchor = self.seek(int(ids[i]), anchor)
            win = self.window(anchor)
            j = int(np.searchsorted(ids, win.next_anchor.first_row, side="left"))
            local = ids[i:j] - anchor.first_row
            starts = win.row_ptr[local]
            counts = win.row_ptr[local + 1] - starts
            # Segment indices of these rows: each row's range starts..starts+count, concatenated.
            seg = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
            rows = np.repeat(np.arange(i, j, dtype=np.int64), counts)
            parts.append((rows, win.seg_dataset[seg], win.seg_doc[seg], win.seg_offset[seg], win.seg_len[seg]))
            i = j
        cols = [np.concatenate(c) for c in zip(*parts)]
        return (*cols, anchor)

    def _read_segments(self, seg_ds, seg_doc, seg_off, seg_len):
        """Tokens of the segments back to back (int32), the label after each segment, its document
        hash, and which tokens are targets (None: all, when no dataset holds fine-tuning examples)."""
        n = seg_doc.size
        seg_hash = np.empty(n, dtype=np.uint64)
        spans: list[Any] = [None] * n  # each segment's tokens plus, if any, the next one
        masks: list[Any] = [None] * n  # the same span's target mask, for datasets that have one
        ends = np.empty(n, dtype=np.int64)
        for d, ds in enumerate(self.datasets):
            where = np.flatnonzero(seg_ds == d)
            if where.size == 0:
                continue
            docs = seg_doc[where]
            doc_len = self._lengths[d][docs].astype(np.int64)
            ends[where] = doc_len
            stops = np.minimum(seg_off[where] + seg_len[where] + 1, doc_len)
            got = ds.read_spans(docs, seg_off[where], stops)
            for k, toks in zip(where.tolist(), got):
                spans[k] = toks
            if getattr(ds, "has_loss_mask", False):  # stand-ins that only know lengths have none
                for k, mask in zip(where.tolist(), ds.target_masks(docs, seg_off[where], stops)):
                    masks[k] = mask
            seg_hash[where] = self._hashes[d][docs]
        pieces, seg_next = [], np.full(n, IGNORE_INDEX, dtype=np.int64)
        any_mask = any(m is not None for m in masks)
        targets = []
        for k, (t, o, ln, end) in enumerate(zip(spans, seg_off.tolist(), seg_len.tolist(), ends.tolist())):
            if len(t) < ln:
                raise RuntimeError(f"a document piece came back with {len(t)} of its {ln} tokens")
            pieces.append(t[:ln])
            mask = masks[k]
            if any_mask:
                targets.append(mask[:ln] if mask is not None else np.ones(ln, bool))
            # A non-final piece: its last label is the document's next token, if that is a target.
            if o + ln < end and (mask is None or mask[ln]):
                seg_next[k] = t[ln]
        real = np.concatenate(pieces, dtype=np.int32, casting="unsafe") if pieces else np.empty(0, np.int32)
        target = np.concatenate(targets) if any_mask else None
        return real, seg_next, seg_hash, target
