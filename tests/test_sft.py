"""Fine-tuning data: records rendered with loss masks, masks stored in the shards and carried
into the labels through splitting, packing, blending, dynamic-CP plans and resume tokens.

References: the plain template's documented layout (exact tokens); transformers'
`apply_chat_template` for templated rendering (same text, and the prompt tokens a model sees at
inference); for the labels, the documents themselves: position t's label is the next token of
the same document where that token is a target, -100 elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dataservice.build import BuildError, build_dataset, make_corpus
from dataservice.client import DataClient
from dataservice.cp_plan import H200_COST
from dataservice.cp_stream import CPRequest, StepCache
from dataservice.packing import IGNORE_INDEX
from dataservice.plan import StreamPlan, rows_for
from dataservice.sft import ExampleRenderer, find_chat_template
from dataservice.shards import ShardedDataset
from dataservice.tokenizer import ByteTokenizer, load_tokenizer, train_tiny_tokenizer
from tests.support.service import start_server
from tests.support.cli import run_process
from tests.support.sft import CHATML_TEMPLATE, HEADER_TEMPLATE, SPECIALS, conversations

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello world?"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "and the lazy dog?"},
    {"role": "assistant", "content": "jumps over naïve 東京"},
]


def tokenizer_folder(tmp: Path, template: str) -> Path:
    folder = tmp / "tok"
    train_tiny_tokenizer(folder, specials=SPECIALS, vocab_size=300)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<pad>",
         "chat_template": template}))
    return folder


def targets_text(tok, example) -> list[str]:
    return [tok.decode(example.ids[a:b]) if tok.kind == "byte" else
            tok._tok.decode(example.ids[a:b].tolist(), skip_special_tokens=False) for a, b in example.target_runs]


def test_plain_template_for_both_record_kinds():
    tok = ByteTokenizer()
    renderer = ExampleRenderer(tok, find_chat_template("byte"))
    ex = renderer.render({"messages": CONVERSATION})
    eos = [tok.eos_id]
    assert ex.ids.tolist() == (list("<|system|>\nBe brief.\n<|user|>\nhello world?\n<|assistant|>\nthe quick brown fox"
                                    .encode()) + eos + list("<|user|>\nand the lazy dog?\n<|assistant|>\njumps over naïve 東京"
                                                            .encode()) + eos)
    # The assistant contents and their eos are the targets, nothing else.
    runs = [(a, b) for a, b in ex.target_runs.tolist()]
    assert [bytes(ex.ids[a:b - 1].astype(np.uint8)).decode() for a, b in runs] == ["the quick brown fox",
                                                                                   "jumps over naïve 東京"]
    assert all(ex.ids[b - 1] == tok.eos_id for _, b in runs)
    pc = renderer.render({"prompt": "Q: sky? ", "completion": "blue"})
    assert pc.ids.tolist() == list(b"Q: sky? blue") + [tok.eos_id]
    assert pc.target_runs.tolist() == [[8, 13]]


@pytest.mark.parametrize("template", [HEADER_TEMPLATE, CHATML_TEMPLATE], ids=["header", "chatml"])
def test_chat_template_renders_as_transformers_and_trains_on_assistant_turns(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    folder = tokenizer_folder(tmp_path, template)
    tok = load_tokenizer(str(folder / "tokenizer.json"))
    chat = find_chat_template(str(folder / "tokenizer.json"))
    assert chat is not None and chat.source.endswith("tokenizer_config.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=template,
                                              bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    renderer = ExampleRenderer(tok, chat)
    for messages in (CONVERSATION, CONVERSATION[1:3]):
        ex = renderer.render({"messages": messages})
        full = hf.apply_chat_template(messages, tokenize=False)
        assert hf.decode(ex.ids.tolist()) == full
        end = "<|eot_id|>" if template is HEADER_TEMPLATE else "<|im_end|>\n"
        contents = [m["content"] for m in messages if m["role"] == "assistant"]
        assert targets_text(tok, ex) == [c + end for c in contents]
        # What precedes the first answer is exactly what a model is given at inference.
        first = messages.index(next(m for m in messages if m["role"] == "assistant"))
        prompt = hf.apply_chat_template(messages[:first], tokenize=False, add_generation_prompt=True)
        a = int(ex.target_runs[0, 0])
        assert ex.ids[:a].tolist() == tok.encode(prompt).tolist()
    pc = renderer.render({"prompt": "hello world?", "completion": "the quick brown fox"})
    end = "<|eot_id|>" if template is HEADER_TEMPLATE else "<|im_end|>\n"
    assert targets_text(tok, pc) == ["the quick brown fox" + end]


def test_build_counts_bad_records_records_the_format_and_strict_names_the_line(tmp_path):
    corpus = tmp_path / "mixed.jsonl"
    lines = [
        {"messages": CONVERSATION},
        {"prompt": "p", "completion": "c"},
        {"text": "a pretraining document"},
        {"messages": [{"role": "user", "content": "no answer"}]},  # no_assistant
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},  # unknown_role
        {"prompt": "p2", "completion": " "},  # empty_completion
        {"messages": [{"role": "user"}]},  # bad_example
        {"messages": CONVERSATION},  # duplicate
    ]
    corpus.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = build_dataset([corpus], tmp_path / "ds", max_skipped=0.9)
    m = json.loads((out / "manifest.json").read_text())
    c = m["counts"]
    assert (c["documents"], c["duplicates_dropped"]) == (3, 1)
    assert (c["no_assistant"], c["unknown_role"], c["empty_completion"], c["bad_example"]) == (1, 1, 1, 1)
    assert m["records"] == {"text": 1, "prompt_completion": 1, "messages": 2}
    assert m["chat_template"] == {"kind": "plain"} and m["loss_mask"]["target_tokens"] > 0
    with ShardedDataset.open(out, verify=True) as ds:
        assert ds.has_loss_mask
        text_doc = ds.read(2)
        assert ds.target_masks([2], [0], [len(text_doc)])[0].all()  # a document trains on every token
    with pytest.raises(BuildError, match=r"mixed.jsonl:4: no assistant"):
        build_dataset([corpus], tmp_path / "strict", strict=True)
    # A pretraining-only dataset has no mask and the same fingerprint as before masks existed.
    plain = build_dataset([make_corpus(tmp_path, 20)], tmp_path / "plain")
    pm = json.loads((plain / "manifest.json").read_text())
    assert "loss_mask" not in pm and pm["chat_template"] is None


@pytest.fixture(scope="module")
def sft_and_text(tmp_path_factory) -> tuple[Path, Path]:
    """An SFT dataset with answers long enough to be split over rows of 48 tokens, and a text one."""
    tmp = tmp_path_factory.mktemp("sft-data")
    rng = np.random.default_rng(5)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]

    def say(n):
        return " ".join(rng.choice(words, size=n).tolist())

    records = []
    for i in range(120):
        if i % 3 == 0:
            records.append({"prompt": f"{i}: {say(int(rng.integers(1, 12)))}", "completion": say(int(rng.integers(1, 30)))})
        else:
            turns = [{"role": "system", "content": f"s{i}"}] if i % 2 else []
            for _ in range(int(rng.integers(1, 4))):
                turns += [{"role": "user", "content": say(int(rng.integers(1, 8)))},
                          {"role": "assistant", "content": say(int(rng.integers(1, 20)))}]
            records.append({"messages": turns})
    path = tmp / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sft = build_dataset([path], tmp / "sft")
    text = build_dataset([make_corpus(tmp, 60, seed=9, max_len=200)], tmp / "text")
    return sft, text


def expected_labels(docs: dict[int, tuple[np.ndarray, np.ndarray]], batch, seq_len: int) -> np.ndarray:
    """Labels rebuilt from the documents: each segment is found in its document (by hash, and
    at the piece offset whose tokens it holds), then label t = next token if it is a target."""
    out = np.full(batch.labels.size, IGNORE_INDEX, np.int64)
    cu = batch.cu_seqlens.astype(np.int64)
    for s, h in enumerate(batch.doc_hashes.tolist()):
        if h == 0:
            continue
        tokens, mask = docs[h]
        a, b = cu[s], cu[s + 1]
        seg = batch.tokens[a:b]
        offsets = [o for o in range(0, tokens.size, seq_len) if np.array_equal(tokens[o:o + seg.size], seg)]
        assert len(offsets) == 1
        o = offsets[0]
        for i in range(seg.size):
            t = o + i + 1
            if t < tokens.size and mask[t]:
                out[a + i] = tokens[t]
    return out


def all_docs(paths) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    docs = {}
    for p in paths:
        with ShardedDataset.open(p) as ds:
            for d in range(len(ds)):
                t = ds.read(d).astype(np.int64)
                docs[int(ds.hashes[d])] = (t, ds.target_masks([d], [0], [t.size])[0])
    return docs


def test_labels_through_splitting_packing_and_blending(sft_and_text):
    sft, text = sft_and_text
    docs = all_docs([sft, text])
    seq_len = 48
    with ShardedDataset.open(sft) as a, ShardedDataset.open(text) as b:
        plan = StreamPlan([a, b], [0.5, 0.5], seed=3, seq_len=seq_len)
        anchor = plan.start_anchor()
        masked = 0
        for step in range(12):
            batch, anchor = plan.rows(rows_for(step, 0, 1, 4), anchor)
            assert np.array_equal(batch.labels, expected_labels(docs, batch, seq_len))
            masked += int(((batch.labels == IGNORE_INDEX) & (batch.tokens != plan.pad_id)).sum())
    assert masked > 0  # prompts were masked, not just document ends
    # Every target token of the documents a window holds is a label exactly once in its rows.
    with ShardedDataset.open(sft) as a:
        plan = StreamPlan([a], [1.0], seed=3, seq_len=seq_len)
        window = plan.window(plan.start_anchor())
        batch, _ = plan.rows(np.arange(window.num_rows), plan.start_anchor())
        starts = window.seg_doc[window.seg_offset == 0]  # each placement of a document has one first piece
        want = sum(int(docs[int(a.hashes[d])][1][1:].sum()) for d in starts.tolist())
        assert int((batch.labels != IGNORE_INDEX).sum()) == want


def test_resume_token_and_dynamic_cp_plans_keep_the_masks(sft_and_text):
    sft, _ = sft_and_text
    docs = all_docs([sft])
    # A dynamic-CP step carries each document with the labels it has in the packed rows.
    with ShardedDataset.open(sft) as a:
        plan = StreamPlan([a], [1.0], seed=4, seq_len=48)
        cp = CPRequest(index=0, num_ranks=4, token_budget=24, rows_per_step=8)
        step = StepCache(H200_COST).get(plan, 1, plan.start_anchor(), cp)
        for d in range(step.doc_len.size):
            s, n = int(step.doc_start[d]), int(step.doc_len[d])
            toks, mask = docs[int(step.doc_hashes[d])]
            seg = step.tokens[s:s + n]
            o = next(o for o in range(0, toks.size, 48) if np.array_equal(toks[o:o + n], seg))
            want = [toks[o + i + 1] if o + i + 1 < toks.size and mask[o + i + 1] else IGNORE_INDEX for i in range(n)]
            assert step.labels[s:s + n].tolist() == want
    srv, address = start_server([sft])
    try:
        kw = dict(dp_rank=0, dp_size=1, seq_len=48, micro_batch_size=2, seed=4)
        with DataClient(address, max_batches=6, **kw) as client:
            first = list(client)
        with DataClient(address, max_batches=3, resume_token=first[2].resume_token, **kw) as client:
            again = list(client)
        for x, y in zip(first[3:], again):
            assert np.array_equal(x.labels.numpy(), y.labels.numpy()) and np.array_equal(x.tokens.numpy(), y.tokens.numpy())
    finally:
        srv.stop(0)


def test_no_loss_mask_keeps_the_rendering_and_trains_on_every_token(tmp_path, sft_and_text):
    sft, _ = sft_and_text
    source = json.loads((sft / "manifest.json").read_text())["build"]["inputs"]
    plain = build_dataset(source, tmp_path / "all-targets", loss_mask=False)
    manifest = json.loads((plain / "manifest.json").read_text())
    assert "loss_mask" not in manifest and manifest["records"]["messages"] > 0
    with ShardedDataset.open(sft) as masked, ShardedDataset.open(plain) as unmasked:
        assert len(masked) == len(unmasked) and masked.has_loss_mask and not unmasked.has_loss_mask
        for d in range(len(masked)):
            tokens = unmasked.read(d)
            assert np.array_equal(masked.read(d), tokens)
            assert unmasked.target_masks([d], [0], [tokens.size])[0].all()


# ---- the build says which template it uses; inspect says what a fine-tuning set trains on ----

def test_a_tokenizer_without_a_chat_template_is_refused_not_silently_rendered_plain(tmp_path):
    folder = tmp_path / "tok"
    train_tiny_tokenizer(folder, specials=SPECIALS, vocab_size=300)  # no tokenizer_config.json, no template
    corpus = conversations(tmp_path / "conv.jsonl", 8, seed=2)
    tok = str(folder / "tokenizer.json")
    refused = run_process("dataservice.cli", "build", corpus, "-o", tmp_path / "out", "--tokenizer", tok, "-q")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"{corpus}:1 is a fine-tuning record, but the tokenizer {tok} has no chat template" in refused.stderr
    assert "--chat-template FILE" in refused.stderr and "--chat-template plain" in refused.stderr
    assert not (tmp_path / "out").exists()
    text = tmp_path / "text.jsonl"  # pretraining text needs no template
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    assert run_process("dataservice.cli", "build", text, "-o", tmp_path / "t", "--tokenizer", tok, "-q").returncode == 0
    plain = run_process("dataservice.cli", "build", corpus, "-o", tmp_path / "p", "--tokenizer", tok,
                        "--chat-template", "plain", "-q")
    assert plain.returncode == 0 and "; chat template plain," in plain.stderr, plain.stderr
    (tmp_path / "t.jinja").write_text(CHATML_TEMPLATE)
    templated = run_process("dataservice.cli", "build", corpus, "-o", tmp_path / "j", "--tokenizer", tok,
                            "--chat-template", tmp_path / "t.jinja", "-q")
    assert templated.returncode == 0 and f"; chat template {tmp_path / 't.jinja'} (sha256 " in templated.stderr


def test_inspect_counts_prompt_and_response_tokens_and_the_overlong_examples(tmp_path):
    corpus = conversations(tmp_path / "conv.jsonl", 60, seed=4)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain document {i}"}) + "\n" for i in range(5)))
    out = build_dataset([corpus, text], tmp_path / "sft")
    # The reference: the records rendered again, here, with the plain template.
    renderer = ExampleRenderer(ByteTokenizer(), None)
    examples = [renderer.render(json.loads(line)) for line in corpus.read_text().splitlines()]
    response = sum(int((e.target_runs[:, 1] - e.target_runs[:, 0]).sum()) for e in examples)
    prompt = sum(len(e.ids) for e in examples) - response
    over = sum(len(e.ids) > 100 for e in examples)
    assert 0 < over < len(examples)
    proc = run_process("dataservice.cli", "inspect", out, "--json", "--seq-len", "100")
    assert proc.returncode == 0, proc.stderr
    sft = json.loads(proc.stdout)["sft"]
    assert (sft["examples"], sft["documents"]) == (60, 5)
    assert (sft["prompt_tokens"], sft["response_tokens"], sft["overlong_examples"]) == (prompt, response, over)
    total = json.loads((out / "manifest.json").read_text())["total_tokens"]
    text_tokens = total - prompt - response  # every token of a pretraining document is trained on
    assert sft["trained_share"] == pytest.approx((response + text_tokens) / total, abs=1e-4)
    human = run_process("dataservice.cli", "inspect", out, "--seq-len", "100").stdout
    assert "fine-tuning  60 examples (text 5, prompt_completion 15, messages 45), chat template plain" in human
    assert f"over-long  {over} examples longer than 100 tokens" in human
    plain_text = build_dataset([text], tmp_path / "text")
    assert "fine-tuning" not in run_process("dataservice.cli", "inspect", plain_text).stdout
