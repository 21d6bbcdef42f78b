"""Multi-token prediction (model.mtp_layers, train.mtp_loss_weight), in process.

- The depths' inputs and targets of a packed row, built by hand: every position of every
  depth checked against positions written out from the row's documents (exact).
- The plain model's MTP losses against an independent reference on the same weights: each
  document run alone, its tokens shifted by hand, a depth's block fed only the positions that
  have a next token (fp32; packed vs per-document attention and the batching of the GEMMs:
  rel 1e-5). A negative control: the same reference shifted one token less differs.
- The checkpoint's names: the MTP modules under `mtp.{k}`, with one embedding and one head.
- Config errors: a negative depth count or weight is one line, exit 2.
End to end through tessera-train under every layout: tests/test_train_mtp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.config import ModelConfig
from core.layers import AttentionMeta, rotary_tables
from core.train.data import mtp_inputs
from core.train.loss import cross_entropy_sum
from core.train.model import build_model
from dataservice.packing import IGNORE_INDEX
from tests.support.cli import assert_one_line, run_entry_point
from tests.support.runs import CONFIG

IGNORE = IGNORE_INDEX


def _packed(lengths: list[int], vocab: int, seed: int = 0, piece_next: dict[int, int] | None = None):
    """Documents of `lengths` back to back: (tokens, labels, cu_seqlens). Labels are the next
    token in the document, IGNORE at its last; `piece_next` {segment: label} gives a segment's
    last token the next piece's first token (a document split over rows)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    labels = []
    for s, doc in enumerate(docs):
        lab = torch.full_like(doc, IGNORE)
        lab[:-1] = doc[1:]
        if piece_next and s in piece_next:
            lab[-1] = piece_next[s]
        labels.append(lab)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return torch.cat(docs), torch.cat(labels), cu


def test_targets_are_masked_at_every_document_boundary():
    # Segments: a document of 4, a piece of 5 whose document goes on in another row (its last
    # label is that row's first token, 7), a document of 1, a prompt-masked document of 3, and
    # 3 tokens of padding (labels all IGNORE).
    tokens = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24, 30, 40, 41, 42, 0, 0, 0])
    labels = torch.tensor([11, 12, 13, IGNORE, 21, 22, 23, 24, 7, IGNORE, IGNORE, 42, IGNORE, IGNORE, IGNORE, IGNORE])
    cu = torch.tensor([0, 4, 9, 10, 13, 16], dtype=torch.int32)
    got_tokens, got_labels = mtp_inputs(tokens, labels, cu, depths=3)
    P = 0  # the padding token
    want_tokens = [
        [11, 12, 13, P, 21, 22, 23, 24, P, P, 41, 42, P, 0, 0, P],
        [12, 13, P, P, 22, 23, 24, P, P, P, 42, P, P, 0, P, P],
        [13, P, P, P, 23, 24, P, P, P, P, P, P, P, P, P, P],
    ]
    want_labels = [
        [12, 13, IGNORE, IGNORE, 22, 23, 24, 7, IGNORE, IGNORE, 42, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE],
        [13, IGNORE, IGNORE, IGNORE, 23, 24, 7, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE],
        [IGNORE, IGNORE, IGNORE, IGNORE, 24, 7, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE,
         IGNORE],
    ]
    assert got_tokens.tolist() == want_tokens
    assert got_labels.tolist() == want_labels
    # Valid positions of depth k: i with i..i+k+1 in one segment and label i+k+1 counted.
    segment = torch.repeat_interleave(torch.arange(5), cu.diff().long())
    for k in range(3):
        valid = [i for i in range(16) if i + k + 1 < 16 and segment[i + k + 1] == segment[i]
                 and labels[i + k + 1] != IGNORE]
        assert (got_labels[k] != IGNORE).nonzero().flatten().tolist() == valid, k
    # Depths beyond the row: nothing valid, nothing out of range.
    deep_tokens, deep_labels = mtp_inputs(tokens[:3], labels[:3], torch.tensor([0, 3]), depths=4)
    assert deep_tokens.shape == (4, 3) and (deep_labels[2:] == IGNORE).all()


CFG = dict(vocab_size=40, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, mtp_layers=2)


def _reference_mtp_sums(model, tokens, cu, depths, lag: int = 0):
    """Each document alone: the main trunk by hand, then depth k fed h[:n-k-1] and the embeddings
    of tokens k+1..n-1, trained on tokens k+2..n-1. `lag` shifts the inputs one token less
    (the negative control)."""
    sums, counts = [0.0] * depths, [0] * depths
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        doc = tokens[start:end]
        n = doc.numel()
        pos = torch.arange(n)

        def run(layer, x, m):
            meta = AttentionMeta(cu_seqlens=torch.tensor([0, m], dtype=torch.int32), max_seqlen=m, doc_lengths=(m,))
            rope = rotary_tables(pos[:m], model.rope_inv_freq, model.rope_scale)
            return layer(x, rope, meta)

        h = model.tok_embeddings(doc)
        for layer in model.layers.values():
            h = run(layer, h, n)
        for k, module in enumerate(model.mtp):
            m = n - (k + 1) + lag  # positions with a shifted input token
            if m <= 1 - lag:
                break
            e = model.tok_embeddings(doc[k + 1 - lag:k + 1 - lag + m])
            x = module.eh_proj(torch.cat((module.enorm(e), module.hnorm(h[:m])), dim=-1))
            h = run(module.block, x, m)
            logits = model.output(module.norm(h))
            targets = doc[k + 2 - lag:]
            sums[k] += float(F.cross_entropy(logits[:targets.numel()], targets, reduction="sum"))
            counts[k] += targets.numel()
    return sums, counts


def test_plain_model_mtp_loss_equals_a_per_document_reference():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG), seed=3).double()
    lengths = [5, 9, 2, 1, 8, 3]
    tokens, labels, cu = _packed(lengths, CFG["vocab_size"], seed=1)
    meta = AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths), doc_lengths=tuple(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    mtp_tokens, mtp_labels = mtp_inputs(tokens, labels, cu, depths=2)
    with torch.no_grad():
        heads = model.heads(tokens, pos, meta, mtp_tokens)
        assert len(heads) == 3
        # The main head is the model's own forward.
        assert torch.allclose(model.output(heads[0]), model(tokens, pos, meta), rtol=0, atol=0)
        got = [cross_entropy_sum(model.output(h), mtp_labels[k]) for k, h in enumerate(heads[1:])]
        want, counts = _reference_mtp_sums(model, tokens, cu, 2)
        wrong, _ = _reference_mtp_sums(model, tokens, cu, 2, lag=1)
    for k in range(2):
        assert int(got[k][1]) == counts[k] == sum(max(n - k - 2, 0) for n in lengths)
        assert float(got[k][0]) == pytest.approx(want[k], rel=1e-5), (k, got, want)
        assert abs(float(got[k][0]) - wrong[k]) > 1e-2 * abs(want[k]), (k, got, wrong)


def test_checkpoint_names_hold_the_mtp_modules_once_and_share_embedding_and_head():
    model = build_model(ModelConfig(**CFG), seed=3)
    names = [n for n, _ in model.named_parameters()]
    assert names.count("tok_embeddings.weight") == 1 and "output.weight" in names
    assert not any(n.startswith("mtp.") and ("embed" in n or "output" in n) for n in names)
    for k in range(2):
        for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight",
                     "block.attention.wq.weight", "block.feed_forward.w1.weight"):
            assert f"mtp.{k}.{part}" in names
        assert model.mtp[k].block.layer_id == CFG["num_layers"] + k
    assert model.mtp[0].eh_proj.weight.shape == (CFG["dim"], 2 * CFG["dim"])
    # The main model's initial weights do not depend on the MTP modules after it.
    plain = build_model(ModelConfig(**{**CFG, "mtp_layers": 0}), seed=3)
    mtp = dict(model.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(param, mtp[name]), name


@pytest.mark.parametrize("item, words", [
    ("model.mtp_layers=-1", ["model.mtp_layers=-1", ">= 0"]),
    ("train.mtp_loss_weight=-0.5", ["train.mtp_loss_weight=-0.5", ">= 0"]),
])
def test_negative_mtp_settings_exit_2_with_one_line(tmp_path, item, words):
    proc = run_entry_point("core.train.cli", "--config", CONFIG, "--set", item, "--set",
                           f"train.run_dir={tmp_path / 'run'}", "--set", "data.dataset=/nonexistent", "--print-config")
    assert_one_line(proc, *words)
