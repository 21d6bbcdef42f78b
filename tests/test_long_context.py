"""Million-token documents on CPU: which attention kernels a long document may reach on CUDA (no
O(T^2) buffer, no kernel reported wrong at that length), the packed split's plan at 2^20 + 300
tokens, and the long-context step bench's CPU smoke. The GPU runs at those lengths are
tests/test_gpu_long_context.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

from core import attention
from core.parallel import ring_attention

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def test_long_documents_never_reach_sdpa_math_or_efficient_on_cuda():
    every = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert attention.cuda_dense_backends(attention.MATH_MAX_LEN, torch.bfloat16) == every
    assert attention.cuda_dense_backends(attention.MATH_MAX_LEN + 1, torch.float32) == every[:3]
    assert attention.cuda_dense_backends(attention.EFFICIENT_MAX_LEN, torch.bfloat16) == every[:3]
    for length in (attention.EFFICIENT_MAX_LEN + 1, MIB, MIB + 1000):
        assert attention.cuda_dense_backends(length, torch.bfloat16) == every[:2]
        assert attention.cuda_dense_backends(length, torch.float16) == every[:2]
        with pytest.raises(ValueError, match=rf"a document of {length} tokens in torch.float32 on CUDA.*bf16"):
            attention.cuda_dense_backends(length, torch.float32)


def test_ring_dense_blocks_are_refused_on_cuda_past_a_gib_of_scores():
    ring_attention.check_dense_block("cuda", 8, 4096, 8192)  # 2^28 scores: allowed
    ring_attention.check_dense_block("cpu", 8, 2**19, 2**19)  # CPU tests: the caller's choice
    with pytest.raises(ValueError, match=r"524288 queries x 524288 keys x 8 heads .*\(8192 GiB .*bf16"):
        ring_attention.check_dense_block("cuda", 8, 2**19, 2**19)
    with pytest.raises(ValueError, match="4096 queries x 8193 keys"):
        ring_attention.check_dense_block("cuda", 8, 4096, 8193)


def test_split_plan_of_a_million_token_document_after_a_short_one():
    long = MIB + 300
    pieces = attention._split_plan((700, long), attention.CUDNN_MIN_DOC, attention.CUDNN_BUCKET, torch.device("cpu"))
    short, doc = pieces
    assert (short.start, short.length, short.cu.tolist(), short.max_len) == (0, 700, [0, 700], 700)
    assert short.cu.dtype == torch.int32
    assert (doc.start, doc.length, doc.cu) == (700, long, None)
    assert doc.padded == 2049 * attention.CUDNN_BUCKET and doc.padded >= long  # 1,049,088: past the batch's end
    assert doc.start + doc.padded > 700 + long  # so _Windows pads a copy (the GPU test runs it)


def test_split_by_length_pads_past_the_batch_end_exactly():
    """The split at a small scale with the same shape of plan as the GPU test's (a short
    document, then a long one whose bucket runs past the batch's end), against one reference
    over all documents, forward and backward."""
    torch.manual_seed(0)
    lengths = (7, 45)  # min_doc 16, bucket 16: the long one pads to 48, 3 rows past the end
    total, hq, hkv, d = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(total, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, 7, 52], dtype=torch.int32)
    out = attention._split_by_length(q, k, v, lengths, None, min_doc=16, bucket=16)
    want = attention._reference_varlen(q, k, v, cu, None)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_long_context_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "long.json"
    # every switch on: the tiled MLP (64-token chunks), checkpoint offload of the first of the two
    # blocks, optimizer offload with bf16 moments
    cmd = [sys.executable, "-m", "bench.long_context", "--smoke", "--seq", "256", "--mlp-chunk-tokens", "64",
           "--offload-checkpoints", "--offload-layers", "1", "--optimizer-offload", "--moments-dtype", "bf16",
           "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    measured, predicted = figures["measured"], figures["predicted"]
    assert measured["step_s"] > 0 and measured["tokens_per_s"] > 0 and measured["loss"] > 0
    assert measured["host_rss_gib"] > 0 and measured["pinned_gib"] >= 0
    assert predicted["peak_allocated_gib"] > 0 and predicted["step_s"] > 0
    assert figures["config"] == {"train.recompute": "full", "train.fused_loss": True, "train.mlp_chunk_tokens": 64,
                                 "train.offload_checkpoints": True, "train.offload_checkpoints_layers": 1,
                                 "train.optimizer_offload": True, "train.optimizer_moments_dtype": "bf16",
                                 "train.compile": False}
    assert "step" in proc.stdout and "predicted" in proc.stdout


def test_long_context_bench_refuses_bad_arguments_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.long_context", "--smoke", "--seq", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--seq" in proc.stderr


def test_trace_peak_replays_the_allocator_trace_to_its_largest_live_set():
    from bench.long_context import peak_live_set
    events = [("alloc", 1, 4), ("alloc", 2, 2), ("free_completed", 1, 4), ("alloc", 3, 8), ("alloc", 4, 2),
              ("free_requested", 3, 8), ("free_completed", 3, 8), ("alloc", 5, 1)]
    snapshot = {"device_traces": [[{"action": a, "addr": addr, "size": n * MIB} for a, addr, n in events]]}
    peak, sizes = peak_live_set(snapshot)
    assert peak == 12 * MIB  # blocks 2, 3 and 4; block 1 was freed before 3 came
    assert sizes == {2 * MIB: 2, 8 * MIB: 1}
