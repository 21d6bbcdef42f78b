"""Tiled MLP (`train.mlp_chunk_tokens`, core/layers.py `tiled_swiglu`).

Reference: the same FeedForward untiled. In fp64 on the CPU the output and every gradient
(input, w1, w3, w2) agree to 1e-12: the same products, summed over chunks in another order.
A training run with the MLP tiled follows the single-process untiled run (RTOL), alone and at
tp=2 with sequence parallelism (w2's partial sums reduced once after the tiles). The runs check that
the tiled path is the one that ran; its gradients are proved by the fp64 test (a few AdamW steps of a
small model hide gradient errors of the size a wrong tile would make in a residual branch).
"""

from __future__ import annotations

import pytest
import torch

from core.config import ConfigError, load_config
from core.layers import FeedForward
from core.validation import validate
from tests.support.runs import RTOL, losses, run_train


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
