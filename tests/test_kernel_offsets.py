"""The Triton kernels address tensors of more than 2^31 - 1 elements correctly: run by Triton's
interpreter on CPU tensors whose rows lie past element 2^31, against torch on those rows.

A million-token step holds [T, hidden] tensors of ~1e10 elements, so an offset such as
`row * dim` computed in int32 wraps. The interpreter keeps Triton's integer types (numpy int32
wraps as the GPU's does), so a kernel that multiplied in int32 reads or writes the wrong
address here (a wrong value, or the child process dies). The tensors are 4-8 GiB of address
space but nearly all of it is never touched: the host commits only the pages of the rows the
kernels read and write (the run's resident memory stays a few hundred MiB).

Covered: cross-entropy (rows at a large stride), the MoE combine forward and backward and the
dispatch permutation (row numbers from `inverse`, int64 and int32), the embedding gradient (token
ids into a large table, one run longer than CHUNK). The flat kernels (swiglu, accumulate, AdamW)
and swiglu_fused need every element of such a tensor to exist: tests/test_gpu_long_context.py
runs them past 2^31 on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
PAST = 2**31  # the first element an int32 offset cannot reach

CHECKS = r'''
import resource, torch
from core.kernels.cross_entropy import cross_entropy_rows_sum
from core.kernels.embedding import CHUNK, add_embedding_grad_
from core.kernels.fused import gather_weighted_sum, permute_rows, triton_enabled

PAST = 2**31
torch.manual_seed(0)
assert triton_enabled(torch.zeros(1))

# cross-entropy: 3 rows a stride of 2^30 + 1 apart, the last starting past 2^31
vocab, stride = 1000, 2**30 + 1
storage = torch.empty(2 * stride + vocab, dtype=torch.bfloat16)
logits = storage.as_strided((3, vocab), (stride, 1))
values = torch.randn(3, vocab).to(torch.bfloat16)
for r in range(3):
    logits[r].copy_(values[r])
assert logits.storage_offset() + 2 * stride >= PAST
labels = torch.tensor([5, 999, 17])
logits.requires_grad_()
loss = cross_entropy_rows_sum(logits, labels, -100)
ref = values.float().requires_grad_()
want = torch.nn.functional.cross_entropy(ref, labels, reduction="sum")
want.backward()
assert abs(float(loss) - float(want)) < 1e-4 * float(want), (float(loss), float(want))
loss.backward()
torch.testing.assert_close(logits.grad.float(), ref.grad, rtol=2e-2, atol=2e-3)

# MoE combine and dispatch: [N, dim] rows with N * dim > 2^31, tokens pointing past 2^31
dim = 1024
n = PAST // dim + 8
high = [n - 1, PAST // dim + 3, PAST // dim]  # rows whose first element is past 2^31
for index_dtype in (torch.int64, torch.int32):
    inverse = torch.tensor([[high[0], 0], [high[1], -1], [7, high[2]]], dtype=index_dtype)
    t, k = inverse.shape
    rows = torch.empty(n, dim, dtype=torch.bfloat16)
    used = sorted({int(r) for r in inverse.flatten() if r >= 0})
    for r in used:
        rows[r].copy_(torch.randn(dim).to(torch.bfloat16))
    weights = torch.rand(t, k)
    rows.requires_grad_()
    weights.requires_grad_()
    out = gather_weighted_sum(rows, inverse, weights)
    want = torch.zeros(t, dim, dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            if inverse[i, j] >= 0:
                want[i] += float(weights[i, j]) * rows.detach()[int(inverse[i, j])].double()
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    grad = torch.randn(t, dim).to(torch.bfloat16)
    out.backward(grad)
    for i in range(t):
        for j in range(k):
            r = int(inverse[i, j])
            if r < 0:
                assert float(weights.grad[i, j]) == 0.0
                continue
            torch.testing.assert_close(rows.grad[r].float(), float(weights[i, j]) * grad[i].float(), rtol=2e-2,
                                       atol=2e-2)
            dot = float((rows.detach()[r].double() * grad[i].double()).sum())
            assert abs(float(weights.grad[i, j]) - dot) < 1e-3 * max(1.0, abs(dot)), (index_dtype, i, j)
    del rows, out
    x = torch.randn(t, dim).to(torch.bfloat16)
    permuted = permute_rows(x, inverse, n)
    for i in range(t):
        for j in range(k):
            if inverse[i, j] >= 0:
                assert torch.equal(permuted[int(inverse[i, j])], x[i]), (index_dtype, i, j)
    del permuted

# embedding gradient: a [V, dim] fp32 table with V * dim > 2^31; one token repeated past CHUNK
vocab = PAST // dim + 8
table = torch.empty(vocab, dim)
tokens = torch.tensor([vocab - 1] + [PAST // dim + 3] * (CHUNK + 9) + [0, vocab - 1])
for r in set(tokens.tolist()):
    table[r].copy_(torch.randn(dim))
before = {r: table[r].clone() for r in set(tokens.tolist())}
grad = torch.randn(tokens.numel(), dim)
add_embedding_grad_(table, tokens, grad)
for r, row in before.items():
    want = row.double() + grad[tokens == r].double().sum(0)
    torch.testing.assert_close(table[r].double(), want, rtol=1e-5, atol=1e-4)

rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"kernel offsets ok (max resident {rss:.0f} MiB)")
'''


def _run(root: Path) -> subprocess.CompletedProcess:
    """CHECKS on the kernels of the tree at `root` (its own folder first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", CHECKS], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)


def test_kernels_address_rows_past_2_pow_31_in_the_interpreter():
    proc = _run(ROOT)
    # A wrapped offset usually reads unmapped memory: the child dies (returncode -11), no traceback.
    assert proc.returncode == 0 and "kernel offsets ok" in proc.stdout, \
        f"returncode {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-5000:]
