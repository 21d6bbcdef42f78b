"""core.kernels.fused: the Triton kernels, run on CPU tensors by Triton's interpreter, against
float64 references; and the MoE layer gives the same loss and gradients with and without them.

Skipped where Triton is not installed (the CPU CI image); the GPU suite runs the compiled kernels
(tests/test_moe.py's GPU tests go through the dispatcher's Triton path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent

CHECKS = r'''
import os, torch
from core.kernels.fused import accumulate_fp32_, gather_sum, gather_weighted_sum, inverse_of, permute_rows, swiglu, \
    swiglu_fused, triton_enabled

torch.manual_seed(0)
device, dtype = os.environ["CHECK_DEVICE"], getattr(torch, os.environ["CHECK_DTYPE"])
tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
torch.set_default_device(device)
assert triton_enabled(torch.zeros(1))

# accumulate: a size that is not a multiple of the block; copy, then add (bf16 is exact in fp32)
src = torch.randn(10_001).to(torch.bfloat16)
dst = torch.randn(10_001)
before = dst.clone()
accumulate_fp32_(dst, src, copy=False)
assert torch.equal(dst, before + src.float())
accumulate_fp32_(dst, src, copy=True)
assert torch.equal(dst, src.float())

def reference(rows, order, weights, t, k):
    slots = torch.zeros(t * k, rows.shape[1], dtype=torch.float64)
    slots[order] = rows.double()
    return (slots.view(t, k, -1) * weights.double().unsqueeze(-1)).sum(1)

# combine: several column blocks, k not a power of two, with and without dropped assignments
for t, k, dim, drop in ((37, 3, 1500, False), (20, 2, 700, True), (9, 8, 300, True)):
    order = torch.randperm(t * k)
    if drop:
        order = order[: t * k - 7]
    rows = torch.randn(order.numel(), dim).to(dtype).requires_grad_()
    weights = torch.rand(t, k, requires_grad=True)
    inverse = inverse_of(order, t * k).view(t, k)
    out = gather_weighted_sum(rows, inverse, weights)
    rows64 = rows.detach().double().requires_grad_()
    w64 = weights.detach().double().requires_grad_()
    want = reference(rows64, order, w64, t, k)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, **tol)
    grad = torch.randn(t, dim).to(dtype)
    out.backward(grad)
    want.backward(grad.double())
    torch.testing.assert_close(rows.grad.double(), rows64.grad, **tol)
    torch.testing.assert_close(weights.grad.double(), w64.grad, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)
    # the rows' gradient alone (weights without one)
    rows.grad = None
    gather_weighted_sum(rows, inverse, weights.detach()).backward(grad)
    torch.testing.assert_close(rows.grad.double(), rows64.grad, **tol)
    # the plain sum (permute's backward)
    got = gather_sum(rows.detach(), inverse, None)
    torch.testing.assert_close(got.double(), reference(rows.detach(), order, torch.ones(t, k), t, k), **tol)
    # the permutation itself: row i is the token of assignment order[i] (exact copies)
    assert torch.equal(permute_rows(rows.detach()[:t], inverse, order.numel()), rows.detach()[:t][order // k])

# swiglu: silu(a) * b and both input gradients against float64, over a size that is not a
# multiple of the block, with inputs wide enough to reach silu's tails
a = (4 * torch.randn(3, 2731)).to(dtype).requires_grad_()
b = torch.randn(3, 2731).to(dtype).requires_grad_()
out = swiglu(a, b)
a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
want = torch.nn.functional.silu(a64) * b64
assert out.dtype == dtype
torch.testing.assert_close(out.double(), want, **tol)
grad = torch.randn(3, 2731).to(dtype)
out.backward(grad)
want.backward(grad.double())
torch.testing.assert_close(a.grad.double(), a64.grad, **tol)
torch.testing.assert_close(b.grad.double(), b64.grad, **tol)

# swiglu_fused: gate and up as the halves of each row of h13 [rows, 2H], against float64 and
# against the PyTorch path of core.layers.FusedSwiGLU (Triton off): hidden sizes of two column
# blocks, a multiple of 8 (the 16-byte loads) and one that is not (masked)
from core.layers import FusedSwiGLU
for rows, hidden in ((5, 1096), (3, 1365)):
    h13 = (4 * torch.randn(rows, 2 * hidden)).to(dtype).requires_grad_()
    out = swiglu_fused(h13)
    h64 = h13.detach().double().requires_grad_()
    want = torch.nn.functional.silu(h64[:, :hidden]) * h64[:, hidden:]
    assert out.dtype == dtype and out.shape == (rows, hidden)
    torch.testing.assert_close(out.double(), want, **tol)
    grad = torch.randn(rows, hidden).to(dtype)
    out.backward(grad)
    want.backward(grad.double())
    assert h13.grad.shape == h13.shape and h13.grad.is_contiguous()  # one gradient, gate part first
    torch.testing.assert_close(h13.grad.double(), h64.grad, **tol)
    os.environ["TESSERA_TRITON"] = "0"
    plain = h13.detach().clone().requires_grad_()
    torch.testing.assert_close(FusedSwiGLU()(plain), out, **tol)
    FusedSwiGLU()(plain).backward(grad)
    torch.testing.assert_close(plain.grad, h13.grad, **tol)
    os.environ["TESSERA_TRITON"] = "1"

# swiglu_fused with a routing weight per row: the product and the gradients of h13 and of the
# weights against float64; hidden sizes of one and of two column blocks of the per-row backward
for rows, hidden in ((6, 1096), (4, 2600)):
    h13 = (4 * torch.randn(rows, 2 * hidden)).to(dtype).requires_grad_()
    w = torch.rand(rows, requires_grad=True)
    out = swiglu_fused(h13, w)
    h64, w64 = h13.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.nn.functional.silu(h64[:, :hidden]) * h64[:, hidden:] * w64.unsqueeze(1)
    assert out.dtype == dtype and out.shape == (rows, hidden)
    torch.testing.assert_close(out.double(), want, **tol)
    grad = torch.randn(rows, hidden).to(dtype)
    out.backward(grad)
    want.backward(grad.double())
    torch.testing.assert_close(h13.grad.double(), h64.grad, **tol)
    assert w.grad.dtype == w.dtype
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)
    os.environ["TESSERA_TRITON"] = "0"
    plain, wp = h13.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    FusedSwiGLU()(plain, wp).backward(grad)
    torch.testing.assert_close(FusedSwiGLU()(plain, wp), out, **tol)
    torch.testing.assert_close(plain.grad, h13.grad, **tol)
    torch.testing.assert_close(wp.grad, w.grad, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)
    os.environ["TESSERA_TRITON"] = "1"

# unpermute_sum (the combine when the experts applied the weights): the sum and its backward,
# each token's gradient copied to its rows (none to a dropped assignment's)
from core.kernels.fused import unpermute_sum
for t, k, dim, drop in ((37, 3, 1500, False), (9, 8, 300, True)):
    order = torch.randperm(t * k)[: t * k - (5 if drop else 0)]
    rows = torch.randn(order.numel(), dim).to(dtype).requires_grad_()
    inverse = inverse_of(order, t * k).view(t, k)
    out = unpermute_sum(rows, inverse)
    rows64 = rows.detach().double().requires_grad_()
    want = reference(rows64, order, torch.ones(t, k), t, k)
    torch.testing.assert_close(out.double(), want, **tol)
    grad = torch.randn(t, dim).to(dtype)
    out.backward(grad)
    want.backward(grad.double())
    assert torch.equal(rows.grad.double(), rows64.grad)  # exact copies

# topk_indices (the router's choice): the same k columns as torch.topk, row widths from 8 to 1000,
# k up to the width; -inf entries (the group limit's) never chosen; one opaque op when traced
from core.kernels.topk import topk_indices
for rows, width, k in ((1000, 64, 8), (37, 8, 2), (5, 256, 8), (300, 1000, 6), (9, 16, 16)):
    scores = torch.randn(rows, width)
    got = topk_indices(scores, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    assert torch.equal(got.sort(-1).values, scores.topk(k).indices.sort(-1).values), (rows, width, k)
scores[:, :8] = float("-inf")
assert torch.equal(topk_indices(scores, 8).sort(-1).values, torch.arange(8, 16).expand(9, 8))
traced = torch.compile(lambda s: topk_indices(s, 3), backend="aot_eager", fullgraph=True)
scores = torch.randn(70, 64)
assert torch.equal(traced(scores).sort(-1).values, scores.topk(3).indices.sort(-1).values)

# group-limited routing (DeepSeek-V3's: 8 groups, a token's best 4, top-8; and 3 of 4 groups with
# top-6) takes both its choices from the kernel: the experts and weights of torch.topk's choices
from core.config import MoEConfig
from moe.router import route
for groups, best, k in ((8, 4, 8), (4, 3, 6)):
    moe = MoEConfig(num_experts=64, top_k=k, router="sigmoid", n_groups=groups, topk_groups=best)
    logits = torch.randn(300, 64)
    bias = torch.randn(64) * 0.1
    idx, w, _ = route(logits, moe, bias)
    os.environ["TESSERA_TRITON"] = "0"
    want_idx, want_w, _ = route(logits, moe, bias)
    os.environ["TESSERA_TRITON"] = "1"
    got, want = idx.sort(-1), want_idx.sort(-1)
    assert torch.equal(got.values, want.values), (groups, best, k)
    torch.testing.assert_close(w.gather(1, got.indices), want_w.gather(1, want.indices), rtol=1e-6, atol=0)

# the token cross-entropy (core.kernels.cross_entropy, and core.train.loss through it): the loss and the
# logits' gradient against float64, over a vocabulary of one whole block and a partial one, with
# ignored labels, an out-of-range label (a zero target logit), a row with -inf entries and an
# upstream gradient other than 1
from core.kernels.cross_entropy import cross_entropy_rows_sum, fits
from core.train.loss import IGNORE_INDEX, cross_entropy_sum
for vocab in (5000, 37):
    logits = (torch.randn(12, vocab) * 3).to(dtype)
    logits[3, : vocab // 2] = float("-inf")
    labels = torch.randint(0, vocab, (12,))
    labels[1], labels[4], labels[7] = IGNORE_INDEX, vocab + 5, -7
    assert fits(logits)
    x = logits.detach().requires_grad_()
    loss = cross_entropy_rows_sum(x, labels, IGNORE_INDEX)
    x64 = logits.double().requires_grad_()
    valid = (labels >= 0) & (labels < vocab)
    target = x64.gather(1, labels.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1) * valid
    want = ((torch.logsumexp(x64, 1) - target) * (labels != IGNORE_INDEX)).sum()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-4)
    (loss * 0.37).backward()
    (want * 0.37).backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    assert not x.grad[1].any()  # ignored: no gradient
    in_range = labels.masked_fill(~valid, IGNORE_INDEX)  # what core.train.loss accepts on the CPU
    summed, count = cross_entropy_sum(logits, in_range)
    assert torch.equal(summed, cross_entropy_rows_sum(logits, in_range, IGNORE_INDEX)) and count == 9
    wider = torch.cat((logits, torch.randn(12, 3).to(dtype)), 1)[:, :vocab]  # rows further apart than V
    assert not wider.is_contiguous() and fits(wider)
    assert torch.equal(cross_entropy_rows_sum(wider, in_range, IGNORE_INDEX), summed)

# core.layers.SwiGLU: the kernel when eager, the plain ops when traced (one graph, no break)
from core.layers import FeedForward
ff = FeedForward(48, 64).to(dtype)
xf = torch.randn(10, 48).to(dtype)
traced = torch.compile(ff, backend="aot_eager", fullgraph=True)
torch.testing.assert_close(traced(xf), ff(xf), **tol)

# the MoE layer through the dispatcher: Triton path against the PyTorch path
from core.config import ModelConfig, MoEConfig
from moe.layer import MoELayer
cfg = ModelConfig(dim=48, ffn_dim=64, num_heads=1, num_kv_heads=1,
                  moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=32, aux_loss_coeff=0.01, num_shared_experts=1))
x = torch.randn(40, 48)  # fp32 layer: the two paths differ only by summation order
results = []
for enabled in ("1", "0"):
    os.environ["TESSERA_TRITON"] = enabled
    torch.manual_seed(1)
    layer = MoELayer(cfg, layer_id=0)
    xi = x.clone().requires_grad_()
    (layer(xi) ** 2).sum().backward()
    results.append([xi.grad] + [p.grad for p in layer.parameters()])
for a, b in zip(*results):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
# and the routing weights applied in the experts (the layer's way) against in the combine
os.environ["TESSERA_TRITON"] = "1"
torch.manual_seed(1)
layer = MoELayer(cfg, layer_id=0)
layer.dispatcher.weigh_in_experts = False
xi = x.clone().requires_grad_()
(layer(xi) ** 2).sum().backward()
for a, b in zip(results[0], [xi.grad] + [p.grad for p in layer.parameters()]):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

# A Triton that cannot compile here: the error names the kernel and the way out.
import core.kernels.fused as fused
def broken(*args, **meta):
    raise OSError("no C compiler")
os.environ["TESSERA_TRITON"] = "1"
fused._accumulate_kernel = type("Broken", (), {"__getitem__": lambda self, grid: broken, "__name__": "_accumulate_kernel"})()
try:
    accumulate_fp32_(dst, src, copy=False)
    raise AssertionError("no error")
except RuntimeError as exc:
    assert "failed (OSError: no C compiler)" in str(exc) and "TESSERA_TRITON=0" in str(exc), exc
os.environ["TESSERA_TRITON"] = "0"
accumulate_fp32_(dst, src, copy=True)  # the way out works
assert torch.equal(dst, src.float())
print("fused kernels ok")
'''


def _run(env: dict) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    proc = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "fused kernels ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_fused_kernels_in_the_interpreter_match_float64_and_the_pytorch_path():
    _run({"TRITON_INTERPRET": "1", "CHECK_DEVICE": "cpu", "CHECK_DTYPE": "float32"})


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_kernels_on_gpu_bf16_match_float64_and_the_pytorch_path():
    _run({"CHECK_DEVICE": "cuda", "CHECK_DTYPE": "bfloat16"})
