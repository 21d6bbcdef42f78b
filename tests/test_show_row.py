"""`tessera-data show-row`: one packed row of a real fine-tuning build, decoded, with its
boundaries and loss mask.

References: the rows a DataClient receives from a real server on loopback (tokens and labels,
exactly), and the dataset itself: each segment's tokens are its document's tokens at the
segment's offset, and the tokens marked trained are the document's stored targets there (the
first token of a segment is never a label of its own row).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dataservice.build import build_dataset
from dataservice.client import DataClient
from dataservice.shards import ShardedDataset
from dataservice.show_row import CLOSE, OPEN
from dataservice.tokenizer import load_tokenizer, train_tiny_tokenizer
from tests.support.cli import assert_one_line, run_entry_point, run_process
from tests.support.service import start_server
from tests.support.sft import CHATML_TEMPLATE, SPECIALS, conversations

SEQ_LEN, SEED = 64, 7


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    """A ChatML fine-tuning build with a trained tokenizer; answers long enough to be split over rows."""
    tmp = tmp_path_factory.mktemp("show-row")
    folder = tmp / "tok"
    train_tiny_tokenizer(folder, specials=SPECIALS, vocab_size=300)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<pad>",
         "chat_template": CHATML_TEMPLATE}))
    return build_dataset([conversations(tmp / "conv.jsonl", 80, seed=2)], tmp / "sft",
                         tokenizer=str(folder / "tokenizer.json"))


def show(*args, process: bool = False) -> dict:
    """show-row's JSON; `process`: in a process of its own (LMDB opens a folder once per process)."""
    proc = (run_process if process else run_entry_point)("dataservice.cli", "show-row", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_shown_row_is_what_the_client_receives_and_marks_the_stored_targets(sft):
    srv, address = start_server([sft])
    try:
        with DataClient(address, seq_len=SEQ_LEN, micro_batch_size=2, seed=SEED, max_batches=5) as client:
            batches = list(client)
        rows = {int(r): (b.tokens[j].numpy(), b.labels[j].numpy()) for b in batches for j, r in enumerate(b.row_ids)}
        served = show(sft, "--seq-len", SEQ_LEN, "--row", 7, "--seed", SEED, "--address", address, process=True)
    finally:
        srv.stop(0)
    assert sorted(rows) == list(range(10))
    views = {r: show(sft, "--seq-len", SEQ_LEN, "--row", r, "--seed", SEED) for r in (0, 3, 7, 9)}
    ds = ShardedDataset.open(sft)
    split = 0
    for r, view in views.items():
        tokens, labels = rows[r]
        assert view["tokens"] == tokens.tolist() and view["labels"] == labels.tolist()
        for seg in view["segments"]:
            a, b, o = seg["start"], seg["stop"], seg["offset"]
            doc = ds.read(seg["document"]).astype(np.int64)
            assert int(ds.hashes[seg["document"]]) == int(seg["doc_hash"], 16)
            assert view["tokens"][a:b] == doc[o:o + b - a].tolist()
            want = ds.target_masks([seg["document"]], [o], [o + b - a])[0].copy()
            want[0] = False
            assert view["trained"][a:b] == want.tolist()
            assert seg["continues"] == (o + b - a < doc.size and bool(ds.target_masks([seg["document"]], [0], [doc.size])[0][o + b - a]))
            split += o > 0 or seg["continues"]
    assert split > 0  # a split example was among them
    assert served["tokens"] == rows[7][0].tolist() and served["labels"] == rows[7][1].tolist()
    assert served["segments"] == views[7]["segments"]


def test_the_human_form_shows_boundaries_and_the_answers_between_markers(sft):
    def whole(view):  # the segments that hold an example from its first token to its last
        return [s for s in view["segments"] if s["offset"] == 0 and s["stop"] - s["start"] == s["doc_length"]]

    row, view = next((r, v) for r in range(20) if whole(v := show(sft, "--seq-len", SEQ_LEN, "--row", r, "--seed", SEED)))
    proc = run_entry_point("dataservice.cli", "show-row", sft, "--seq-len", SEQ_LEN, "--row", row, "--seed", SEED)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"row {row} of seq_len {SEQ_LEN}, seed {SEED}") and f"{len(view['segments'])} segment(s)" in lines[0]
    assert sum(line.startswith("--- segment ") for line in lines) == len(view["segments"])
    tok = load_tokenizer(str(sft / "tokenizer.json"))
    # Template markers are shown; the whole text of each segment is its tokens decoded, nothing lost.
    for seg in view["segments"]:
        text = "".join(t for t, _ in seg["text"])
        assert text == tok.decode_all(view["tokens"][seg["start"]:seg["stop"]])
        marked = "".join(f"{OPEN}{t}{CLOSE}" if on else t for t, on in seg["text"])
        assert marked in proc.stdout
    # ChatML: each answer is trained on with its end of turn; the prompt's turns are context.
    example = whole(view)[0]["text"]
    trained = [t for t, on in example if on]
    assert trained and all("<|im_end|>" in t for t in trained), example
    assert "<|im_start|>user" in "".join(t for t, on in example if not on) and "(whole)" in proc.stdout


@pytest.mark.parametrize("args, words", [
    (["--seq-len", "1", "--row", "0"], ["--seq-len 1 must be >= 2"]),
    (["--seq-len", "64", "--row", "-1"], ["--row -1"]),
])
def test_show_row_misuse_is_one_line(sft, args, words):
    assert_one_line(run_entry_point("dataservice.cli", "show-row", sft, *args), "tessera-data show-row: error:", *words)


def test_show_row_of_a_missing_folder_is_one_line(tmp_path):
    assert_one_line(run_entry_point("dataservice.cli", "show-row", tmp_path / "nope", "--seq-len", "64", "--row", "0"),
                    "tessera-data show-row: error:", "does not exist")
