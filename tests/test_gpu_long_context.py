"""On one GPU (an H200: each test under a minute and ~45 GB): a document of a million tokens
through Tessera's attention paths, and the Triton kernels on tensors past 2^31 elements.

- `varlen_attention` with doc_lengths, forward and backward: one document of 2^20 tokens (8
  heads x 128, the dense cuDNN path), one of 2^20 + 1000 (grouped-query 8/2: lengths that are
  no power of two), and a packed row of 700 + (2^20 + 300) tokens (the split by length: the short
  document through flash varlen, the long one through cuDNN padded past the row's end).
- The ring's block kernels (cuDNN and FlashAttention varlen) on 512K-token blocks: the causal
  diagonal block, and a non-causal one of 256K queries against 512K keys (a second chunk's).
- The Triton kernels on tensors of more than 2^31 elements, against torch on sampled rows.

References are float64 and O(rows x T): the out, LSE and dq of the first and last 64 queries of a
document against all of their keys (keys in chunks), and, causally, the dk and dv of the last 64
keys, which only the last 64 queries see. Tolerance for bf16 inputs: 2e-2 of the largest
reference magnitude (tests/test_gpu_ring_blocks.py's), LSE 1e-2 absolute."""

from __future__ import annotations

import math

import pytest
import torch

from core.attention import varlen_attention
from core.kernels import fused
from core.kernels.adamw import AdamWTables, multi_tensor_adamw
from core.kernels.cross_entropy import cross_entropy_rows_sum
from core.kernels.embedding import add_embedding_grad_
from core.kernels.topk import topk_indices
from core.parallel import ring_attention as ra

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MIB = 2**20
PAST = 2**31  # tensors of more elements than an int32 offset reaches
ROWS = 64  # query rows checked at each end of a document
KEY_CHUNK = 65536
RTOL_BF16 = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _inputs(t: int, hq: int, hkv: int, d: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, s=1.0: (torch.randn(t, h, d, device="cuda", generator=g) * s).to(torch.bfloat16)  # noqa: E731
    # queries scaled up so that each attends to a few keys, not a near-uniform mean of a million
    return make(hq, 2.0), make(hkv), make(hkv), make(hq)


def _key_chunks(q_rows, k, v, first: int, causal: bool, scale: float, key_end: int):
    """fp64 scores [H, R, C] of query rows (positions first..first+R-1 in the document) against
    each chunk of keys [0, key_end), with the chunk's keys and values (heads repeated for GQA)."""
    group = q_rows.shape[1] // k.shape[1]
    pos = torch.arange(first, first + q_rows.shape[0], device=k.device)
    for c0 in range(0, key_end, KEY_CHUNK):
        c1 = min(key_end, c0 + KEY_CHUNK)
        kc = k[c0:c1].double().repeat_interleave(group, dim=1)
        vc = v[c0:c1].double().repeat_interleave(group, dim=1)
        s = torch.einsum("rhd,chd->hrc", q_rows, kc) * scale
        if causal:
            s.masked_fill_(torch.arange(c0, c1, device=k.device)[None, None, :] > pos[None, :, None], float("-inf"))
        yield s, kc, vc


def _reference_rows(q, k, v, dout, rows: slice, causal: bool, scale: float):
    """fp64 (out [R, H, Dv], lse [H, R], dq [R, H, D], delta [H, R]) of one document's query rows."""
    qr, do = q[rows].double(), dout[rows].double()
    key_end = rows.stop if causal else k.shape[0]
    lse = torch.full((q.shape[1], qr.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    for s, _, _ in _key_chunks(qr, k, v, rows.start, causal, scale, key_end):
        lse = torch.logaddexp(lse, s.logsumexp(-1))
    out = torch.zeros(qr.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    for s, _, vc in _key_chunks(qr, k, v, rows.start, causal, scale, key_end):
        out += torch.einsum("hrc,chd->rhd", (s - lse[..., None]).exp(), vc)
    delta = (do * out).sum(-1).t()
    dq = torch.zeros_like(qr)
    for s, kc, vc in _key_chunks(qr, k, v, rows.start, causal, scale, key_end):
        p = (s - lse[..., None]).exp()
        ds = p * (torch.einsum("rhd,chd->hrc", do, vc) - delta[..., None])
        dq += torch.einsum("hrc,chd->rhd", ds, kc) * scale
    return out, lse, dq, delta


def _reference_tail_kv(q, k, v, dout, rows: slice, lse, delta, scale: float):
    """fp64 (dk, dv) of the keys at `rows`, the document's last positions: causally only the
    queries at those positions see them."""
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    qr, do = q[rows].double(), dout[rows].double()
    kr = k[rows].double().repeat_interleave(group, dim=1)
    vr = v[rows].double().repeat_interleave(group, dim=1)
    s = torch.einsum("rhd,chd->hrc", qr, kr) * scale
    n = qr.shape[0]
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)[None], float("-inf"))
    p = (s - lse[..., None]).exp()
    ds = p * (torch.einsum("rhd,chd->hrc", do, vr) - delta[..., None])
    dk = (torch.einsum("hrc,rhd->chd", ds, qr) * scale).view(n, hkv, group, -1).sum(2)
    dv = torch.einsum("hrc,rhd->chd", p, do).view(n, hkv, group, -1).sum(2)
    return dk, dv


def _check_document(q, k, v, dout, out, dq, dk, dv, scale: float, lse=None, causal: bool = True) -> None:
    """The first and last ROWS queries of one document (views of it), and causally the last keys."""
    t = q.shape[0]
    for rows in (slice(0, min(ROWS, t)), slice(max(0, t - ROWS), t)):
        ref_out, ref_lse, ref_dq, delta = _reference_rows(q, k, v, dout, rows, causal, scale)
        assert torch.isfinite(out[rows]).all() and torch.isfinite(dq[rows]).all()
        assert _rel(out[rows], ref_out) < RTOL_BF16, ("out", rows, _rel(out[rows], ref_out))
        assert _rel(dq[rows], ref_dq) < RTOL_BF16, ("dq", rows, _rel(dq[rows], ref_dq))
        if lse is not None:
            assert float((lse[:, rows].double() - ref_lse).abs().max()) < 1e-2, ("lse", rows)
        if causal and rows.stop == t:
            ref_dk, ref_dv = _reference_tail_kv(q, k, v, dout, rows, ref_lse, delta, scale)
            assert _rel(dk[rows], ref_dk) < RTOL_BF16, ("dk", _rel(dk[rows], ref_dk))
            assert _rel(dv[rows], ref_dv) < RTOL_BF16, ("dv", _rel(dv[rows], ref_dv))


# ---- varlen_attention: one document of a million tokens, and a packed row --------------------


@pytest.mark.parametrize("lengths, hq, hkv", [((MIB,), 8, 8), ((MIB + 1000,), 8, 2), ((700, MIB + 300), 8, 8)],
                         ids=["2^20-mha", "2^20+1000-gqa", "packed-700+2^20+300"])
def test_million_token_documents_through_varlen_attention(lengths, hq, hkv):
    t, d = sum(lengths), 128
    q, k, v, dout = _inputs(t, hq, hkv, d, seed=len(lengths) + hkv)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    torch.cuda.reset_peak_memory_stats()
    out = varlen_attention(*leaves, cu, max(lengths), doc_lengths=lengths)
    out.backward(dout)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    dq, dk, dv = (x.grad for x in leaves)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), name
    # Linear in T: inputs, their copies, outputs, gradients and the split's padded windows, a few
    # dozen GiB at 2^20 tokens (a single [T, T] bf16 buffer would be 2 TiB: an OOM, not a pass).
    assert peak_gib < 80, peak_gib
    scale = d ** -0.5
    start = 0
    for n in lengths:
        doc = slice(start, start + n)
        _check_document(q[doc], k[doc], v[doc], dout[doc], out[doc].detach(), dq[doc], dk[doc], dv[doc], scale)
        start += n


# ---- the ring's block kernels on 512K-token blocks --------------------------------------------


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [True, False], ids=["diagonal-512k", "second-chunk-256k-x-512k"])
def test_ring_block_kernels_on_512k_token_blocks(kernel, causal, monkeypatch):
    monkeypatch.setenv(ra.RING_KERNEL_ENV, "flash" if kernel == "flash" else "auto")
    tk = 2**19
    tq = tk if causal else tk // 2
    hq, hkv, d = 8, 2, 128
    q, _, _, dout = _inputs(tq, hq, hkv, d, seed=11)
    _, k, v, _ = _inputs(tk, hq, hkv, d, seed=12)
    cq = torch.tensor([0, tq], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, tk], dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    out, lse = ra.block_forward(q, k, v, cq, ck, tq, tk, causal, scale, 1)
    final = out.to(q.dtype)
    dq, dk, dv = ra.block_backward(dout, q, k, v, final, lse, cq, ck, tq, tk, causal, scale, 1)
    assert lse.shape == (hq, tq)
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), (kernel, name)
    _check_document(q, k, v, dout, out, dq, dk, dv, scale, lse=lse, causal=causal)


# ---- Triton kernels past 2^31 elements ---------------------------------------------------------


def _sampled(n: int) -> torch.Tensor:
    return torch.tensor([0, 1, n // 3, n // 2, n - 2, n - 1], device="cuda")


def test_swiglu_past_2_pow_31_elements():
    t, h = MIB + 3, 2056  # t * h = 2.156e9
    assert t * h > PAST
    a = torch.randn(t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    b = torch.randn(t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    out = fused.swiglu(a, b)
    grad = torch.randn_like(out)
    out.backward(grad)
    rows = _sampled(t)
    x, y, g = a.detach()[rows].float(), b.detach()[rows].float(), grad[rows].float()
    sig = torch.sigmoid(x)
    torch.testing.assert_close(out.detach()[rows].float(), x * sig * y, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(b.grad[rows].float(), g * x * sig, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(a.grad[rows].float(), g * y * (sig + x * sig * (1 - sig)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_fused_past_2_pow_31_elements(weighted):
    t, h = MIB + 3, 1028  # h13 [t, 2h]: 2.156e9 elements
    assert t * 2 * h > PAST
    h13 = torch.randn(t, 2 * h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.rand(t, device="cuda", dtype=torch.float32).requires_grad_() if weighted else None
    out = fused.swiglu_fused(h13, w)
    grad = torch.randn_like(out)
    out.backward(grad)
    rows = _sampled(t)
    gate, up = h13.detach()[rows].float().chunk(2, dim=-1)
    g = grad[rows].float()
    scale = w.detach()[rows, None] if weighted else 1.0
    sig = torch.sigmoid(gate)
    silu = gate * sig
    torch.testing.assert_close(out.detach()[rows].float(), silu * up * scale, rtol=2e-2, atol=2e-2)
    gs = g * scale
    want = torch.cat([gs * up * (sig + silu * (1 - sig)), gs * silu], dim=-1)
    torch.testing.assert_close(h13.grad[rows].float(), want, rtol=2e-2, atol=2e-2)
    if weighted:
        torch.testing.assert_close(w.grad[rows], (g * silu * up).sum(-1), rtol=1e-2, atol=1e-2)


def test_accumulate_fp32_past_2_pow_31_elements():
    n = PAST + 4099
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.ones(n, device="cuda")
    fused.accumulate_fp32_(dst, src, copy=False)
    at = torch.tensor([0, PAST - 1, PAST, PAST + 4098], device="cuda")
    assert torch.equal(dst[at], 1 + src[at].float())


def test_cross_entropy_past_2_pow_31_logits():
    t, vocab = 20000, 128256  # 2.57e9 logits
    assert t * vocab > PAST
    logits = torch.randn(t, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (t,), device="cuda")
    labels[5] = -100
    loss = cross_entropy_rows_sum(logits, labels, -100)
    want = sum(torch.nn.functional.cross_entropy(logits.detach()[i:i + 2000].float(), labels[i:i + 2000],
                                                 ignore_index=-100, reduction="sum") for i in range(0, t, 2000))
    assert abs(float(loss) - float(want)) < 1e-4 * float(want), (float(loss), float(want))
    loss.backward()
    rows = torch.tensor([0, 5, t // 2, t - 1], device="cuda")
    x = logits.detach()[rows].float()
    expect = torch.softmax(x, -1)
    expect[torch.arange(4), labels[rows].clamp(min=0)] -= 1
    expect[1] = 0  # the ignored row
    torch.testing.assert_close(logits.grad[rows].float(), expect, rtol=2e-2, atol=1e-4)


def test_moe_combine_and_dispatch_past_2_pow_31_elements():
    t, k, dim = MIB, 2, 1032  # [t * k, dim] rows: 2.16e9 elements
    assert t * k * dim > PAST
    order = torch.randperm(t * k, device="cuda")
    inverse = fused.inverse_of(order, t * k).view(t, k)
    rows = torch.randn(t * k, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weights = torch.rand(t, k, device="cuda").requires_grad_()
    out = fused.gather_weighted_sum(rows, inverse, weights)
    grad = torch.randn_like(out)
    out.backward(grad)
    tokens = _sampled(t)
    picked = rows.detach()[inverse[tokens]].float()  # [s, k, dim]
    torch.testing.assert_close(out.detach()[tokens].float(), (picked * weights.detach()[tokens, :, None]).sum(1),
                               rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(rows.grad[inverse[tokens]].float(),
                               weights.detach()[tokens, :, None] * grad[tokens, None, :].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weights.grad[tokens], (picked * grad[tokens, None, :].float()).sum(-1),
                               rtol=1e-2, atol=1e-2)
    del rows, out
    x = torch.randn(t, dim, device="cuda", dtype=torch.bfloat16)
    permuted = fused.permute_rows(x, inverse, t * k)
    assert torch.equal(permuted[inverse[tokens]], x[tokens, None, :].expand(-1, k, -1))


def test_embedding_grad_past_2_pow_31_table_elements():
    vocab, dim = 2 * MIB + 8, 1024  # fp32 table of 2.15e9 elements
    assert vocab * dim > PAST
    table = torch.zeros(vocab, dim, device="cuda")
    tokens = torch.randint(0, vocab, (MIB,), device="cuda")
    tokens[:100] = vocab - 1  # a run longer than CHUNK, at the table's last row
    grad = torch.randn(MIB, dim, device="cuda", dtype=torch.bfloat16)
    add_embedding_grad_(table, tokens, grad)
    for r in [vocab - 1, *tokens[-3:].tolist()]:
        want = grad[tokens == r].double().sum(0)
        torch.testing.assert_close(table[r].double(), want, rtol=1e-4, atol=1e-3)


def test_topk_past_2_pow_31_scores():
    rows, width, k = 2 * MIB + 8, 1024, 8
    assert rows * width > PAST
    scores = torch.randn(rows, width, device="cuda")
    got = topk_indices(scores, k)
    sample = _sampled(rows)
    want = torch.topk(scores[sample], k, dim=-1).indices
    assert torch.equal(got[sample].sort(-1).values, want.sort(-1).values)


def test_adamw_on_a_tensor_past_2_pow_31_elements():
    n = PAST + 1027
    master = torch.randn(n, device="cuda")
    grad = torch.randn(n, device="cuda")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    at = torch.tensor([0, PAST - 1, PAST, n - 1], device="cuda")
    p0, g0 = master[at].double(), grad[at].double()
    lr, (b1, b2), eps, decay = 1e-3, (0.9, 0.95), 1e-8, 0.1
    multi_tensor_adamw(AdamWTables(), [master], [grad], [m], [v], [out], [decay], lr=lr, betas=(b1, b2), eps=eps,
                       step=1, grad_scale=None)
    m1, v1 = (1 - b1) * g0, (1 - b2) * g0 * g0
    want = p0 * (1 - lr * decay) - lr / (1 - b1) * m1 / (v1.sqrt() / math.sqrt(1 - b2) + eps)
    torch.testing.assert_close(master[at].double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[at].float(), master[at].to(torch.bfloat16).float())
