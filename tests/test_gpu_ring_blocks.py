"""On one GPU: the ring's block kernels (cuDNN SDPA for equal documents, FlashAttention varlen
otherwise) against a float64 reference, used the way the ring uses them: a query block's
keys come in two blocks whose partials merge by LSE, and each block's backward is fed the
*merged* output and LSE. bf16 inputs: 2e-2 relative (max error over the max magnitude)."""

from __future__ import annotations

import pytest
import torch

from core.parallel import ring_attention as ra

pytestmark = pytest.mark.gpu
RTOL_BF16 = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _per_doc(docs: int, length: int) -> torch.Tensor:
    return torch.arange(0, (docs + 1) * length, length, dtype=torch.int32, device="cuda")


def _halves(t: torch.Tensor, docs: int):
    """Each document's keys split in two: ([docs*S/2], [docs*S/2]) in document order."""
    v = t.view(docs, 2, t.shape[0] // (2 * docs), *t.shape[1:])
    return v[:, 0].reshape(-1, *t.shape[1:]).contiguous(), v[:, 1].reshape(-1, *t.shape[1:]).contiguous()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_merge_to_the_reference(kernel, causal, monkeypatch):
    monkeypatch.setenv(ra.RING_KERNEL_ENV, "flash" if kernel == "flash" else "auto")
    docs, sq, sk, hq, hkv, d = 3, 384, 512, 8, 2, 128  # GQA, Sq != Sk (non-causal), several docs
    if causal:
        sq = sk  # the ring's causal block is the diagonal one: equal lengths
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(docs * sq, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(docs * sk, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(docs * sk, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    dout = torch.randn(docs * sq, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = d ** -0.5
    cq, ck = _per_doc(docs, sq), _per_doc(docs, sk)

    # float64 reference over all keys of each document
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = ra._dense_fwd(q64, k64, v64, cq, ck, causal, scale)
    ref_dq, ref_dk, ref_dv = ra._dense_bwd(do64, q64, k64, v64, ref_out, ref_lse, cq, ck, causal, scale)

    if causal:  # one block, as the ring's diagonal step
        out, lse = ra.block_forward(q, k, v, cq, ck, sq, sk, True, scale, docs)
        dq, dk, dv = ra.block_backward(dout, q, k, v, out.to(q.dtype), lse, cq, ck, sq, sk, True, scale, docs)
    else:  # two key blocks per document, merged as the ring merges them
        (k1, k2), (v1, v2) = _halves(k, docs), _halves(v, docs)
        ch = _per_doc(docs, sk // 2)
        o1, l1 = ra.block_forward(q, k1, v1, cq, ch, sq, sk // 2, False, scale, docs)
        o2, l2 = ra.block_forward(q, k2, v2, cq, ch, sq, sk // 2, False, scale, docs)
        out, lse = ra._merge(o1.to(l1.dtype), l1, o2, l2)
        final = out.to(q.dtype)
        dq1, dk1, dv1 = ra.block_backward(dout, q, k1, v1, final, lse, cq, ch, sq, sk // 2, False, scale, docs)
        dq2, dk2, dv2 = ra.block_backward(dout, q, k2, v2, final, lse, cq, ch, sq, sk // 2, False, scale, docs)
        dq = dq1.float() + dq2.float()
        halves = lambda a, b: torch.stack((a.view(docs, -1, *a.shape[1:]), b.view(docs, -1, *b.shape[1:])), 1)  # noqa: E731
        dk = halves(dk1, dk2).reshape(k.shape)
        dv = halves(dv1, dv2).reshape(v.shape)

    assert lse.shape == ref_lse.shape
    assert float((lse.double() - ref_lse).abs().max()) < 1e-2
    for name, got, want in [("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)]:
        assert _rel(got, want) < RTOL_BF16, (kernel, causal, name, _rel(got, want))
