"""On one GPU: multi-head latent attention's head sizes (q/k 192, v 128: DeepSeek-V2/V3) through
every packed-attention path of `core.attention.varlen_attention` and through the ring's block
kernels, against a float64 reference of the same inputs. bf16 inputs: 2e-2 relative (max error over
the max magnitude), the bound of the other GPU attention tests.

Paths: one length for every document (dense SDPA, cuDNN first), short packed documents
(FlashAttention varlen, v zero-padded to 192 features), and a long document beside short ones
(cuDNN for the long one, varlen for the rest)."""

from __future__ import annotations

import pytest
import torch

from core import attention
from core.config import ModelConfig
from core.layers import AttentionMeta, rope_frequencies, rotary_tables
from core.mla import MLAttention
from core.parallel import ring_attention as ra

pytestmark = pytest.mark.gpu
RTOL_BF16 = 2e-2
HEADS, QK, V = 16, 192, 128


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _inputs(total: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(total, HEADS, QK, device="cuda", generator=gen)
    k = torch.randn(total, HEADS, QK, device="cuda", generator=gen)
    v = torch.randn(total, HEADS, V, device="cuda", generator=gen)
    grad = torch.randn(total, HEADS, V, device="cuda", generator=gen)
    return q, k, v, grad


def _run(q, k, v, grad, cu, max_len, doc_lengths, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = attention.varlen_attention(*leaves, cu, max_len, doc_lengths=doc_lengths)
    out.backward(grad.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("lengths", [[4096, 4096], [1000, 3000, 500, 3692], [6000, 700, 1492]],
                         ids=["uniform-sdpa", "packed-varlen", "long-cudnn-split"])
def test_mla_head_sizes_through_every_packed_path(lengths):
    total = sum(lengths)
    q, k, v, grad = _inputs(total, len(lengths))
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    want = _run(q, k, v, grad, cu.cpu(), max(lengths), tuple(lengths), torch.float64)  # exact per-length SDPA
    got = _run(q, k, v, grad, cu, max(lengths), tuple(lengths), torch.bfloat16)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        assert _rel(g, w) < RTOL_BF16, (name, _rel(g, w))


@pytest.mark.parametrize("docs", [0, 1], ids=["flash-blocks", "cudnn-blocks"])
def test_ring_block_kernels_take_narrower_value_heads(docs):
    """The ring's forward and backward block on one causal document against float64 autograd."""
    length = 4096
    q, k, v, grad = _inputs(length, 7)
    cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    scale = QK ** -0.5
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    out, lse = ra.block_forward(qb, kb, vb, cu, cu, length, length, True, scale, docs)
    grads = ra.block_backward(grad.bfloat16(), qb, kb, vb, out, lse, cu, cu, length, length, True, scale, docs)
    want = _run(q, k, v, grad, cu.cpu(), length, (length,), torch.float64)
    assert out.shape == (length, HEADS, V)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads[:3]), want):
        assert _rel(g, w) < RTOL_BF16, (name, _rel(g, w))


def test_mla_layer_in_bf16_follows_fp32():
    """The whole layer at V2-Lite's shape (no query latent) on packed documents: bf16 vs fp32."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=2048, num_heads=HEADS, attention="mla", q_lora_rank=0, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=V)
    layer = MLAttention(cfg).cuda()
    lengths = [5000, 2000, 1192]
    x = torch.randn(sum(lengths), cfg.dim, device="cuda") * 0.5
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    inv_freq, scale = rope_frequencies(cfg)
    rope = rotary_tables(positions, inv_freq.cuda(), scale)
    meta = AttentionMeta(torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).cuda(), max(lengths),
                         doc_lengths=tuple(lengths))
    want = layer(x, rope, meta)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = layer(x, rope, meta)
    assert _rel(got, want) < RTOL_BF16
