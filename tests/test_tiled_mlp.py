"""Tiled MLP (`train.mlp_chunk_tokens`, core/layers.py `tiled_swiglu`; the routed experts:
moe/experts.py `GroupedExperts.chunk_rows`).

Reference: the same FeedForward untiled. In fp64 on the CPU the output and every gradient
(input, w1, w3, w2) agree to 1e-12: the same products, summed over chunks in another order.
A training run with the MLP tiled follows the single-process untiled run (RTOL), alone and at
tp=2 with sequence parallelism (w2's partial sums reduced once after the tiles). The runs check that
the tiled path is the one that ran; its gradients are proved by the fp64 test (a few AdamW steps of a
small model hide gradient errors of the size a wrong tile would make in a residual branch). In bf16
under recompute, eager and compiled, the weight gradients reach the fp32 main grads: the gradient
norm follows the untiled trainer's.

The routed experts run their dispatched rows in chunks (chunks cut through experts' rows, and an
expert may have none): in fp64 the output and the gradients of the rows, the routing weights, w13
and w2 agree with the untiled experts to 1e-12, and the tensors kept for the backward are the
input rows alone. A trainer with tiny_moe tiled (routed experts and shared expert) follows the
untiled one, steps and gradient norms, to RTOL.
"""

from __future__ import annotations

import pytest
import torch

from torch.autograd.graph import saved_tensors_hooks

from core.config import ConfigError, load_config
from core.layers import FeedForward
from core.train.trainer import Trainer
from core.validation import validate
from moe.experts import GroupedExperts
from tests.support.batches import micro_batch
from tests.support.runs import CONFIG, MOE_CONFIG, RTOL, losses, run_train


@pytest.mark.parametrize("tokens, chunk", [(37, 8), (64, 16), (5, 64)])
def test_tiled_swiglu_equals_the_plain_one(tokens, chunk):
    torch.manual_seed(0)
    ffn = FeedForward(16, 40).double()
    x = torch.randn(tokens, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(tokens, 16, dtype=torch.float64)
    want = ffn(x)
    want.backward(grad)
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in ffn.parameters()]
    x.grad = None
    ffn.zero_grad()
    ffn.chunk_tokens = chunk
    got = ffn(x)
    got.backward(grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip([x.grad] + [p.grad for p in ffn.parameters()], want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _saved_bytes(fn):
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        out = fn()
    return out, sum(saved)


@pytest.mark.parametrize("counts, chunk", [([5, 0, 9, 3, 0, 6], 4), ([0, 17, 1, 0], 7), ([2, 3], 64)])
def test_tiled_experts_equal_the_plain_ones(counts, chunk):
    torch.manual_seed(0)
    experts = GroupedExperts(len(counts), 12, 20).double()
    rows = sum(counts)
    x = torch.randn(rows, 12, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(rows, dtype=torch.float64, requires_grad=True)
    per_expert = torch.tensor(counts)
    grad = torch.randn(rows, 12, dtype=torch.float64)

    def run():
        out, nbytes = _saved_bytes(lambda: experts(x, per_expert, weights))
        out.backward(grad)
        grads = [t.grad.clone() for t in (x, weights, experts.w13, experts.w2)]
        for t in (x, weights, experts.w13, experts.w2):
            t.grad = None
        return out.detach(), grads, nbytes

    want, want_grads, untiled_bytes = run()
    experts.chunk_rows = chunk
    got, got_grads, tiled_bytes = run()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    if rows > chunk:  # only the chunks' inputs are kept: rows, their weights and group ends
        assert tiled_bytes <= rows * (12 + 1) * 8 + 8 * len(counts) * (rows // chunk + 1), (tiled_bytes, untiled_bytes)
        assert untiled_bytes >= rows * 2 * 20 * 8  # the plain experts keep their [rows, 2 x hidden] product


def _moe_trainer_steps(*extra: str, device: str = "cpu"):
    config = load_config(MOE_CONFIG, ["train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_len=128",
                                      "parallel.ep=1", f"train.device={device}", *extra])
    trainer = Trainer(config)
    out = []
    for step in range(2):
        micro = [micro_batch(10 * step + i, config.model.vocab_size, device=device) for i in range(2)]
        result = trainer.step(micro)
        out.append((float(result.loss_sum), float(result.grad_norm)))
    return out, trainer


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_trainer_with_tiled_experts_follows_the_untiled_one(device):
    # On the GPU (bf16, grouped GEMM kernels): each chunk's weight gradient adds into the fp32 main grad.
    want, _ = _moe_trainer_steps(device=device)
    got, trainer = _moe_trainer_steps("train.mlp_chunk_tokens=32", device=device)
    layers = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
    top_k = trainer.config.model.moe.top_k
    assert layers and all(layer.chunk_rows == 32 * top_k for layer in layers)
    assert all(m.chunk_tokens == 32 for m in trainer.model.modules() if isinstance(m, FeedForward))
    rel = RTOL if device == "cpu" else 2e-2  # bf16: the chunks' GEMMs round differently
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want):
        assert loss == pytest.approx(loss_ref, rel=rel) and norm == pytest.approx(norm_ref, rel=rel)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_recomputed_bf16_trainer_with_a_tiled_mlp_follows_the_untiled_one(device, compiled):
    # bf16: the fused linears' weight gradients add into the fp32 main grads, from a backward whose
    # saved tensors come back through the recompute hooks; compiled blocks around the tiles; two
    # micro-batches a step: the second adds to the first. (A tiled MLP that dropped its three
    # weight gradients moved the gradient norm by 4%.)
    def steps(*extra):
        config = load_config(CONFIG, ["train.micro_batch_size=2", "train.global_batch_size=4", "train.seq_len=128",
                                      f"train.device={device}", "train.precision=bf16", "train.recompute=full",
                                      *extra])
        trainer = Trainer(config)
        out = []
        for step in range(3):
            micro = [micro_batch(10 * step + i, config.model.vocab_size, device=device) for i in range(2)]
            result = trainer.step(micro)
            out.append((float(result.loss_sum), float(result.grad_norm)))
        return out, trainer

    want, _ = steps()
    got, trainer = steps("train.mlp_chunk_tokens=64", f"train.compile={str(compiled).lower()}")
    assert all(m.chunk_tokens == 64 for m in trainer.model.modules() if isinstance(m, FeedForward))
    rel = 5e-3 if device == "cpu" else 2e-2  # bf16 GEMMs over chunks (measured on the CPU: 3e-4)
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want):
        assert loss == pytest.approx(loss_ref, rel=rel) and norm == pytest.approx(norm_ref, rel=rel)


def test_a_chunk_that_does_not_divide_the_micro_batch_is_refused():
    config = load_config(None, ["train.mlp_chunk_tokens=100", "train.seq_len=256", "train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"train.mlp_chunk_tokens=100 must divide the tokens of a micro-batch"):
        validate(config, world_size=1)
    config = load_config(None, ["train.mlp_chunk_tokens=128", "train.precision=fp8"])
    with pytest.raises(ConfigError, match="train.mlp_chunk_tokens > 0 runs the dense SwiGLU in plain GEMMs"):
        validate(config, world_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["parallel.tp=2"])], ids=["one", "tp2-sp"])
def test_training_with_a_tiled_mlp_follows_the_single_process(tmp_path, dataset, reference, nproc, layout):
    proc = run_train(tmp_path / "run", dataset, nproc, "train.mlp_chunk_tokens=32", *layout)
    assert "tiled MLP: 2 dense feed-forward layers run 32 tokens at a time" in proc.stdout + proc.stderr
    got = losses(tmp_path / "run")
    assert got.keys() == reference.keys() and len(got) == 4
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=RTOL), (step, got, reference)
