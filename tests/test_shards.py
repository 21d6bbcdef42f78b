"""Shard format and reader API: real LMDB shards built into tmp folders, read back and verified.

The reference for every token array is the tokenizer's own `encode(text)` plus the eos id.
"""

from __future__ import annotations

import json
import threading

import lmdb
import numpy as np
import pytest

from dataservice.build import build_dataset, make_corpus
from dataservice.shards import (INDEX_DTYPE, DatasetError, ShardedDataset, ShardWriter, dataset_fingerprint,
                                encode_key, file_checksum)
from dataservice.tokenizer import (ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer,
                                   tokenizer_from_manifest, train_tiny_tokenizer)


def _texts(path):
    return [json.loads(line)["text"] for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def corpus_ds(tmp_path_factory):
    """A 3000-document corpus built into several small shards."""
    d = tmp_path_factory.mktemp("corpus")
    corpus = make_corpus(d, 3000, seed=7, min_len=4, max_len=3000)
    out = build_dataset([corpus], d / "ds", shard_size_mb=0.1)
    return corpus, out


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve 東京 🙂 \x00 end"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(np.append(ids, [tok.bos_id, tok.eos_id, tok.pad_id])) == text
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    assert load_tokenizer("byte").describe()["kind"] == "byte"


def test_hf_tokenizer_loads_and_describes(tmp_path):
    path = train_tiny_tokenizer(tmp_path / "tiny")
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "hello world, naïve 東京"
    assert tok.decode(tok.encode(text)) == text
    d = tok.describe()
    assert d["kind"] == "hf" and d["name"] == "tiny" and len(d["sha256"]) == 64
    assert tokenizer_from_manifest({"tokenizer": d}).sha256 == tok.sha256


def test_hf_tokenizer_without_eos_is_refused_clearly(tmp_path):
    path = train_tiny_tokenizer(tmp_path / "noeos", specials=("<pad>", "<bos>", "<unk>"))
    with pytest.raises(TokenizerError, match=r"no eos special token.*</s>"):
        load_tokenizer(str(path))
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_round_trip_over_several_shards(corpus_ds):
    corpus, out = corpus_ds
    texts = _texts(corpus)
    tok = ByteTokenizer()
    with ShardedDataset.open(out) as ds:
        assert len(ds.manifest["shards"]) >= 3
        assert ds.num_documents == len(texts) == ds.manifest["counts"]["documents"]
        assert ds.num_tokens == int(ds.lengths.sum())
        assert ds.lengths.dtype == np.uint32 and ds.hashes.dtype == np.uint64
        docs = ds.read_many(np.arange(ds.num_documents))
        for i, (text, got) in enumerate(zip(texts, docs)):
            want = np.append(tok.encode(text), tok.eos_id)
            assert got.dtype == np.uint16 and np.array_equal(got, want), i
            assert len(got) == ds.lengths[i]
        assert np.array_equal(ds.read(1234), docs[1234])
        got = ds.read(0)
        got[0] += 1  # arrays handed out are private, writable copies
        assert np.array_equal(ds.read(0), docs[0])


def test_read_many_order_and_bounds(corpus_ds):
    _, out = corpus_ds
    ds = ShardedDataset.open(out)
    order = [2999, 0, 1500, 0, 42]
    assert [len(a) for a in ds.read_many(order)] == [int(ds.lengths[i]) for i in order]
    assert ds.read_many([]) == []
    with pytest.raises(IndexError, match="3000"):
        ds.read(3000)
    with pytest.raises(IndexError):
        ds.read_many([1, -1])
    ds.close()
    with pytest.raises(DatasetError, match="closed"):
        ds.read(5)


def test_read_spans_equal_slices_of_whole_documents(corpus_ds):
    _, out = corpus_ds
    ds = ShardedDataset.open(out)
    docs = np.array([2999, 0, 1500, 42, 42])
    lengths = ds.lengths[docs].astype(np.int64)
    starts = lengths // 3
    stops = np.maximum(starts, lengths - 1)
    whole = ds.read_many(docs)
    for got, full, a, b in zip(ds.read_spans(docs, starts, stops), whole, starts, stops):
        np.testing.assert_array_equal(got, full[a:b])
    with pytest.raises(IndexError, match="outside its document"):
        ds.read_spans([0], [0], [int(ds.lengths[0]) + 1])
    ds.close()


def test_concurrent_readers_agree(corpus_ds):
    _, out = corpus_ds
    ds = ShardedDataset.open(out)
    expected = ds.read_many(np.arange(ds.num_documents))
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                docs = rng.integers(0, ds.num_documents, size=64)
                for d, arr in zip(docs, ds.read_many(docs)):
                    if not np.array_equal(arr, expected[d]):
                        errors.append(int(d))
                d = int(rng.integers(ds.num_documents))
                if not np.array_equal(ds.read(d), expected[d]):
                    errors.append(d)
        except Exception as e:  # surfaced by the assert below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not list(out.rglob("lock.mdb")), "reading must not create lock files"
    ds.close()


def test_index_and_manifest_layout(corpus_ds):
    _, out = corpus_ds
    index = np.load(out / "index.npy")
    assert index.dtype == INDEX_DTYPE
    m = json.loads((out / "manifest.json").read_text())
    # (shard, key) follow the ingestion order: keys restart at 0 in each shard.
    starts = np.flatnonzero(np.diff(index["shard"].astype(np.int64))) + 1
    assert np.all(index["key"][starts] == 0)
    assert [s["documents"] for s in m["shards"]] == np.bincount(index["shard"]).tolist()
    assert sum(s["tokens"] for s in m["shards"]) == m["total_tokens"] == int(index["length"].sum())
    for s in m["shards"]:
        assert s["checksum"] == file_checksum(out / s["name"] / "data.mdb")
        assert sorted(p.name for p in (out / s["name"]).iterdir()) == ["data.mdb"]
    assert m["index_checksum"] == file_checksum(out / "index.npy")
    assert m["fingerprint"] == dataset_fingerprint(m)
    assert m["token_dtype"] == "uint16" and m["appends_eos"] is True and m["format_version"] == 1
    assert sum(h["documents"] for h in m["length_histogram"]) == 3000
    for h in m["length_histogram"]:
        sel = (index["length"] >= h["min"]) & (index["length"] <= h["max"])
        assert int(sel.sum()) == h["documents"]


def test_shard_writer_respects_bound(tmp_path):
    bound = 256 << 10
    w = ShardWriter(tmp_path, bound)
    rng = np.random.default_rng(0)
    sizes = np.concatenate([rng.integers(2, 4000, size=600), [3 * bound]])  # last: one oversize value
    placed = [w.add(rng.integers(0, 255, size=int(n), dtype=np.uint16).tobytes(), int(n)) for n in sizes]
    shards = w.close()
    assert len(shards) >= 4
    for s in shards[:-1]:
        assert s["bytes"] <= bound, s
    assert shards[-1]["documents"] == 1 and shards[-1]["bytes"] > bound  # the oversize value alone
    shard, key = placed[123]
    env = lmdb.open(str(tmp_path / shards[shard]["name"]), readonly=True, lock=False)
    with env.begin() as txn:
        assert len(txn.get(encode_key(key))) == 2 * sizes[123]
    env.close()


def test_verify_names_the_flipped_file(tmp_path):
    corpus = make_corpus(tmp_path, 400, seed=3, min_len=50, max_len=2000)
    out = build_dataset([corpus], tmp_path / "ds", shard_size_mb=0.1)
    ds = ShardedDataset.open(out, verify=True)
    assert ds.verify() == []
    target = out / "shard-00001" / "data.mdb"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    problems = ds.verify()
    assert len(problems) == 1 and "shard-00001/data.mdb" in problems[0]
    with pytest.raises(DatasetError, match="shard-00001/data.mdb"):
        ShardedDataset.open(out, verify=True)


@pytest.mark.parametrize("damage, match", [
    ("nofolder", "does not exist"),
    ("nomanifest", "manifest.json' is missing"),
    ("badjson", "not valid JSON"),
    ("version", "format_version 99"),
])
def test_open_refuses_broken_datasets(tmp_path, damage, match):
    corpus = make_corpus(tmp_path, 20, seed=1)
    out = build_dataset([corpus], tmp_path / "ds")
    mpath = out / "manifest.json"
    if damage == "nofolder":
        out = tmp_path / "elsewhere"
    elif damage == "nomanifest":
        mpath.unlink()
    elif damage == "badjson":
        mpath.write_text("{ not json")
    else:
        m = json.loads(mpath.read_text())
        m["format_version"] = 99
        mpath.write_text(json.dumps(m))
    with pytest.raises(DatasetError, match=match):
        ShardedDataset.open(out)


def test_large_vocabulary_uses_uint32(tmp_path):
    """A tokenizer.json with more than 65536 ids stores uint32 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "w1 w69999 w65536 nope"}) + "\n")
    out = build_dataset([corpus], tmp_path / "ds", tokenizer=str(tmp_path))
    ds = ShardedDataset.open(out, verify=True)
    assert ds.manifest["token_dtype"] == "uint32" and ds.vocab_size == 70_004
    got = ds.read(0)
    assert got.dtype == np.uint32 and got.tolist() == [5, 70_003, 65_540, 3, 2]
