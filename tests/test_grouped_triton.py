"""The aligned (M-grouped contiguous) layout and its Triton grouped GEMMs (core.kernels.grouped_triton,
moe.aligned, model.moe.grouped_gemm = "triton").

The kernels run on CPU tensors in Triton's interpreter against float64 per-group loops (fp32
operands: the interpreter's dot is a float32 numpy product, so errors are summation-order
rounding, far under the 1e-4 relative tolerance); the layout and the MoE layer on it against the
default layout, with and without Triton (fp32 layers: the two differ only in summation order,
the tolerance of tests/test_fused_kernels.py's layer comparison). The GPU test runs the tuned
bf16 kernels at the real 128-row alignment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, ModelConfig, MoEConfig
from core.validation import check_moe
from moe.aligned import aligned_layout, from_aligned, to_aligned
from moe.layer import MoELayer

ROOT = Path(__file__).resolve().parent.parent
LAYER_TOL = dict(rtol=1e-4, atol=1e-5)
COUNTS = [20, 0, 5, 33, 0, 16, 1]  # empty experts, groups under one tile, over one tile, of exactly one row


def test_layout_places_each_expert_at_a_tile_boundary_with_zero_padding():
    align = 16
    counts = torch.tensor(COUNTS)
    n = int(counts.sum())
    layout = aligned_layout(counts, n, align)
    assert layout.rows % align == 0 and layout.rows >= n
    assert layout.rows // align == min((n + len(COUNTS) * (align - 1)) // align, n)  # the stated upper bound
    padded = [-(-c // align) * align for c in COUNTS]
    ends = torch.tensor(padded).cumsum(0)
    assert layout.offsets.tolist() == ends.tolist() and layout.offsets.dtype == torch.int32
    assert layout.ends.tolist() == (ends - torch.tensor(padded) + counts).tolist()
    # dest and src are inverse maps; every grouped row lands inside its own expert's padded range
    assert torch.equal(layout.src[layout.dest], torch.arange(n))
    assert int((layout.src < n).sum()) == n
    expert_of_row = torch.repeat_interleave(torch.arange(len(COUNTS)), counts)
    starts = ends - torch.tensor(padded)
    assert bool(((layout.dest >= starts[expert_of_row]) & (layout.dest < layout.ends[expert_of_row])).all())
    # each tile names the expert of its rows; the tiles past the last expert's are unused (-1)
    used = int(ends[-1]) // align
    tiles = layout.tile_expert.tolist()
    assert all(t == -1 for t in tiles[used:]) and len(tiles) == layout.rows // align
    for t in range(used):
        rows = layout.src[t * align:(t + 1) * align]
        real = rows[rows < n]
        assert real.numel() and set(expert_of_row[real].tolist()) == {tiles[t]}


def test_to_and_from_aligned_round_trip_with_zero_padding_and_gradients(monkeypatch):
    monkeypatch.setenv("TESSERA_TRITON", "0")
    counts = torch.tensor(COUNTS)
    n = int(counts.sum())
    layout = aligned_layout(counts, n, 16)
    rows = torch.randn(n, 5, requires_grad=True)
    aligned = to_aligned(rows, layout)
    padding = layout.src == n
    assert aligned.shape == (layout.rows, 5) and not aligned[padding].any()
    assert torch.equal(aligned[layout.dest], rows)
    back = from_aligned(aligned * 3, layout)
    assert torch.equal(back, rows * 3)
    grad = torch.randn(n, 5)
    back.backward(grad)
    torch.testing.assert_close(rows.grad, 3 * grad)
    # the backward of from_aligned puts zeros in the padding rows
    a = aligned.detach().requires_grad_()
    from_aligned(a, layout).backward(grad)
    assert not a.grad[padding].any() and torch.equal(a.grad[layout.dest], grad)
    # an empty micro-batch: all padding
    empty = aligned_layout(torch.zeros(4, dtype=torch.int64), 0, 16)
    assert empty.rows == 0 and to_aligned(torch.randn(0, 5), empty).shape == (0, 5)


def _layer(backend: str, dispatcher: str, shared: int = 0) -> MoELayer:
    cfg = ModelConfig(dim=48, ffn_dim=64, num_heads=1, num_kv_heads=1,
                      moe=MoEConfig(num_experts=6, top_k=2, ffn_dim=40, aux_loss_coeff=0.01, grouped_gemm=backend,
                                    dispatcher=dispatcher, num_shared_experts=shared))
    torch.manual_seed(1)
    layer = MoELayer(cfg, layer_id=0)
    if backend == "triton":
        assert layer.dispatcher.align == 128
        layer.dispatcher.align = 16  # small tiles: the layer's 74 rows span several
    return layer


def _loss_and_grads(layer: MoELayer, weigh_in_experts: bool):
    layer.dispatcher.weigh_in_experts = weigh_in_experts
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(3)).requires_grad_()
    y = layer(x)
    loss = (y ** 2).sum()
    loss.backward()
    return [loss, x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("weigh_in_experts", [True, False])
def test_moe_layer_on_the_aligned_layout_equals_the_default_layout(monkeypatch, dispatcher, weigh_in_experts):
    # Without Triton: the grouped rows gathered into the aligned buffer and back, the per-group
    # loop on the padded offsets (the aligned layout's path for any kernel that is not Triton's).
    monkeypatch.setenv("TESSERA_TRITON", "0")
    want = _loss_and_grads(_layer("auto", dispatcher, shared=1), weigh_in_experts)
    got = _loss_and_grads(_layer("triton", dispatcher, shared=1), weigh_in_experts)
    for a, b in zip(want, got):
        assert b is not None and torch.isfinite(b).all()
        torch.testing.assert_close(b, a, **LAYER_TOL)
    # Tiled (train.mlp_chunk_tokens) on the aligned layout: chunks of whole tiles (20 rows -> 32).
    tiled = _layer("triton", dispatcher, shared=1)
    tiled.experts.chunk_rows = 20
    for a, b in zip(want, _loss_and_grads(tiled, weigh_in_experts)):
        torch.testing.assert_close(b, a, **LAYER_TOL)


def test_grouped_gemm_key_names_its_choices():
    check_moe(MoEConfig(num_experts=4, grouped_gemm="triton"))
    with pytest.raises(ConfigError, match="grouped_gemm"):
        check_moe(MoEConfig(num_experts=4, grouped_gemm="cutlas"))


CHECKS = r'''
import os, torch
from core.kernels import grouped_mm_loop, grouped_mm_wgrad_loop
from core.kernels.grouped_triton import AlignedGroupedMM, aligned_mm, aligned_wgrad_into_
from moe.aligned import aligned_layout, to_aligned
from moe.experts import expert_mm

torch.manual_seed(0)
align = 16
counts = torch.tensor([20, 0, 5, 33, 0, 16, 1])
n, g = int(counts.sum()), counts.numel()
layout = aligned_layout(counts, n, align)
offs, te = layout.offsets, layout.tile_expert
assert (te == -1).any()  # unused tiles are exercised
def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()
for k, m in ((40, 50), (48, 64)):  # dims off and on the block sizes (masked and unmasked loads)
    x = to_aligned(torch.randn(n, k), layout)
    w = torch.randn(g, k, m)
    y = aligned_mm(x, w, offs, te)
    assert rel(y, grouped_mm_loop(x.double(), w.double(), offs)) < 1e-5
    assert not y[layout.src == n].any()  # padding and unused rows: zero, written
    wt = torch.randn(g, m, k).transpose(1, 2)  # the data gradient's transposed weight view
    assert rel(aligned_mm(x, wt, offs, te), grouped_mm_loop(x.double(), wt.double(), offs)) < 1e-5
    dy = to_aligned(torch.randn(n, m), layout)
    want = grouped_mm_wgrad_loop(x.double(), dy.double(), offs)
    out = torch.full((g, k, m), float("nan"))
    aligned_wgrad_into_(out, x, dy, offs, False)
    assert rel(out, want) < 1e-5 and not out[1].any() and not out[4].any()  # empty experts: exact zeros
    before = torch.randn(g, k, m)
    out = before.clone()
    aligned_wgrad_into_(out, x, dy, offs, True)
    assert rel(out, want + before.double()) < 1e-5
# autograd: both gradients against the loop's
x = to_aligned(torch.randn(n, 40), layout).requires_grad_()
w = torch.randn(g, 40, 24, requires_grad=True)
dy = to_aligned(torch.randn(n, 24), layout)
AlignedGroupedMM.apply(x, w, offs, te).backward(dy)
x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
grouped_mm_loop(x64, w64, offs).backward(dy.double())
assert rel(x.grad, x64.grad) < 1e-5 and rel(w.grad, w64.grad) < 1e-5

# the weight gradient straight into the fp32 main grad (gradient-accumulation fusion), as the trainer runs it
from core.mesh import ParallelMesh
from core.parallel.data import apply_data_parallel
grads = {}
for fused in (False, True):
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(g, 40, 24))
    dp = apply_data_parallel(torch.nn.ParameterList([p]), ParallelMesh.build(), distributed_optimizer=False,
                             gradient_accumulation_fusion=fused)
    with dp.no_sync():  # a first micro-batch, then a second that adds to it
        expert_mm(x.detach(), p, offs, tile_expert=te).backward(dy)
    expert_mm(x.detach(), p, offs, tile_expert=te).backward(dy)
    dp.finish_grad_sync()
    grads[fused] = dp.slots[0].main_grad.clone()
    assert dp.stats["fused_grads"] == 2 * int(fused)
torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-5)

# the MoE layer with Triton's permute writing the aligned rows itself, against the default layout
from core.config import ModelConfig, MoEConfig
from moe.layer import MoELayer
cfg = dict(dim=48, ffn_dim=64, num_heads=1, num_kv_heads=1)
results = []
for backend in ("auto", "triton"):
    torch.manual_seed(1)
    layer = MoELayer(ModelConfig(**cfg, moe=MoEConfig(num_experts=6, top_k=2, ffn_dim=40, aux_loss_coeff=0.01,
                                                      grouped_gemm=backend)), layer_id=0)
    layer.dispatcher.align = align if backend == "triton" else 1
    xi = torch.randn(37, 48, generator=torch.Generator().manual_seed(3)).requires_grad_()
    loss = (layer(xi) ** 2).sum()
    loss.backward()
    if backend == "triton":
        assert layer.dispatcher._state is None  # combined
    results.append([loss, xi.grad] + [q.grad for q in layer.parameters()])
for a, b in zip(*results):
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
print("grouped triton ok")
'''


def _run(env: dict) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    proc = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "grouped triton ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_aligned_kernels_in_the_interpreter_match_float64_and_the_default_layout():
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("Triton's interpreter before 3.7 cannot run a loop bounded by a loaded value")
    _run({"TRITON_INTERPRET": "1"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tuned_aligned_kernels_on_gpu_match_float64():
    # bf16 operands at the real 128-row alignment (the autotuned kernels): relative error of
    # bf16 rounding of the output (the products accumulate in fp32), under 1e-2.
    pytest.importorskip("triton")
    from core.kernels import grouped_mm_loop, grouped_mm_wgrad_loop
    from core.kernels.grouped_triton import aligned_mm, aligned_wgrad_into_

    torch.manual_seed(0)
    counts = torch.tensor([700, 0, 5, 1300, 128, 256, 1, 0], device="cuda")
    n, g, k, m = int(counts.sum()), counts.numel(), 512, 1408
    layout = aligned_layout(counts, n, 128)
    x = to_aligned(torch.randn(n, k, device="cuda"), layout).bfloat16()
    w = (torch.randn(g, k, m, device="cuda") * k ** -0.5).bfloat16()
    dy = to_aligned(torch.randn(n, m, device="cuda"), layout).bfloat16()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    offs, te = layout.offsets, layout.tile_expert
    assert rel(aligned_mm(x, w, offs, te), grouped_mm_loop(x.double(), w.double(), offs)) < 1e-2
    wt = w.transpose(1, 2)
    assert rel(aligned_mm(dy, wt, offs, te), grouped_mm_loop(dy.double(), wt.double(), offs)) < 1e-2
    out = torch.full((g, k, m), float("nan"), device="cuda")
    aligned_wgrad_into_(out, x, dy, offs, False)
    assert rel(out, grouped_mm_wgrad_loop(x.double(), dy.double(), offs)) < 1e-3  # fp32 output
    assert not out[1].any() and not out[7].any()


def test_layout_bench_reads_the_deepseek_config_and_routes_unevenly():
    # bench/grouped_layouts.py: its DeepSeek-like shape is the launch config's, and its routing
    # gives every token top_k distinct experts with an uneven load.
    from bench.grouped_layouts import SHAPES, main, skewed_counts

    ds = SHAPES["deepseek"]()
    assert (ds.experts, ds.top_k, ds.dim, ds.ffn) == (64, 8, 2048, 1408)
    counts = skewed_counts(ds.experts, ds.top_k, 4096, skew=0.5)
    assert int(counts.sum()) == 4096 * 8
    assert counts.max() > 1.2 * counts.float().mean()
    assert main(["--shapes", "nope"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_aligned_layout_and_kernels_capture_in_a_cuda_graph_and_the_layer_matches_the_default():
    # No host sync anywhere on the aligned path: the layout's construction from device counts, the
    # padding's zeroing and the kernels capture into one CUDA graph, and replayed on new counts
    # they give the new counts' products. Then the bf16 MoE layer at align 128 against the default
    # layout: both round to bf16 at different places, so a relative error under 2e-2.
    pytest.importorskip("triton")
    from core.kernels import grouped_mm_loop
    from core.kernels.grouped_triton import aligned_mm

    torch.manual_seed(0)
    g, k, m, n = 8, 256, 384, 3000
    counts = torch.tensor([900, 0, 7, 1000, 128, 600, 365, 0], device="cuda")
    x = torch.randn(n, k, device="cuda").bfloat16()
    w = (torch.randn(g, k, m, device="cuda") * k ** -0.5).bfloat16()
    warm = aligned_layout(counts, n, 128)  # compiles and tunes outside the capture
    aligned_mm(to_aligned(x, warm), w, warm.offsets, warm.tile_expert)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layout = aligned_layout(counts, n, 128)
        y = aligned_mm(to_aligned(x, layout), w, layout.offsets, layout.tile_expert)
    counts.copy_(torch.tensor([0, 3000, 0, 0, 0, 0, 0, 0]))
    graph.replay()
    torch.cuda.synchronize()
    want = grouped_mm_loop(x.double(), w.double(), torch.cumsum(counts, 0, dtype=torch.int32))
    got = y[layout.dest]
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2

    cfg = lambda backend: ModelConfig(dim=512, ffn_dim=512, num_heads=1, num_kv_heads=1,  # noqa: E731
                                      moe=MoEConfig(num_experts=16, top_k=4, ffn_dim=256, grouped_gemm=backend))
    outs = []
    for backend in ("auto", "triton"):
        torch.manual_seed(1)
        layer = MoELayer(cfg(backend), layer_id=0).cuda().bfloat16()
        xi = torch.randn(2048, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).bfloat16()
        xi.requires_grad_()
        y = layer(xi)
        y.float().square().sum().backward()
        outs.append([y, xi.grad, layer.experts.w13.grad, layer.experts.w2.grad])
    for a, b in zip(*outs):
        assert ((b.double() - a.double()).norm() / a.double().norm()).item() < 2e-2
