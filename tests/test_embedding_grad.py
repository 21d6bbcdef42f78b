"""core.kernels.embedding: the embedding gradient added into an fp32 table, by Triton's interpreter
on CPU tensors (and compiled on a GPU), against a float64 reference: runs shorter and longer than
one piece, a repeated token, rows nobody uses left alone, and the same bits on every call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.kernels.embedding import add_embedding_grad_

ROOT = Path(__file__).resolve().parent.parent

CHECKS = r'''
import os, torch
from core.kernels.embedding import CHUNK, add_embedding_grad_
from core.kernels.fused import triton_enabled

torch.manual_seed(0)
device, dtype = os.environ["CHECK_DEVICE"], getattr(torch, os.environ["CHECK_DTYPE"])
torch.set_default_device(device)
assert triton_enabled(torch.zeros(1))
vocab, dim = 50, 700  # two column blocks, the second partial
tokens = torch.randint(0, 40, (300,))
tokens[::3] = 7  # a run of 100: four pieces
tokens[1:2 * CHUNK:2] = 11  # exactly CHUNK: one piece
grad = torch.randn(300, dim).to(dtype)
table = torch.randn(vocab, dim)
want = table.double().index_add(0, tokens, grad.double())
results = []
for _ in range(2):
    got = table.clone()
    add_embedding_grad_(got, tokens, grad)
    results.append(got)
torch.testing.assert_close(results[0].double(), want, rtol=1e-6, atol=1e-5)
assert torch.equal(results[0], results[1])
assert torch.equal(results[0][40:], table[40:])  # ids 40.. never used
# fewer tokens than one piece (no scratch pieces), and a [T, dim] view of [batch, seq, dim]
small = table.clone()
add_embedding_grad_(small, tokens[:5].view(1, 5), grad[:5].view(1, 5, dim))
torch.testing.assert_close(small.double(), table.double().index_add(0, tokens[:5], grad[:5].double()), rtol=1e-6, atol=1e-5)
print("embedding kernels ok")
'''


def _run(env: dict) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    proc = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "embedding kernels ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_without_triton_it_is_index_add_in_fp32():
    table = torch.zeros(6, 4)
    tokens = torch.tensor([1, 3, 1, 1])
    grad = torch.arange(16, dtype=torch.bfloat16).view(4, 4)
    add_embedding_grad_(table, tokens, grad)
    assert torch.equal(table[1], grad[0].float() + grad[2].float() + grad[3].float())
    assert torch.equal(table[3], grad[1].float()) and not table[[0, 2, 4, 5]].any()


@pytest.mark.slow
def test_embedding_kernels_in_the_interpreter_match_float64():
    pytest.importorskip("triton")
    _run({"TRITON_INTERPRET": "1", "CHECK_DEVICE": "cpu", "CHECK_DTYPE": "float32"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_embedding_kernels_on_gpu_match_float64():
    _run({"CHECK_DEVICE": "cuda", "CHECK_DTYPE": "bfloat16"})
