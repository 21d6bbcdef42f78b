"""The global row stream: sampling, blending, anchors, DP sharding, and StreamPlan over real datasets.

Pure parts use `LengthsOnly`, an in-memory stand-in with ShardedDataset's attributes; the
integration tests build real LMDB datasets with dataservice.build in a tmp dir and check
every materialised token against the documents read back one by one.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import xxhash

from dataservice.build import build_dataset, make_corpus
from dataservice.packing import IGNORE_INDEX, pack_rows, split_pieces
from dataservice.plan import Anchor, StreamPlan, rows_for
from dataservice.sampling import (
    DocumentStream, blend_window, epoch_permutation, normalise_weights, stable_permutation, window_quotas,
)
from dataservice.shards import ShardedDataset


class LengthsOnly:
    """In-memory stand-in for ShardedDataset: random tokens, long-tail lengths, eos at each end."""

    def __init__(self, name: str, n: int, seed: int, median: float = 600, vocab: int = 1000,
                 pad: int = 0, eos: int = 1):
        rng = np.random.default_rng(seed)
        self.name, self.vocab_size, self.pad_id, self.eos_id = name, vocab, pad, eos
        self.lengths = np.clip(np.round(np.exp(rng.normal(np.log(median), 1.3, n))), 2, 50_000).astype(np.uint32)
        self.num_documents = n
        self._off = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        self.num_tokens = int(self._off[-1])
        self._flat = rng.integers(2, vocab, self.num_tokens).astype(np.uint16)
        self._flat[self._off[1:] - 1] = eos
        docs = self.read_many(range(n))
        self.hashes = np.array([xxhash.xxh3_64_intdigest(t.tobytes()) for t in docs], dtype=np.uint64)
        self.fingerprint = xxhash.xxh3_128_hexdigest(f"{name}-{seed}".encode())

    def read_many(self, docs):
        return [self._flat[self._off[d] : self._off[d + 1]].copy() for d in np.asarray(docs, dtype=np.int64).tolist()]

    def read_spans(self, docs, starts, stops):
        return [self._flat[self._off[d] + a : self._off[d] + b].copy()
                for d, a, b in zip(np.asarray(docs).tolist(), np.asarray(starts).tolist(), np.asarray(stops).tolist())]


@pytest.fixture(scope="module")
def three():
    return [LengthsOnly("a", 6000, 1), LengthsOnly("b", 3000, 2, median=2000), LengthsOnly("c", 800, 3, median=150)]


# ---------------------------------------------------------------- pure: sampling and sharding


def test_epoch_permutations_reshuffle_and_repeat():
    p0, p1 = epoch_permutation(7, "ab" * 16, 0, 500), epoch_permutation(7, "ab" * 16, 1, 500)
    assert sorted(p0.tolist()) == list(range(500)) and sorted(p1.tolist()) == list(range(500))
    assert not np.array_equal(p0, p1)  # reshuffled per epoch
    assert np.array_equal(p0, epoch_permutation(7, "ab" * 16, 0, 500))  # deterministic
    assert not np.array_equal(p0, epoch_permutation(8, "ab" * 16, 0, 500))  # seed matters
    assert not np.array_equal(p0, epoch_permutation(7, "cd" * 16, 0, 500))  # dataset matters
    s = DocumentStream(np.ones(50, np.uint32), "ab" * 16, seed=7)
    run = s.docs(0, 160)
    for e in range(3):  # each epoch of the stream is one whole permutation
        assert np.array_equal(run[e * 50 : (e + 1) * 50], epoch_permutation(7, "ab" * 16, e, 50))
    assert np.array_equal(s.docs(37, 40), run[37:77])  # any position without the ones before


def test_take_stops_at_first_reach_and_quotas_sum_exactly():
    s = DocumentStream(np.array([5, 7, 11, 13], np.uint32), "01" * 16, seed=0)
    docs, pos, taken = s.take(0, 20)
    lens = np.array([5, 7, 11, 13])[docs]
    assert taken == lens.sum() >= 20 and lens[:-1].sum() < 20 and pos == len(docs)
    none, pos, taken = s.take(3, -4)  # a carry bigger than the quota: take nothing
    assert none.size == 0 and (pos, taken) == (3, 0)
    shares = [w * 1000.3 for w in normalise_weights([6, 3, 1])]
    per = np.array([window_quotas(shares, w) for w in range(1000)])
    assert np.array_equal(per.sum(axis=0), [int(np.floor(1000 * s)) for s in shares])


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 8])
def test_rows_for_disjoint_complete(dp_size):
    B = 5
    for step in (0, 1, 17):
        got = np.concatenate([rows_for(step, r, dp_size, B) for r in range(dp_size)])
        assert len(set(got.tolist())) == got.size  # disjoint
        assert sorted(got.tolist()) == list(range(step * B * dp_size, (step + 1) * B * dp_size))  # complete


def test_rows_of_a_step_do_not_depend_on_dp_size():
    for step in (0, 3, 10):
        sets = {n: sorted(np.concatenate([rows_for(step, r, n, 24 // n) for r in range(n)]).tolist())
                for n in (1, 2, 3, 4, 8)}
        assert all(v == sets[1] for v in sets.values())
    with pytest.raises(ValueError, match="dp_rank=2 must be < dp_size=2"):
        rows_for(0, 2, 2, 1)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        rows_for(0, 0, 1, 0)


# ---------------------------------------------------------------- pure: StreamPlan over stand-ins


def segment_tokens_by_dataset(plan: StreamPlan, n_rows: int) -> np.ndarray:
    """Real tokens per dataset in global rows [0, n_rows), from the windows' segment tables."""
    per, anchor = np.zeros(len(plan.datasets)), plan.start_anchor()
    while anchor.first_row < n_rows:
        win = plan.window(anchor)
        take = min(win.num_rows, n_rows - anchor.first_row)
        seg = slice(0, int(win.row_ptr[take]))
        per += np.bincount(win.seg_dataset[seg], weights=win.seg_len[seg], minlength=len(per))
        anchor = plan.next_anchor(anchor)
    return per


def test_blend_proportions_by_tokens(three):
    plan = StreamPlan(three, [0.6, 0.3, 0.1], seed=3, seq_len=1024)
    per = segment_tokens_by_dataset(plan, 10_000)
    share = per / per.sum()
    rel = np.abs(share - [0.6, 0.3, 0.1]) / [0.6, 0.3, 0.1]
    print(f"\nblend over 10k rows of 1024: shares {np.round(share, 5).tolist()}, "
          f"relative errors {np.round(rel, 5).tolist()}")
    assert rel.max() < 0.01


def test_determinism_fingerprint_and_seed(three):
    a = StreamPlan(three, [3, 1, 1], seed=11, seq_len=512, window_tokens=64 * 512)
    b = StreamPlan(three, [0.6, 0.2, 0.2], seed=11, seq_len=512, window_tokens=64 * 512)
    c = StreamPlan(three, [3, 1, 1], seed=12, seq_len=512, window_tokens=64 * 512)
    assert a.fingerprint == b.fingerprint != c.fingerprint  # weights are normalised
    assert StreamPlan(three, [3, 1, 2], seed=11, seq_len=512).fingerprint != a.fingerprint
    ids = np.arange(100, 200)
    ba, _ = a.rows(ids, a.start_anchor())
    bb, _ = b.rows(ids, b.start_anchor())
    bc, _ = c.rows(ids, c.start_anchor())
    for f in ("tokens", "labels", "position_ids", "cu_seqlens", "doc_hashes"):
        assert np.array_equal(getattr(ba, f), getattr(bb, f))
    assert not np.array_equal(ba.tokens, bc.tokens)


def test_windows_take_the_stream_and_every_epoch_covers_every_document():
    ds = LengthsOnly("small", 300, 9, median=100)
    plan = StreamPlan([ds], [1.0], seed=5, seq_len=256, window_tokens=4096)
    anchor, seen = plan.start_anchor(), []
    while anchor.positions[0] < 3 * 300 + 50:
        win = plan.window(anchor)
        fills = np.add.reduceat(win.seg_len, win.row_ptr[:-1])
        assert fills.max() <= 256
        # The document pieces of a window are whole documents (split, never truncated).
        lens = ds.lengths[win.seg_doc].astype(np.int64)
        assert np.all(win.seg_offset + win.seg_len <= lens)
        seen.append(win.seg_doc[win.seg_offset == 0])
        anchor = plan.next_anchor(anchor)
    # The windows took exactly the stream's documents in stream order, each whole.
    order = np.concatenate(seen)
    assert sorted(order.tolist()) == sorted(plan._streams[0].docs(0, anchor.positions[0]).tolist())
    counts = np.bincount(order, minlength=300)
    assert counts.min() >= 3  # three whole epochs passed: every document at least 3 times


def test_window_follows_the_documented_recipe(three):
    """Window w = blend by quota, shuffle documents by rng(seed, w), split + BFD, shuffle rows by rng(seed, w, 1)."""
    plan = StreamPlan(three, [0.5, 0.3, 0.2], seed=21, seq_len=2048, window_tokens=32 * 2048)
    anchor = plan.next_anchor(plan.next_anchor(plan.start_anchor()))
    quotas = window_quotas(plan._shares, 2)
    docs, positions, carries = blend_window(plan._streams, anchor.positions, anchor.carries, quotas)
    ds_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    doc = np.concatenate(docs)
    ln = np.concatenate([three[i].lengths[d] for i, d in enumerate(docs)]).astype(np.int64)
    mix = stable_permutation([21, 2], doc.size)
    ref = pack_rows(ln[mix], 2048, [21, 2, 1])
    win = plan.window(anchor)
    assert np.array_equal(win.seg_doc, doc[mix][ref.seg_item])
    assert np.array_equal(win.seg_dataset, ds_of[mix][ref.seg_item])
    assert np.array_equal(win.row_ptr, ref.row_ptr) and np.array_equal(win.seg_offset, ref.seg_offset)
    assert win.next_anchor == Anchor(3, anchor.first_row + ref.num_rows, positions, carries)


def test_validation_errors(three):
    ok = dict(weights=[1, 1, 1], seed=0, seq_len=512)
    cases = [
        (dict(seq_len=1), "seq_len=1"), (dict(seq_len=(1 << 20) + 1), "seq_len=1048577"),
        (dict(weights=[1, 0, 1]), "weight #1 is 0"), (dict(weights=[1, -2, 1]), "weight #1 is -2"),
        (dict(weights=[1, float("nan"), 1]), "finite"), (dict(weights=[1, float("inf"), 1]), "finite"),
        (dict(weights=[1, 1]), "2 blend weights for 3 datasets"), (dict(seed=-1), "seed=-1"),
        (dict(window_tokens=100), "window_tokens=100"),
    ]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            StreamPlan(three, **{**ok, **change})
    with pytest.raises(ValueError, match="no datasets"):
        StreamPlan([], [], 0, 512)
    odd = LengthsOnly("odd", 10, 4, eos=2)
    with pytest.raises(ValueError, match="different tokenizers.*eos_id 1 vs 2"):
        StreamPlan([three[0], odd], [1, 1], 0, 512)
    plan = StreamPlan(three, **ok)
    a = plan.seek(300)
    with pytest.raises(ValueError, match="after row 0"):
        plan.seek(0, a) if a.first_row > 0 else plan.seek(0, plan.next_anchor(a))
    with pytest.raises(ValueError, match="ascending"):
        plan.rows([5, 4], plan.start_anchor())
    with pytest.raises(ValueError, match="this plan has 3"):
        plan.window(Anchor(0, 0, (0,), (0,)))


def test_anchor_round_trip_and_bad_dicts():
    a = Anchor(12, 3456, (1, 2 ** 40, 3), (0, 17, 5))
    assert Anchor.from_dict(json.loads(json.dumps(a.to_dict())), num_datasets=3) == a
    for bad, msg in [({"window": 1}, "missing field"), ({**a.to_dict(), "first_row": -1}, "first_row=-1"),
                     ({**a.to_dict(), "carries": [0]}, "equal length"),
                     ({**a.to_dict(), "positions": [0, 1.5, 2]}, "integers"),
                     ("x", "must be a dict")]:
        with pytest.raises(ValueError, match=msg):
            Anchor.from_dict(bad)
    with pytest.raises(ValueError, match="this blend has 2"):
        Anchor.from_dict(a.to_dict(), num_datasets=2)


# ---------------------------------------------------------------- integration: real built datasets


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    paths = [build_dataset([make_corpus(root, 1500, seed=s, min_len=8, max_len=3000)], root / f"ds{s}",
                           shard_size_mb=1) for s in (1, 2)]
    return [ShardedDataset.open(p) for p in paths]


def check_batch(plan: StreamPlan, mb, start_anchor: Anchor) -> None:
    """Every invariant of a MicroBatch, and every token against its document read back alone."""
    S, B = plan.seq_len, mb.row_ids.size
    cu = mb.cu_seqlens.astype(np.int64)
    assert mb.tokens.size == mb.labels.size == mb.position_ids.size == B * S
    assert cu[0] == 0 and cu[-1] == B * S and np.array_equal(np.diff(cu), mb.seq_lens)
    assert set(range(0, B * S + 1, S)) <= set(cu.tolist())  # every row boundary is a segment boundary
    assert mb.num_tokens == int((mb.doc_hashes != 0).astype(np.int64) @ mb.seq_lens)
    real_segs = []
    for i in range(mb.seq_lens.size):
        lo, hi = cu[i], cu[i + 1]
        if mb.doc_hashes[i] == 0:  # padding: only at a row's end
            assert hi % S == 0 and np.all(mb.tokens[lo:hi] == plan.pad_id)
            assert np.all(mb.labels[lo:hi] == IGNORE_INDEX) and np.all(mb.position_ids[lo:hi] == 0)
        else:
            assert np.array_equal(mb.position_ids[lo:hi], np.arange(hi - lo))
            assert np.array_equal(mb.labels[lo : hi - 1], mb.tokens[lo + 1 : hi])
            real_segs.append((lo, hi, i))
    # Against the window tables and the documents themselves.
    anchor, k = start_anchor, 0
    for b, row in enumerate(mb.row_ids.tolist()):
        anchor = plan.seek(row, anchor)
        win = plan.window(anchor)
        r = row - anchor.first_row
        for s in range(int(win.row_ptr[r]), int(win.row_ptr[r + 1])):
            lo, hi, i = real_segs[k]
            k += 1
            ds = plan.datasets[int(win.seg_dataset[s])]
            doc, off, n = int(win.seg_doc[s]), int(win.seg_offset[s]), int(win.seg_len[s])
            stored = ds.read_many([doc])[0]
            full = stored.astype(np.int64)
            assert b * S <= lo and hi <= (b + 1) * S and hi - lo == n
            assert np.array_equal(mb.tokens[lo:hi], full[off : off + n])
            assert mb.doc_hashes[i] == ds.hashes[doc] == xxhash.xxh3_64_intdigest(stored.tobytes())
            if off + n == full.size:  # the document's end: eos, and nothing predicted past it
                assert full[-1] == plan.eos_id and mb.labels[hi - 1] == IGNORE_INDEX
            else:  # a non-final piece keeps the document's true next token
                assert mb.labels[hi - 1] == full[off + n]
    assert k == len(real_segs)


def test_stream_plan_on_built_datasets(built):
    plan = StreamPlan(built, [0.7, 0.3], seed=1, seq_len=512, window_tokens=24 * 512)
    anchor, B, n = plan.start_anchor(), 3, 2
    for step in range(12):  # windows of ~24 rows: batches cross window boundaries
        for r in range(n):
            mb, last = plan.rows(rows_for(step, r, n, B), anchor)
            check_batch(plan, mb, anchor)
        anchor = last
    assert anchor.window >= 2
    # A multi-row batch equals its rows materialised one at a time.
    ids = np.arange(20, 60, 7)
    mb, _ = plan.rows(ids, plan.start_anchor())
    for j, row in enumerate(ids.tolist()):
        one, _ = plan.rows([row], plan.start_anchor())
        assert np.array_equal(mb.tokens[j * 512 : (j + 1) * 512], one.tokens)
        assert np.array_equal(mb.labels[j * 512 : (j + 1) * 512], one.labels)


def test_windows_cover_documents_exactly(built):
    plan = StreamPlan(built, [1, 1], seed=2, seq_len=256, window_tokens=40 * 256)
    anchor = plan.start_anchor()
    for _ in range(5):
        win = plan.window(anchor)
        for d, ds in enumerate(built):
            m = win.seg_dataset == d
            docs, counts = np.unique(win.seg_doc[m], return_counts=True)
            for doc in docs.tolist():
                mm = m & (win.seg_doc == doc)
                got = sorted(zip(win.seg_offset[mm].tolist(), win.seg_len[mm].tolist()))
                _, off, ln = split_pieces(ds.lengths[[doc]], 256)
                reps = len(got) // len(off)  # a small dataset may repeat a document in one window
                assert got == sorted(list(zip(off.tolist(), ln.tolist())) * reps)
        anchor = plan.next_anchor(anchor)


def test_seek_matches_scan_from_start(built):
    plan = StreamPlan(built, [0.5, 0.5], seed=4, seq_len=512, window_tokens=16 * 512)
    fresh = StreamPlan(built, [0.5, 0.5], seed=4, seq_len=512, window_tokens=16 * 512)
    scan, anchors = plan.start_anchor(), []
    for _ in range(30):
        anchors.append(scan)
        scan = plan.next_anchor(scan)
    for row in (0, 15, 16, 77, 200, 333):
        by_scan = max((a for a in anchors if a.first_row <= row), key=lambda a: a.window)
        assert fresh.seek(row) == by_scan  # a new plan: scanned from the start
        mid = anchors[3] if anchors[3].first_row <= row else anchors[0]
        assert plan.seek(row, mid) == by_scan
        assert plan.seek(row, Anchor.from_dict(json.loads(json.dumps(mid.to_dict())))) == by_scan
        x, _ = fresh.rows([row], fresh.start_anchor())
        y, _ = plan.rows([row], mid)
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.doc_hashes, y.doc_hashes)


def test_threads_get_the_same_batches(built):
    def run(plan, out, r):
        anchor = plan.start_anchor()
        for step in range(10):
            mb, anchor = plan.rows(rows_for(step, r, 4, 2), anchor)
            out[(step, r)] = mb.tokens
    ref: dict = {}
    solo = StreamPlan(built, [2, 1], seed=9, seq_len=512, window_tokens=8 * 512)
    for r in range(4):
        run(solo, ref, r)
    shared, got = StreamPlan(built, [2, 1], seed=9, seq_len=512, window_tokens=8 * 512, cache_windows=2), {}
    threads = [threading.Thread(target=run, args=(shared, got, r)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ref.keys() == got.keys() and all(np.array_equal(ref[k], got[k]) for k in ref)


def test_rows_throughput_at_8192(tmp_path):
    corpus = make_corpus(tmp_path, 2500, seed=5, min_len=100, max_len=50_000)
    path = build_dataset([corpus], tmp_path / "long", shard_size_mb=8)
    ds = ShardedDataset.open(path)
    plan = StreamPlan([ds], [1.0], seed=0, seq_len=8192)
    for B in (1, 8):
        anchor, tokens, real = plan.start_anchor(), 0, 0
        plan.rows(rows_for(0, 0, 1, B), anchor)  # first window built outside the timing
        # this thread's CPU time: other processes on a loaded machine do not count against it
        t0 = time.thread_time()
        for step in range(512 // B):
            mb, anchor = plan.rows(rows_for(step, 0, 1, B), anchor)
            tokens += mb.tokens.size
            real += mb.num_tokens
        rate = tokens / (time.thread_time() - t0)
        print(f"\nrows() at seq 8192, B={B}, one thread: {rate / 1e6:.1f}M tokens/s "
              f"({ds.num_documents} docs, median {int(np.median(ds.lengths))} tokens; fill {real / tokens:.4f})")
        assert rate >= 10e6
