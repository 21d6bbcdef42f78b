"""The plain model: packed attention equals per-document attention (its config's errors: tests/test_config.py)."""

import pytest
import torch

from core.config import ModelConfig
from core.layers import AttentionMeta
from core.train.model import build_model
from core.attention import varlen_attention


def _meta(lengths):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths))


def test_packed_documents_do_not_attend_across_boundaries():
    # Reference: each document run alone as its own batch. Packed: all in one row.
    # fp32 on CPU; the only difference is summation order inside SDPA, so 1e-5.
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)
    model = build_model(cfg, seed=1)
    lengths = [5, 9, 1, 17]
    tokens = torch.randint(0, 64, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    packed = model(tokens, positions, _meta(lengths))
    start = 0
    for n in lengths:
        alone = model(tokens[start:start + n], torch.arange(n), _meta([n]))
        torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_reference_attention_matches_explicit_mask():
    torch.manual_seed(0)
    lengths = [3, 7, 7, 2]
    total = sum(lengths)
    q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    out = varlen_attention(q, k, v, _meta(lengths).cu_seqlens, max(lengths))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk.double()) / 8 ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    expected = torch.einsum("hts,shd->thd", scores.softmax(-1), vv.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_long_documents_split_off_to_dense_attention_exactly(device):
    # The split that sends long documents to dense SDPA (padded up to a bucket) and the rest to
    # one varlen call must equal one varlen call over all: outputs and q/k/v gradients. CPU:
    # float64, thresholds scaled down; GPU: bf16 through cuDNN + flash against flash alone.
    from core import attention

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # the last long document's padded window runs past the batch's end (a zero-padded copy);
    # short documents come in runs between long ones
    lengths = (5, 13, 1, 22, 7, 0, 9, 16, 16, 3, 11)
    min_doc, bucket, dtype, scale_up = 8, 4, torch.float64, 1
    if device == "cuda":  # the real thresholds; lengths scaled so the same documents are long,
        min_doc, bucket, dtype = attention.CUDNN_MIN_DOC, attention.CUDNN_BUCKET, torch.bfloat16
        scale_up = min_doc // 8 + 1  # and none a multiple of the bucket (the last one padded past the end)
    lengths = tuple(n * scale_up for n in lengths)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(device, torch.int32)
    total = sum(lengths)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(total, h, 16 if device == "cpu" else 128, dtype=dtype, device=device, generator=g)
               for h in (4, 2, 2))
    dout = torch.randn_like(q)
    results = []
    split = lambda *qkv: attention._split_by_length(*qkv, lengths, None, min_doc, bucket)  # noqa: E731
    for kind in ("one call", "split", "split recomputed"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if kind == "split":
            out = split(*leaves)
        elif kind == "split recomputed":  # as recompute_modules runs it: the graphs built again in the backward
            out = torch.utils.checkpoint.checkpoint(split, *leaves, use_reentrant=False)
        elif device == "cpu":
            out = attention._reference_varlen(*leaves, cu, None)
        else:
            out = attention._flash_varlen(*leaves, cu, max(lengths), None)
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in leaves)])
    tol = 1e-10 if device == "cpu" else 2e-2
    for got_all in results[1:]:
        for name, got, want in zip(("out", "dq", "dk", "dv"), got_all, results[0]):
            err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
            assert err < tol, (name, err)
    pieces = attention._split_plan(lengths, min_doc, bucket, q.device)
    long_docs = [p for p in pieces if p.cu is None]
    assert len({p.padded for p in long_docs}) >= 2 and pieces[-1].start + pieces[-1].padded > total  # padding,
    assert len(pieces) - len(long_docs) >= 3  # and past the end; runs of short documents between long ones


@pytest.mark.gpu
def test_flash_varlen_grouped_query_heads_match_repeated_heads():
    # k/v with fewer heads go to FlashAttention as they are (no repeated copies): the same
    # output and gradients as the heads repeated explicitly.
    from core import attention

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = (1000, 3096)
    cu = torch.tensor([0, *lengths]).cumsum(0).to("cuda", torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, 128, dtype=torch.bfloat16, device="cuda", generator=g) for h in (16, 4, 4))
    dout = torch.randn_like(q)
    results = []
    for repeat in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        qq, kk, vv = leaves
        if repeat:
            kk, vv = kk.repeat_interleave(4, dim=1), vv.repeat_interleave(4, dim=1)
        out = attention._flash_varlen(qq, kk, vv, cu, max(lengths), None)
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        assert err < 1e-2, (name, err)


def test_split_refuses_lengths_of_another_batch():
    from core import attention

    q = torch.randn(10, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="doc_lengths cover 12 tokens but q has 10"):
        attention._split_by_length(q, q, q, (4, 8), None, 4, 4)
