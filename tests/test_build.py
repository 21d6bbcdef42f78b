"""`tessera-data build` and `inspect`: real corpus files in tmp folders, the CLI run as a subprocess.

Token references are the tokenizer's own `encode(text)` plus eos; a dataset is "complete"
exactly when its folder holds manifest.json (written last, then the folder is renamed in).
"""

from __future__ import annotations

import collections
import json
import os
import pty
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dataservice.build import build_dataset, corpus_loss_floor, expand_braces, make_corpus
from dataservice.shards import ShardedDataset
from dataservice.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_from_manifest, train_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "dataservice.cli", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, **kw)


def write_jsonl(path, rows):
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r, ensure_ascii=False) + "\n").encode())
    return path


def decoded(ds):
    tok = ByteTokenizer()
    return [tok.decode(a) for a in ds.read_many(range(ds.num_documents))]


@pytest.mark.slow
def test_jsonl_text_and_folder_inputs(tmp_path):
    jl = write_jsonl(tmp_path / "a.jsonl", [{"text": "first doc"}, {"body": "x", "text": "second — naïve"}])
    txt = tmp_path / "note.txt"
    txt.write_text("a whole file\nis one document\n")
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "b.py").write_text("print('b')\n")
    (src / "pkg" / "sub" / "a.py").write_text("print('a')\n")
    (src / "pkg" / "readme.md").write_text("not python")
    r = cli("build", jl, txt, src, "--glob", "**/*.py", "--output", tmp_path / "ds")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("\n") == 1 and "5 documents" in r.stderr  # not a TTY: summary line only
    ds = ShardedDataset.open(tmp_path / "ds", verify=True)
    assert decoded(ds) == ["first doc", "second — naïve", "a whole file\nis one document\n",
                           "print('b')\n", "print('a')\n"]  # ingestion order; folder sorted by path
    assert ds.manifest["counts"]["files"] == 4
    tok = ByteTokenizer()
    assert np.array_equal(ds.read(1), np.append(tok.encode("second — naïve"), tok.eos_id))


def test_duplicates_are_dropped_and_counted(tmp_path):
    jl = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in ["same", "other", "same", "same"]])
    (tmp_path / "same.txt").write_text("other")
    out = build_dataset([jl, tmp_path / "same.txt"], tmp_path / "ds")
    ds = ShardedDataset.open(out)
    assert decoded(ds) == ["same", "other"]
    assert ds.manifest["counts"]["duplicates_dropped"] == 3
    assert len(set(ds.hashes.tolist())) == 2


def test_duplicates_across_many_batches(tmp_path):
    corpus = make_corpus(tmp_path, 5000, seed=9, min_len=4, max_len=200)
    out = build_dataset([corpus, corpus, corpus], tmp_path / "ds", shard_size_mb=0.5)
    ds = ShardedDataset.open(out)
    assert ds.num_documents == 5000 and ds.manifest["counts"]["duplicates_dropped"] == 10_000
    assert np.unique(ds.hashes).size == 5000


def bad_inputs(tmp_path):
    jl = write_jsonl(tmp_path / "bad.jsonl", [
        {"text": "good one"},
        b"{broken json\n",
        b"\n",  # blank lines are skipped, not counted
        {"content": "no text field"},
        {"text": 42},
        b'{"text": "bad \xff byte"}\n',
        {"text": "   "},
        {"text": "good two"},
    ])
    (tmp_path / "latin1.txt").write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "empty.txt").write_bytes(b"")
    return [jl, tmp_path / "latin1.txt", tmp_path / "empty.txt"]


@pytest.mark.slow
def test_problems_are_counted_not_fatal(tmp_path):
    r = cli("build", *bad_inputs(tmp_path), "-o", tmp_path / "ds", "--max-skipped", "0.8")  # 7 of 9 skipped
    assert r.returncode == 0, r.stderr
    assert "invalid_utf8=2, empty=2, broken_json=1, missing_field=2" in r.stderr
    ds = ShardedDataset.open(tmp_path / "ds")
    assert decoded(ds) == ["good one", "good two"]
    c = ds.manifest["counts"]
    assert (c["invalid_utf8"], c["empty"], c["broken_json"], c["missing_field"], c["files"]) == (2, 2, 1, 2, 3)
    assert any(p.endswith("bad.jsonl:2: broken_json") for p in ds.manifest["first_problems"])


@pytest.mark.slow
def test_a_build_that_skips_most_of_its_input_fails_and_writes_nothing(tmp_path):
    jl = write_jsonl(tmp_path / "c.jsonl", [{"text": f"doc {i}"} for i in range(205)] + [{"body": "other"}])
    r = cli("build", jl, "-o", tmp_path / "ds", "--text-field", "body")  # the wrong field: 205 of 206 skipped
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "skipped 205 of 206 records" in r.stderr and "--text-field 'body'" in r.stderr
    assert not (tmp_path / "ds").exists()
    r = cli("build", *bad_inputs(tmp_path), "-o", tmp_path / "ds")  # 7 of 9 skipped: over the default 0.5
    assert r.returncode == 2 and "more than --max-skipped 0.5" in r.stderr


@pytest.mark.slow
def test_globs_repeat_and_expand_braces(tmp_path):
    src = tmp_path / "src"
    for name, text in [("a.py", "alpha"), ("b.md", "beta"), ("c.txt", "gamma"), ("sub/d.py", "delta")]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    r = cli("build", src, "-o", tmp_path / "one", "--glob", "**/*.py", "--glob", "*.md")
    assert r.returncode == 0, r.stderr
    assert sorted(decoded(ShardedDataset.open(tmp_path / "one"))) == ["alpha", "beta", "delta"]
    r = cli("build", src, "-o", tmp_path / "two", "--glob", "**/*.{py,md}", "--glob", "*.rs")
    assert r.returncode == 0, r.stderr
    assert sorted(decoded(ShardedDataset.open(tmp_path / "two"))) == ["alpha", "beta", "delta"]
    assert "warning: --glob '*.rs' matched no file" in r.stderr  # said, not silently ignored
    assert expand_braces("x/{a,b{c,d}}.{1,2}") == ["x/a.1", "x/a.2", "x/bc.1", "x/bc.2", "x/bd.1", "x/bd.2"]
    assert expand_braces("plain/*") == ["plain/*"] and expand_braces("{one}") == ["{one}"]


@pytest.mark.slow
def test_strict_stops_at_first_problem(tmp_path):
    r = cli("build", *bad_inputs(tmp_path), "-o", tmp_path / "ds", "--strict")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "bad.jsonl:2: broken json" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.txt", "latin1.txt"]
    r = cli("build", tmp_path / "latin1.txt", "-o", tmp_path / "ds", "--strict")
    assert r.returncode == 2 and "latin1.txt:2: invalid utf8" in r.stderr


@pytest.mark.slow
def test_hf_tokenizer_build_round_trip(tmp_path):
    tok_path = train_tiny_tokenizer(tmp_path / "tiny")
    texts = ["hello world, naïve 東京", "the quick brown fox jumps", "größe unknown zzz"]
    jl = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    r = cli("build", jl, "-o", tmp_path / "ds", "--tokenizer", tok_path)
    assert r.returncode == 0, r.stderr
    ds = ShardedDataset.open(tmp_path / "ds", verify=True)
    tok = load_tokenizer(str(tok_path))
    m = ds.manifest["tokenizer"]
    assert m["kind"] == "hf" and m["sha256"] == tok.sha256 and ds.eos_id == tok.eos_id == 2
    assert ds.manifest["token_dtype"] == "uint16" and ds.vocab_size == tok.vocab_size
    for i, t in enumerate(texts):
        assert np.array_equal(ds.read(i), np.append(tok.encode(t), tok.eos_id))
    # The dataset keeps its own copy, so it decodes even after the original is gone.
    tok_path.unlink()
    again = tokenizer_from_manifest(ds.manifest, ds.path)
    assert again.decode(ds.read(0)) == texts[0]


@pytest.mark.slow
def test_interrupted_build_leaves_no_complete_dataset(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl",
                      [{"text": f"{i} " + "lorem ipsum dolor sit amet " * 800} for i in range(3000)])
    out = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-m", "dataservice.cli", "build", str(big), "-o", str(out),
                             "--shard-size-mb", "0.25", "--quiet"], cwd=REPO, stderr=subprocess.PIPE)
    tmp = tmp_path / f"ds.tmp-{proc.pid}"
    deadline = time.monotonic() + 30
    while not (tmp / "shard-00003").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, "the build finished before it could be interrupted; use a bigger corpus"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert not out.exists() and not (tmp / "manifest.json").exists()
    with pytest.raises(Exception, match="does not exist"):
        ShardedDataset.open(out)
    # A leftover temporary folder does not stop the next build.
    assert cli("build", big, "-o", out, "--quiet").returncode == 0
    assert ShardedDataset.open(out).num_documents == 3000


def flip_byte(path, where=0.5):
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * where)] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.slow
def test_inspect_ok_then_detects_flipped_bytes(tmp_path):
    corpus = make_corpus(tmp_path, 500, seed=2, min_len=20, max_len=3000)
    out = build_dataset([corpus], tmp_path / "ds", shard_size_mb=0.2)
    r = cli("inspect", out)
    assert r.returncode == 0, r.stderr
    assert "verify       OK" in r.stdout and "documents    500" in r.stdout and "shard-00002" in r.stdout
    summary = json.loads(cli("inspect", out, "--json").stdout)
    assert summary["ok"] and summary["documents"] == 500 and len(summary["shards"]) >= 3
    flip_byte(out / "shard-00002" / "data.mdb")
    r = cli("inspect", out)
    assert r.returncode == 1 and "shard-00002/data.mdb" in r.stdout + r.stderr
    assert "shard-00000" not in r.stderr
    flip_byte(out / "shard-00002" / "data.mdb")  # restore
    flip_byte(out / "index.npy", 0.9)
    r = cli("inspect", out, "--json")
    res = json.loads(r.stdout)
    assert r.returncode == 1 and not res["ok"]
    assert len(res["verification_problems"]) == 1 and "index.npy" in res["verification_problems"][0]
    flip_byte(out / "index.npy", 0.9)  # restore, then edit a count in the manifest
    mpath = out / "manifest.json"
    mpath.write_text(mpath.read_text().replace('"duplicates_dropped": 0', '"duplicates_dropped": 1'))
    r = cli("inspect", out)
    assert r.returncode == 1 and "manifest.json" in r.stderr and "manifest_checksum" in r.stderr


@pytest.mark.slow
def test_existing_output_refused_unless_overwrite(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "beta"}, {"text": "gamma"}])
    out = tmp_path / "ds"
    assert cli("build", a, "-o", out).returncode == 0
    r = cli("build", b, "-o", out)
    assert r.returncode == 2 and "--overwrite" in r.stderr and r.stderr.count("\n") == 1
    assert decoded(ShardedDataset.open(out)) == ["alpha"]
    assert cli("build", b, "-o", out, "--overwrite").returncode == 0
    assert decoded(ShardedDataset.open(out)) == ["beta", "gamma"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "ds"]


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["build", "{tmp}/missing.jsonl", "-o", "{tmp}/ds"], "does not exist"),
    (["build", "{tmp}/a.jsonl"], "--output"),
    (["build", "{tmp}/a.jsonl", "-o", "{tmp}/ds", "--shard-size-mb", "0"], "must be positive"),
    (["build", "{tmp}/a.jsonl", "-o", "{tmp}/a.jsonl/ds"], "output"),
    (["build", "{tmp}/a.jsonl", "-o", "{tmp}/ds", "--tokenizer", "{tmp}/none.json"], "tokenizer"),
    (["build", "{tmp}", "--glob", "*.parquet", "-o", "{tmp}/ds"], "no input files"),
    (["inspect", "{tmp}/nothing"], "does not exist"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_misuse_is_one_line_and_exit_2(tmp_path, args, words):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha"}])
    r = cli(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
    assert not (tmp_path / "ds").exists()


@pytest.mark.slow
def test_progress_line_on_a_terminal(tmp_path):
    corpus = make_corpus(tmp_path, 2000, seed=4)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dataservice.cli", "build", str(corpus), "-o",
                             str(tmp_path / "ds")], cwd=REPO, stderr=slave, stdout=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the pty closes when the process exits
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    os.close(master)
    text = b"".join(chunks).decode()
    assert "\r" in text and "docs/s" in text and "MB written" in text
    assert text.rstrip().splitlines()[-1].lstrip("\r ").startswith("built ")


def test_build_is_deterministic_and_make_corpus_is_reproducible(tmp_path):
    (tmp_path / "x").mkdir()
    c1 = make_corpus(tmp_path / "x", 300, seed=5, min_len=8, max_len=500)
    c2 = make_corpus(tmp_path, 300, seed=5, min_len=8, max_len=500)
    assert c1.read_bytes() == c2.read_bytes()
    rows = [json.loads(line)["text"] for line in open(c1, encoding="utf-8")]
    assert len(set(rows)) == 300 and min(map(len, rows)) >= 8 and max(map(len, rows)) <= 500 + 6
    m1 = build_dataset([c1], tmp_path / "d1", shard_size_mb=0.05).joinpath("manifest.json")
    m2 = build_dataset([c2], tmp_path / "d2", shard_size_mb=0.05).joinpath("manifest.json")
    f1, f2 = (json.loads(m.read_text())["fingerprint"] for m in (m1, m2))
    assert f1 == f2
    m3 = build_dataset([c1], tmp_path / "d3", shard_size_mb=0.05, tokenizer="byte", glob="*")
    assert json.loads((m3 / "manifest.json").read_text())["fingerprint"] == f1


def test_corpus_loss_floor_is_the_entropy_of_the_generated_words(tmp_path):
    # The floor is computed from the generator's distribution; measure it on generated text:
    # the plug-in entropy of the words seen, per byte of a word and its space.
    texts = [json.loads(line)["text"] for line in open(make_corpus(tmp_path, 1000, seed=3), encoding="utf-8")]
    words = [w for text in texts for w in text.split(" ")[1:-1]]  # a document's end words may be cut
    counts = np.array(list(collections.Counter(words).values()))
    p = counts / counts.sum()
    bytes_per_word = sum(len(w.encode("utf-8")) + 1 for w in words) / len(words)
    measured = float(-(p * np.log(p)).sum() / bytes_per_word)
    assert measured == pytest.approx(corpus_loss_floor(3), rel=0.01)
    assert corpus_loss_floor(3) != pytest.approx(corpus_loss_floor(4), rel=1e-3)  # the seed's vocabulary
