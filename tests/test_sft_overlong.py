"""Over-long fine-tuning examples at build time (`--max-example-tokens N --overlong MODE`):
real builds, one per mode, read back from their shards.

Reference: the records rendered again here with the plain template (exact tokens and targets,
`ExampleRenderer`), cut by hand as each mode is documented: drop leaves them out; split stores
consecutive N-token pieces with their own targets; truncate-prompt stores the last N tokens,
the final answer whole and an answer cut by the truncation untrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dataservice.build import build_dataset
from dataservice.sft import ExampleRenderer, target_mask
from dataservice.shards import ShardedDataset
from dataservice.tokenizer import ByteTokenizer
from tests.support.cli import assert_one_line, run_entry_point

LIMIT = 60


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Examples short and long: long prompts (cut by truncate-prompt), long answers (longer than
    LIMIT alone: dropped by truncate-prompt), and two-turn conversations whose first answer the
    truncation cuts."""
    rng = np.random.default_rng(11)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]

    def say(n):
        return " ".join(rng.choice(words, size=int(n)).tolist())

    records = []
    for i in range(40):
        if i % 4 == 0:
            records.append({"prompt": f"{i} {say(rng.integers(1, 14))}: ", "completion": say(rng.integers(1, 14))})
        elif i % 4 == 1:
            records.append({"messages": [{"role": "system", "content": f"s{i}"},
                                         {"role": "user", "content": say(rng.integers(1, 6))},
                                         {"role": "assistant", "content": say(rng.integers(2, 6))},
                                         {"role": "user", "content": say(rng.integers(1, 4))},
                                         {"role": "assistant", "content": say(rng.integers(1, 5))}]})
        else:
            records.append({"prompt": f"{i} {say(rng.integers(1, 4))}? ", "completion": say(rng.integers(1, 4))})
    path = tmp_path_factory.mktemp("overlong") / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def examples(corpus: Path):
    renderer = ExampleRenderer(ByteTokenizer(), None)
    return [renderer.render(json.loads(line)) for line in corpus.read_text().splitlines()]


def stored(path: Path) -> list[tuple[list[int], list[bool]]]:
    with ShardedDataset.open(path) as ds:
        return [(ds.read(d).tolist(), ds.target_masks([d], [0], [int(ds.lengths[d])])[0].tolist())
                for d in range(len(ds))]


def mask_of(ex) -> np.ndarray:
    return target_mask(ex.target_runs, 0, ex.ids.size)


def build(corpus: Path, out: Path, mode: str | None) -> dict:
    args = ["build", corpus, "-o", out, "-q", "--max-example-tokens", LIMIT] + (["--overlong", mode] if mode else [])
    proc = run_entry_point("dataservice.cli", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "manifest.json").read_text())


def inspect(out: Path) -> dict:
    proc = run_entry_point("dataservice.cli", "inspect", out, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["sft"]["overlong_at_build"]


def test_drop_is_the_default_and_leaves_out_every_longer_example(tmp_path, corpus):
    exs = examples(corpus)
    short = [e for e in exs if e.ids.size <= LIMIT]
    assert 0 < len(short) < len(exs)
    manifest = build(corpus, tmp_path / "drop", None)  # no --overlong: drop
    docs = stored(tmp_path / "drop")
    assert sorted(docs) == sorted((e.ids.tolist(), mask_of(e).tolist()) for e in short)
    assert manifest["counts"]["overlong_dropped"] == len(exs) - len(short)
    assert manifest["build"]["overlong"] == "drop" and manifest["build"]["max_example_tokens"] == LIMIT
    assert inspect(tmp_path / "drop") == {"max_example_tokens": LIMIT, "mode": "drop", "dropped": len(exs) - len(short),
                                          "split": 0, "truncated": 0}
    human = run_entry_point("dataservice.cli", "inspect", tmp_path / "drop").stdout
    assert f"examples over {LIMIT} tokens (--overlong drop): {len(exs) - len(short)} dropped, 0 split" in human


def test_split_stores_pieces_of_at_most_the_limit_with_their_own_targets(tmp_path, corpus):
    exs = examples(corpus)
    want = []
    for e in exs:
        mask = mask_of(e)
        for start in range(0, e.ids.size, LIMIT):
            if mask[start:start + LIMIT].any():  # a piece with no answer token is left out
                want.append((e.ids[start:start + LIMIT].tolist(), mask[start:start + LIMIT].tolist()))
    manifest = build(corpus, tmp_path / "split", "split")
    docs = stored(tmp_path / "split")
    assert sorted(docs) == sorted(want) and max(len(t) for t, _ in docs) == LIMIT
    over = sum(e.ids.size > LIMIT for e in exs)
    assert manifest["counts"]["overlong_split"] == over and len(docs) > len(exs)
    assert inspect(tmp_path / "split")["split"] == over


def test_truncate_prompt_keeps_the_final_answer_whole_and_cuts_the_prompt_from_the_left(tmp_path, corpus):
    exs = examples(corpus)
    want, dropped, truncated, cut_answers = [], 0, 0, 0
    for e in exs:
        mask = mask_of(e)
        if e.ids.size <= LIMIT:
            want.append((e.ids.tolist(), mask.tolist()))
            continue
        final = int(e.target_runs[-1, 0])
        if e.ids.size - final > LIMIT:
            dropped += 1
            continue
        truncated += 1
        cut = e.ids.size - LIMIT
        kept = mask[cut:].copy()
        for a, b in e.target_runs.tolist():
            if a < cut < b:  # an earlier answer missing its start: context, not a target
                kept[:b - cut] = False
                cut_answers += 1
        want.append((e.ids[cut:].tolist(), kept.tolist()))
    assert dropped and truncated and cut_answers  # each case of the rule occurs
    manifest = build(corpus, tmp_path / "trunc", "truncate-prompt")
    docs = stored(tmp_path / "trunc")
    assert sorted(docs) == sorted(want)
    assert (manifest["counts"]["overlong_truncated"], manifest["counts"]["overlong_dropped"]) == (truncated, dropped)
    assert inspect(tmp_path / "trunc") == {"max_example_tokens": LIMIT, "mode": "truncate-prompt", "dropped": dropped,
                                           "split": 0, "truncated": truncated}
    # The final answer of every stored example is its end: the completion and eos, trained on.
    eos = ByteTokenizer.eos_id
    assert all(t[-1] == eos and m[-1] for t, m in docs)


def test_without_a_limit_nothing_changes_and_overlong_alone_is_refused(tmp_path, corpus):
    out = build_dataset([corpus], tmp_path / "free")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == len(examples(corpus)) and manifest["build"]["max_example_tokens"] is None
    assert_one_line(run_entry_point("dataservice.cli", "build", corpus, "-o", tmp_path / "x", "--overlong", "split"),
                    "tessera-data build: error:", "--overlong split needs --max-example-tokens N")
    assert_one_line(run_entry_point("dataservice.cli", "build", corpus, "-o", tmp_path / "x", "--max-example-tokens", "-3"),
                    "tessera-data build: error:", "--max-example-tokens -3 must be >= 1")
