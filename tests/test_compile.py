"""train.compile: compiled blocks give the eager loss and gradients, and packed batches with
new document boundaries or new expert routing reuse the graphs (no recompile per batch).

The backend is aot_eager (TESSERA_COMPILE_BACKEND): it runs dynamo's capture, guards and
graph breaks and AOT autograd exactly as inductor would, without inductor's C++ build time on
CI's 2 cores. The GPU case (inductor, CUTLASS experts) is in tests/test_gpu_train.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo import register_backend

from core.config import ModelConfig, MoEConfig
from core.train.loss import cross_entropy_sum
from core.layers import AttentionMeta
from core.train.model import build_model
from core.parallel.recompute import apply_recompute
from core.train.parallelize import COMPILE_BACKEND_ENV, compile_blocks
from moe.stats import moe_metrics


RECORDING_BACKEND = "tessera_record_graphs"
_RECORDED_GRAPHS: list[str] = []


@register_backend(name=RECORDING_BACKEND)
def _record_graphs(gm, example_inputs):
    """Dynamo's capture, run as captured, remembering each graph's code."""
    _RECORDED_GRAPHS.append(gm.code)
    return gm.forward


def _moe_config() -> ModelConfig:
    moe = MoEConfig(num_experts=8, top_k=2, ffn_dim=32, num_shared_experts=1, router="sigmoid", n_groups=4,
                    topk_groups=2, aux_loss_coeff=0.01, aux_loss_per_sequence=True, z_loss_coeff=0.001,
                    bias_update_rate=0.001, first_k_dense=1)
    return ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=64, moe=moe)


def _batch(seed: int, doc_lengths: list[int], vocab: int):
    g = torch.Generator().manual_seed(seed)
    total = sum(doc_lengths)
    tokens = torch.randint(0, vocab, (total,), generator=g)
    labels = torch.randint(0, vocab, (total,), generator=g)
    cu = torch.tensor([0] + doc_lengths).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in doc_lengths])
    return tokens, labels, positions, AttentionMeta(cu_seqlens=cu, max_seqlen=max(doc_lengths))


def _loss_and_grads(model, batch):
    tokens, labels, positions, meta = batch
    loss_sum, count = cross_entropy_sum(model(tokens, positions, meta), labels)
    loss = loss_sum / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# mlp: the feed-forward and its norm recomputed under one checkpoint, which carries the MoE
# layer's meta (the batch's boundaries) into the recomputation.
@pytest.mark.parametrize("with_moe,recomputed", [(False, ()), (True, ()), (True, ("mlp",))],
                         ids=["dense", "moe", "moe-mlp-recomputed"])
def test_compiled_blocks_match_eager_without_recompiling(monkeypatch, with_moe, recomputed):
    import torch._dynamo

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    cfg = _moe_config()
    if not with_moe:
        cfg.moe = MoEConfig()
    eager = apply_recompute(build_model(cfg, seed=5), "none", recomputed)
    compiled = apply_recompute(build_model(cfg, seed=5), "none", recomputed, compiled=True)
    torch._dynamo.reset()
    compile_blocks([compiled])
    # The same token count each micro-batch (the packer's contract), different documents,
    # hence different cu_seqlens lengths, max_seqlen and expert routing.
    batches = [_batch(1, [40, 24, 32, 32], cfg.vocab_size), _batch(2, [100, 28], cfg.vocab_size),
               _batch(3, [16] * 8, cfg.vocab_size)]
    try:
        for i, batch in enumerate(batches):
            if i == 1:  # the first batch compiled every graph: none may be compiled again
                torch._dynamo.config.error_on_recompile = True
            want_loss, want = _loss_and_grads(eager, batch)
            got_loss, got = _loss_and_grads(compiled, batch)
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
    if with_moe:  # the statistics the compiled router recorded are the eager ones
        got_stats, want_stats = moe_metrics(compiled), moe_metrics(eager)
        assert got_stats["moe/layer1/tokens_per_expert"] == want_stats["moe/layer1/tokens_per_expert"]
        assert sum(got_stats["moe/layer2/tokens_per_expert"]) == 2 * 128 * 3
        assert got_stats["moe/aux_loss_term"] == pytest.approx(want_stats["moe/aux_loss_term"], rel=1e-5)


def test_compile_backend_env_reaches_the_blocks(monkeypatch):
    # A user bisecting an inductor bug sets the backend; an unknown one fails loudly at first call.
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "no_such_backend")
    model = build_model(_moe_config(), seed=0)
    with pytest.raises(Exception, match="no_such_backend"):
        compile_blocks([model])
        tokens, _, positions, meta = _batch(0, [64], 64)
        model(tokens, positions, meta)


@pytest.mark.parametrize("with_moe", [False, True])
def test_recomputed_blocks_are_compiled_not_run_eagerly(monkeypatch, with_moe):
    """Whole-block recompute with train.compile: the block's own ops (norms, projections, the
    SwiGLU) must land in compiled graphs. The attention core stays outside compile, and a graph
    break inside a checkpointed region makes dynamo run the whole region eagerly: the block is
    compiled inside its checkpoint. Loss and gradients stay the eager ones."""
    import torch._dynamo

    graphs = _RECORDED_GRAPHS
    graphs.clear()
    monkeypatch.setenv(COMPILE_BACKEND_ENV, RECORDING_BACKEND)
    cfg = _moe_config()
    if not with_moe:
        cfg.moe = MoEConfig()
    eager = apply_recompute(build_model(cfg, seed=5), "full")
    compiled = apply_recompute(build_model(cfg, seed=5), "full")
    torch._dynamo.reset()
    compile_blocks([compiled])
    try:
        for batch in (_batch(1, [40, 24, 32, 32], cfg.vocab_size), _batch(2, [100, 28], cfg.vocab_size)):
            want_loss, want = _loss_and_grads(eager, batch)
            got_loss, got = _loss_and_grads(compiled, batch)
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    finally:
        torch._dynamo.reset()
    code = "\n".join(graphs)
    assert "rsqrt" in code and "silu" in code, f"{len(graphs)} graphs captured, without the block's norms or SwiGLU"


COMPILE_AFTER_PLAIN_IMPORT = r"""
import os, sys
import torch
from core.train.model import build_model
from core.layers import CoreAttention
assert "torch._dynamo" not in sys.modules, "importing the model pulled in torch._dynamo"
import torch._dynamo
from core.train.parallelize import compile_blocks
sys.path.insert(0, "tests")
from test_compile import _batch, _loss_and_grads, _moe_config
assert getattr(CoreAttention.forward, "_torchdynamo_disable", False), "CoreAttention.forward not disabled"
cfg = _moe_config()
eager, compiled = build_model(cfg, seed=5), build_model(cfg, seed=5)
compile_blocks([compiled])
for i, batch in enumerate([_batch(1, [40, 24, 32, 32], 64), _batch(2, [100, 28], 64)]):
    torch._dynamo.config.error_on_recompile = i > 0
    want_loss, _ = _loss_and_grads(eager, batch)
    got_loss, _ = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_eager_only_methods_stay_out_of_graphs_when_dynamo_comes_later():
    """A training process imports the model before anything imports torch._dynamo (which
    `@eager_only` waits for): compiling then must still leave the attention core and the MoE
    dispatch out of the graphs, or new document boundaries would recompile every block."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, **{COMPILE_BACKEND_ENV: "aot_eager"})
    done = subprocess.run([sys.executable, "-c", COMPILE_AFTER_PLAIN_IMPORT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
