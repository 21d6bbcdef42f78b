"""Packing: splitting without truncation, best-fit-decreasing, fill rate, micro-batch layout.

References: a naive O(pieces * rows) BFD written here for the row fills, and hand-built
expected arrays for the micro-batch layout.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from dataservice.packing import IGNORE_INDEX, best_fit_decreasing, build_microbatch, pack_rows, split_pieces
from dataservice.plan import default_window_tokens


def realistic_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Long-tail document lengths: lognormal, median ~600 tokens, clipped to [2, 50000]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(np.exp(rng.normal(np.log(600), 1.3, n))), 2, 50_000).astype(np.int64)


def naive_bfd_fills(lengths: np.ndarray, capacity: int) -> list[int]:
    """Reference BFD: scan every row for the tightest fit, longest piece first."""
    rows: list[int] = []
    for ln in sorted(lengths.tolist(), reverse=True):
        best, best_rem = -1, capacity + 1
        for r, used in enumerate(rows):
            rem = capacity - used
            if ln <= rem < best_rem:
                best, best_rem = r, rem
        if best < 0:
            rows.append(ln)
        else:
            rows[best] += ln
    return sorted(rows)


def test_split_pieces_covers_every_token_once():
    rng = np.random.default_rng(1)
    seq_len = 100
    lengths = np.concatenate([rng.integers(1, 1000, 500), [1, 99, 100, 101, 200, 201]])
    item, offset, plen = split_pieces(lengths, seq_len)
    assert plen.min() >= 1 and plen.max() <= seq_len
    # Per item: offsets are 0, S, 2S, ... and the pieces add up to the item: no token lost or repeated.
    for i, ln in enumerate(lengths.tolist()):
        m = item == i
        assert offset[m].tolist() == list(range(0, ln, seq_len))
        assert int(plen[m].sum()) == ln
    assert len(plen) == int(((lengths + seq_len - 1) // seq_len).sum())
    with pytest.raises(ValueError, match=">= 1"):
        split_pieces(np.array([3, 0]), seq_len)


@pytest.mark.parametrize("capacity", [16, 64, 1000])
def test_bfd_places_each_piece_once_and_matches_reference(capacity):
    rng = np.random.default_rng(capacity)
    lengths = rng.integers(1, capacity + 1, 400)
    row_of, n_rows = best_fit_decreasing(lengths, capacity)
    assert row_of.shape == lengths.shape and row_of.min() >= 0 and row_of.max() == n_rows - 1
    fills = np.bincount(row_of, weights=lengths, minlength=n_rows).astype(np.int64)
    assert fills.max() <= capacity and fills.min() >= 1  # never over capacity, no empty row
    # Rows with equal room are interchangeable, so the fills equal the naive BFD's whatever the tie rule.
    assert sorted(fills.tolist()) == naive_bfd_fills(lengths, capacity)
    assert n_rows >= int(np.ceil(lengths.sum() / capacity))
    with pytest.raises(ValueError, match="within"):
        best_fit_decreasing(np.array([capacity + 1]), capacity)


def test_bfd_is_fast():
    lengths = np.minimum(realistic_lengths(200_000, seed=3), 8192)
    t0 = time.perf_counter()
    row_of, n_rows = best_fit_decreasing(lengths, 8192)
    dt = time.perf_counter() - t0
    print(f"\nBFD: {lengths.size} pieces into {n_rows} rows in {dt * 1e3:.0f} ms "
          f"({dt / lengths.size * 1e6:.2f} us/piece)")
    assert np.bincount(row_of, weights=lengths).max() <= 8192
    assert dt < 5.0


def test_pack_rows_coverage_and_row_shuffle():
    lengths = realistic_lengths(3000, seed=5)
    a = pack_rows(lengths, 4096, [0])
    b = pack_rows(lengths, 4096, None)
    item, offset, _ = split_pieces(lengths, 4096)
    # Every (item, offset) piece appears exactly once after packing.
    got = sorted(zip(a.seg_item.tolist(), a.seg_offset.tolist()))
    assert got == sorted(zip(item.tolist(), offset.tolist()))
    fills = np.add.reduceat(a.seg_len, a.row_ptr[:-1])
    assert fills.max() <= 4096 and a.num_rows == b.num_rows and a.num_tokens == int(lengths.sum())
    # Unshuffled rows come out in opening order, i.e. fullest first; the shuffle breaks that.
    fills_b = np.add.reduceat(b.seg_len, b.row_ptr[:-1])
    assert not np.array_equal(fills, fills_b)
    assert sorted(fills.tolist()) == sorted(fills_b.tolist())


@pytest.mark.parametrize("seq_len", [4096, 8192])
def test_efficiency_on_long_tail_mix(seq_len):
    """Windows of the default budget, cut from a long-tail stream as the blender does: >= 99% full."""
    lengths = realistic_lengths(400_000, seed=seq_len)
    window_tokens = default_window_tokens(seq_len)
    cum = np.cumsum(lengths)
    start, real, slots, worst, n_windows = 0, 0, 0, 1.0, 24
    for w in range(n_windows):
        end = int(np.searchsorted(cum, (cum[start - 1] if start else 0) + window_tokens)) + 1
        rows = pack_rows(lengths[start:end], seq_len, [w])
        real += rows.num_tokens
        slots += rows.num_rows * seq_len
        worst = min(worst, rows.efficiency)
        start = end
    # A small window shows why the budget matters: one poorly filled row costs 1/rows.
    small = pack_rows(lengths[:40], seq_len).efficiency
    eff = real / slots
    print(f"\nseq_len={seq_len} window_tokens={window_tokens}: efficiency {eff:.4f} over {n_windows} windows, "
          f"worst window {worst:.4f}; a 40-document window: {small:.4f}")
    assert eff >= 0.99 and worst >= 0.99


def test_build_microbatch_layout_by_hand():
    # Row 0: segment A (3 tokens, ends its document), segment B (2 tokens, a non-final piece
    # whose document continues with token 77), then 1 padding. Row 1: segment C fills it.
    real = np.array([10, 11, 12, 20, 21, 30, 31, 32, 33, 34, 35], dtype=np.int32)
    mb = build_microbatch(
        real, seg_row=np.array([0, 0, 1]), seg_len=np.array([3, 2, 6]),
        seg_next=np.array([IGNORE_INDEX, 77, IGNORE_INDEX]), seg_hash=np.array([5, 6, 7], dtype=np.uint64),
        row_ids=np.array([40, 41]), seq_len=6, pad_id=0,
    )
    X = IGNORE_INDEX
    assert mb.tokens.tolist() == [10, 11, 12, 20, 21, 0, 30, 31, 32, 33, 34, 35]
    assert mb.labels.tolist() == [11, 12, X, 21, 77, X, 31, 32, 33, 34, 35, X]
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 6, 12]
    assert mb.seq_lens.tolist() == [3, 2, 1, 6]
    assert mb.doc_hashes.tolist() == [5, 6, 0, 7]
    assert mb.row_ids.tolist() == [40, 41] and mb.num_tokens == 11
    assert mb.efficiency == pytest.approx(11 / 12)
    assert all(a.dtype == np.int32 for a in (mb.tokens, mb.labels, mb.position_ids, mb.cu_seqlens, mb.seq_lens))


def test_build_microbatch_rejects_overfull_row_and_empty_row_is_padding():
    with pytest.raises(ValueError, match="more than seq_len"):
        build_microbatch(np.arange(7), np.array([0]), np.array([7]), np.array([IGNORE_INDEX]),
                         np.array([1], dtype=np.uint64), np.array([0]), seq_len=6, pad_id=0)
    mb = build_microbatch(np.arange(2), np.array([1]), np.array([2]), np.array([IGNORE_INDEX]),
                          np.array([1], dtype=np.uint64), np.array([0, 1]), seq_len=4, pad_id=9)
    assert mb.tokens.tolist() == [9, 9, 9, 9, 0, 1, 9, 9]
    assert mb.cu_seqlens.tolist() == [0, 4, 6, 8] and mb.doc_hashes.tolist() == [0, 1, 0]
