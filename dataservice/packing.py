"""Packing documents into fixed-length rows, and building the arrays of a packed micro-batch.

Documents are never truncated: a document longer than the row length is split into pieces
of at most ``seq_len`` tokens (full pieces first, the remainder last), and every piece is
placed in exactly one row by best-fit-decreasing (BFD). Over a window of a few hundred rows
BFD leaves only the last few rows poorly filled, which is where the >= 99% efficiency comes
from. Everything here is pure numpy plus one Python step per piece (never per token).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataservice.sampling import stable_permutation

__all__ = [
    "split_pieces",
    "best_fit_decreasing",
    "PackedRows",
    "pack_rows",
    "MicroBatch",
    "build_microbatch",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100  # label of tokens the loss must skip (padding, document ends)


def _segment_iota(lengths: np.ndarray) -> np.ndarray:
    """concat(arange(n) for n in lengths), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def split_pieces(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split items into pieces of at most `seq_len` tokens, covering every token exactly once.

    Returns (item index, token offset in the item, piece length) per piece, int64, in item
    order and ascending offset within an item.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.min()) < 1:
        raise ValueError(f"item lengths must be >= 1; got a minimum of {int(lengths.min())}")
    counts = (lengths + seq_len - 1) // seq_len
    item = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    offset = _segment_iota(counts) * seq_len
    piece_len = np.minimum(lengths[item] - offset, seq_len)
    return item, offset, piece_len


def best_fit_decreasing(piece_lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Assign pieces to rows of `capacity` tokens by best-fit-decreasing.

    Pieces are taken longest first (ties in index order); each goes to the open row with the
    least remaining capacity that still holds it, or opens a new row. Open rows are kept in
    buckets by remaining capacity with a sorted list of the non-empty capacities, so finding
    the best row is one bisect, not a scan of the rows.
    Returns (row index per piece, number of rows); rows are numbered in opening order.
    """
    lengths = np.asarray(piece_lengths, dtype=np.int64)
    n = lengths.size
    if n == 0:
        return np.empty(0, dtype=np.int64), 0
    if int(lengths.min()) < 1 or int(lengths.max()) > capacity:
        raise ValueError(
            f"piece lengths must be within [1, {capacity}]; got [{int(lengths.min())}, {int(lengths.max())}]"
        )
    order = np.argsort(-lengths, kind="stable")
    sorted_len = lengths[order].tolist()
    smallest = sorted_len[-1]
    caps: list[int] = []  # sorted distinct remaining capacities that have an open row
    rows_at: dict[int, list[int]] = {}
    placed: list[int] = []
    n_rows = 0
    for ln in sorted_len:
        k = bisect_left(caps, ln)
        if k == len(caps):
            row, rem = n_rows, capacity - ln
            n_rows += 1
        else:
            cap = caps[k]
            bucket = rows_at[cap]
            row = bucket.pop()
            if not bucket:
                del caps[k]
                del rows_at[cap]
            rem = cap - ln
        placed.append(row)
        # A row whose room is below the smallest piece can never be used again: close it.
        if rem >= smallest:
            bucket = rows_at.get(rem)
            if bucket is None:
                insort(caps, rem)
                rows_at[rem] = [row]
            else:
                bucket.append(row)
    row_of = np.empty(n, dtype=np.int64)
    row_of[order] = np.asarray(placed, dtype=np.int64)
    return row_of, n_rows


class RowStats:
    """Counts shared by every rows-of-segments layout (`row_ptr`, `seg_len`, `seq_len`)."""

    @property
    def num_rows(self) -> int:
        return int(self.row_ptr.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.seg_len.sum())

    @property
    def efficiency(self) -> float:
        """Real tokens / (rows * seq_len); 1.0 for an empty window."""
        return self.num_tokens / (self.num_rows * self.seq_len) if self.num_rows else 1.0


@dataclass(frozen=True, eq=False)
class PackedRows(RowStats):
    """Rows of one window: segment s is tokens [seg_offset, seg_offset+seg_len) of item seg_item.

    Segments of row r are ``row_ptr[r]:row_ptr[r+1]``, in placement order.
    """

    seg_item: np.ndarray  # int64 [segments]
    seg_offset: np.ndarray  # int64 [segments]
    seg_len: np.ndarray  # int64 [segments]
    row_ptr: np.ndarray  # int64 [rows + 1]
    seq_len: int



def pack_rows(item_lengths: np.ndarray, seq_len: int, row_key: Sequence[int] | None = None) -> PackedRows:
    """Split items into pieces, BFD-pack them into rows of `seq_len`, then shuffle the rows.

    The row shuffle (a `stable_permutation` of `row_key`; None keeps opening order) keeps the
    row order from being sorted by size (BFD opens rows longest piece first).
    """
    item, offset, plen = split_pieces(item_lengths, seq_len)
    row_of, n_rows = best_fit_decreasing(plen, seq_len)
    # Placement rank: BFD placed pieces in stable descending-length order.
    rank = np.empty(plen.size, dtype=np.int64)
    rank[np.argsort(-plen, kind="stable")] = np.arange(plen.size, dtype=np.int64)
    if row_key is not None:
        new_of_old = np.empty(n_rows, dtype=np.int64)
        new_of_old[stable_permutation(row_key, n_rows)] = np.arange(n_rows, dtype=np.int64)
        row_of = new_of_old[row_of]
    order = np.lexsort((rank, row_of))
    row_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=n_rows), out=row_ptr[1:])
    return PackedRows(item[order], offset[order], plen[order], row_ptr, seq_len)


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """B packed rows of S tokens, flattened to B*S (see protos/dataservice.proto, PackedBatch).

    Labels: the next token of the same document, IGNORE_INDEX at padding, at each
    document's last token and before every token that is not a target (a fine-tuning
    example's prompt, system text and template markers). A document split over rows keeps the true next token at the end of
    a non-final piece (same document, so nothing leaks across a boundary); position ids
    restart at 0 at every piece because attention never spans pieces.
    """

    tokens: np.ndarray  # int32 [B*S], pad_id at padding
    labels: np.ndarray  # int32 [B*S]
    position_ids: np.ndarray  # int32 [B*S]
    cu_seqlens: np.ndarray  # int32 [segments + 1]; padding at a row's end is its own segment
    seq_lens: np.ndarray  # int32 [segments]
    doc_hashes: np.ndarray  # uint64 [segments], 0 for padding
    row_ids: np.ndarray  # int64 [B]
    num_tokens: int  # non-padding tokens
    efficiency: float  # num_tokens / (B*S)
    seq_len: int


def build_microbatch(
    real: np.ndarray,
    seg_row: np.ndarray,
    seg_len: np.ndarray,
    seg_next: np.ndarray,
    seg_hash: np.ndarray,
    row_ids: np.ndarray,
    seq_len: int,
    pad_id: int,
    target: np.ndarray | None = None,
) -> MicroBatch:
    """Lay segments out into a MicroBatch, vectorised over tokens.

    `real` holds the tokens of all segments back to back in segment order; segment s has
    ``seg_len[s]`` tokens and goes to batch row ``seg_row[s]`` (non-decreasing; a row's
    segments in their order). ``seg_next[s]`` is the label of its last token: the document's
    next token for a non-final piece, IGNORE_INDEX where the segment ends its document (or
    the next token is not a target). `target` (bool, like `real`; None: all True) says which
    tokens the loss trains on: a token that is not a target is no position's label.
    """
    S = int(seq_len)
    B = int(len(row_ids))
    real = np.asarray(real, dtype=np.int32)
    seg_row = np.asarray(seg_row, dtype=np.int64)
    seg_len = np.asarray(seg_len, dtype=np.int64)
    if seg_row.size and bool(np.any(np.diff(seg_row) < 0)):
        raise ValueError("segments must be grouped by row in ascending row order")
    if seg_row.size and (int(seg_row[0]) < 0 or int(seg_row[-1]) >= B):
        raise ValueError(f"segment rows must be within [0, {B})")
    if seg_len.size and int(seg_len.min()) < 1:
        raise ValueError("segment lengths must be >= 1")
    total = int(seg_len.sum())
    if real.size != total:
        raise ValueError(f"{real.size} tokens given for segments of {total} tokens")
    n_real = np.bincount(seg_row, minlength=B)
    fill = np.bincount(seg_row, weights=seg_len, minlength=B).astype(np.int64)
    if B and int(fill.max()) > S:
        raise ValueError(f"a row holds {int(fill.max())} tokens, more than seq_len={S}")

    ends = np.cumsum(seg_len)  # exclusive end of each segment in `real`
    # Labels: the next token inside a segment; the segment's own `seg_next` at its end.
    lab = np.empty(total, dtype=np.int32)
    lab[:-1] = real[1:]
    if target is not None:
        target = np.asarray(target, dtype=bool)
        if target.size != total:
            raise ValueError(f"{target.size} target flags given for {total} tokens")
        lab[:-1][~target[1:]] = IGNORE_INDEX
    lab[ends - 1] = seg_next
    # Positions restart at each segment: a running count that drops back at segment starts.
    step = np.ones(total, dtype=np.int32)
    step[ends[:-1]] = 1 - seg_len[:-1]
    if total:
        step[0] = 0
    pos = np.cumsum(step, dtype=np.int32)

    tokens = np.full((B, S), pad_id, dtype=np.int32)
    labels = np.full((B, S), IGNORE_INDEX, dtype=np.int32)
    position_ids = np.zeros((B, S), dtype=np.int32)
    row_end = np.cumsum(fill).tolist()
    lo = 0
    for r, hi in enumerate(row_end):  # one slice copy per row, real tokens first, padding after
        n = hi - lo
        tokens[r, :n] = real[lo:hi]
        labels[r, :n] = lab[lo:hi]
        position_ids[r, :n] = pos[lo:hi]
        lo = hi

    # Segments: each row's real segments, then its padding (if any) as one more segment.
    pad = S - fill
    has_pad = pad > 0
    per_row = n_real + has_pad
    seg_base = np.cumsum(per_row) - per_row
    real_base = np.cumsum(n_real) - n_real
    real_pos = seg_base[seg_row] + (np.arange(seg_row.size, dtype=np.int64) - real_base[seg_row])
    total_segs = int(per_row.sum())
    seq_lens = np.zeros(total_segs, dtype=np.int32)
    doc_hashes = np.zeros(total_segs, dtype=np.uint64)
    seq_lens[real_pos] = seg_len
    doc_hashes[real_pos] = seg_hash
    seq_lens[seg_base[has_pad] + n_real[has_pad]] = pad[has_pad]
    cu_seqlens = np.zeros(total_segs + 1, dtype=np.int32)
    np.cumsum(seq_lens, out=cu_seqlens[1:])

    return MicroBatch(
        tokens=tokens.reshape(-1),
        labels=labels.reshape(-1),
        position_ids=position_ids.reshape(-1),
        cu_seqlens=cu_seqlens,
        seq_lens=seq_lens,
        doc_hashes=doc_hashes,
        row_ids=np.asarray(row_ids, dtype=np.int64),
        num_tokens=total,
        efficiency=total / (B * S) if B else 1.0,
        seq_len=S,
    )
