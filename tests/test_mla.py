"""Multi-head latent attention (core/mla.py) against transformers' own DeepseekV3Attention.

Reference: transformers' `DeepseekV3Attention` (eager attention, causal mask) on the same weights,
one unpacked sequence, fp32 on the CPU; and the document-causal contract on a packed batch
(each document alone through the same layer). Tolerance 1e-5 absolute: the same fp32 operations
in a different order (split heads, concatenations), nothing rounded to a lower precision.
"""

from __future__ import annotations

import pytest
import torch

from core.config import ConfigError, ModelConfig, RopeScalingConfig
from core.layers import AttentionMeta, rope_frequencies, rotary_tables
from core.mla import MLAttention, softmax_scale_factor
from core.validation import _check_model

transformers = pytest.importorskip("transformers")


def _cfg(q_lora_rank: int, yarn: bool) -> ModelConfig:
    cfg = ModelConfig(dim=48, num_heads=4, attention="mla", q_lora_rank=q_lora_rank, kv_lora_rank=24,
                      qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, rope_theta=10000.0, norm_eps=1e-6)
    if yarn:
        cfg.rope_scaling = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=16,
                                             beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0)
    return cfg


def _hf_attention(cfg: ModelConfig):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.type == "yarn":
        r = cfg.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": r.factor, "beta_fast": r.beta_fast,
                "beta_slow": r.beta_slow, "mscale": r.mscale, "mscale_all_dim": r.mscale_all_dim,
                "original_max_position_embeddings": r.original_max_position_embeddings}
    hf_cfg = DeepseekV3Config(
        hidden_size=cfg.dim, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=False,
        rope_parameters=rope, max_position_embeddings=64, attention_bias=False, vocab_size=32,
        num_hidden_layers=1, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1,
    )
    hf_cfg._attn_implementation = "eager"
    return DeepseekV3Attention(hf_cfg, layer_idx=0).eval(), DeepseekV3RotaryEmbedding(hf_cfg)


def _copy_weights(ours: MLAttention, hf) -> None:
    pairs = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    pairs.update({"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"} if ours.wq is None
                 else {"wq": "q_proj"})
    with torch.no_grad():
        for mine, theirs in pairs.items():
            getattr(hf, theirs).weight.copy_(getattr(ours, mine).weight)


def _meta(lengths: list[int]) -> AttentionMeta:
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths), doc_lengths=tuple(lengths))


@pytest.mark.parametrize("q_lora_rank,yarn", [(0, False), (16, False), (16, True), (0, True)])
def test_mla_equals_transformers(q_lora_rank, yarn):
    torch.manual_seed(0)
    cfg = _cfg(q_lora_rank, yarn)
    ours = MLAttention(cfg)
    for p in ours.parameters():  # norm gains away from 1, so a missing norm would show
        torch.nn.init.normal_(p, 0.0, 0.3) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    hf, hf_rope = _hf_attention(cfg)
    _copy_weights(ours, hf)
    seq = 20
    x = torch.randn(seq, cfg.dim)
    positions = torch.arange(seq)
    inv_freq, scale = rope_frequencies(cfg)
    out = ours(x, rotary_tables(positions, inv_freq, scale), _meta([seq]))
    cos, sin = hf_rope(x[None], positions[None])
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    expected, _ = hf(x[None], (cos, sin), mask)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
    if yarn:  # the mscale term is live in this case, so the test covers it
        assert softmax_scale_factor(cfg) > 1.0


def test_mla_stays_within_documents():
    """A packed batch equals each document run alone (positions restart per document)."""
    torch.manual_seed(1)
    cfg = _cfg(16, False)
    layer = MLAttention(cfg)
    lengths = [5, 9, 3]
    x = torch.randn(sum(lengths), cfg.dim)
    inv_freq, scale = rope_frequencies(cfg)
    positions = torch.cat([torch.arange(n) for n in lengths])
    packed = layer(x, rotary_tables(positions, inv_freq, scale), _meta(lengths))
    alone = [layer(part, rotary_tables(torch.arange(len(part)), inv_freq, scale), _meta([len(part)]))
             for part in x.split(lengths)]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("change,needle", [
    ({"kv_lora_rank": 0}, "model.kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "must be even"),
    ({"qk_norm": True}, "qk_norm"),
    ({"head_dim": 16}, "model.head_dim=16 has no effect"),
    ({"attention": "gqa"}, "is an MLA key"),
])
def test_mla_config_errors(change, needle):
    cfg = _cfg(16, False)
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ConfigError, match=needle):
        _check_model(cfg)


# ---- kernels' head sizes, recompute, compile, precision ------------------------------------


def _packed(lengths: list[int], dtype=torch.float64, heads=(4, 2), dims=(12, 6), seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads[0], dims[0], dtype=dtype, generator=g)
    k = torch.randn(total, heads[1], dims[0], dtype=dtype, generator=g)
    v = torch.randn(total, heads[1], dims[1], dtype=dtype, generator=g)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return q, k, v, cu


def test_padded_values_equal_the_unpadded_attention():
    """FlashAttention's path pads narrower value heads with zeros to the q/k size and slices the
    output: the same output and q/k/v gradients as attention on the value heads as they are
    (float64; the exact CPU kernel stands in for the one-head-size kernel)."""
    from core.attention import _reference_varlen, padded_values

    q, k, v, cu = _packed([5, 11, 1, 7])
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    results = []
    for attend in (_reference_varlen, lambda *a: padded_values(_reference_varlen, *a)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, cu, None)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    assert results[1][0].shape == (q.shape[0], 4, 6)
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="wider than the query/key heads"):
        padded_values(_reference_varlen, v, v, q, cu, None)


def test_ring_flash_blocks_pad_narrower_value_heads(monkeypatch):
    """The ring's FlashAttention blocks (one head size) with narrower value heads: v, the output and
    its gradient zero-padded, the results sliced. With the exact dense block standing in for the
    kernel, forward (out, lse) and backward (dq, dk, dv) equal the dense block on the narrow heads."""
    from core.parallel import ring_attention as ring

    def dense_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        assert v.shape[-1] == q.shape[-1]  # what the kernel would be handed
        return ring._dense_fwd(q, k, v, cu_q, cu_k, causal, scale)

    def dense_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        assert v.shape[-1] == out.shape[-1] == dout.shape[-1] == q.shape[-1]
        return ring._dense_bwd(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)

    monkeypatch.setattr(ring, "_flash_fwd_equal", dense_fwd)
    monkeypatch.setattr(ring, "_flash_bwd_equal", dense_bwd)
    q, k, v, cu = _packed([6, 9, 3])
    args = (cu, cu, 9, 9, True, 0.3)
    out, lse = ring._flash_fwd(q, k, v, *args)
    want_out, want_lse = ring._dense_fwd(q, k, v, cu, cu, True, 0.3)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    dout = torch.randn_like(want_out)
    got = ring._flash_bwd(dout, q, k, v, want_out, want_lse, *args)
    want = ring._dense_bwd(dout, q, k, v, want_out, want_lse, cu, cu, True, 0.3)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def _model_cfg(**extra) -> ModelConfig:
    from core.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, ffn_dim=16, num_shared_experts=1, first_k_dense=1)
    return ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=64, attention="mla",
                       q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                       moe=moe, **extra)


def _batch(seed: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens, labels = torch.randint(0, 64, (total,), generator=g), torch.randint(0, 64, (total,), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return tokens, labels, positions, _meta(lengths)


def _loss_and_grads(model, batch):
    from core.train.loss import cross_entropy_sum

    tokens, labels, positions, meta = batch
    loss, count = cross_entropy_sum(model(tokens, positions, meta), labels)
    (loss / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return (loss / count).detach(), grads


@pytest.mark.parametrize("modules", [("mla_up",), ("mla_up", "norms", "swiglu"), ("attention_core", "norms"),
                                     ("attention",), ("block",)])
def test_recomputed_mla_blocks_give_the_same_gradients(modules):
    """Recomputation reruns the forward's own operations: losses and gradients bit for bit."""
    from core.parallel.recompute import apply_recompute
    from core.train.model import build_model

    cfg, batch = _model_cfg(), _batch(4, [9, 20, 3])
    want_loss, want = _loss_and_grads(build_model(cfg, seed=5), batch)
    model = apply_recompute(build_model(cfg, seed=5), "none", modules)
    if "mla_up" in modules:
        assert all(block.attention.recompute_up for block in model.layers.values())
    got_loss, got = _loss_and_grads(model, batch)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_compiled_mla_blocks_match_eager(monkeypatch):
    """train.compile on an MLA MoE model with `mla_up` recomputed: the eager losses and gradients, and
    new document boundaries reuse the graphs (aot_eager: dynamo's capture without inductor's build)."""
    import torch._dynamo

    from core.parallel.recompute import apply_recompute
    from core.train.model import build_model
    from core.train.parallelize import COMPILE_BACKEND_ENV, compile_blocks

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    cfg = _model_cfg()
    eager = apply_recompute(build_model(cfg, seed=5), "none", ("mla_up",))
    compiled = apply_recompute(build_model(cfg, seed=5), "none", ("mla_up",), compiled=True)
    torch._dynamo.reset()
    compile_blocks([compiled])
    try:
        for i, lengths in enumerate([[40, 24], [10, 50, 4]]):
            torch._dynamo.config.error_on_recompile = i > 0
            want_loss, want = _loss_and_grads(eager, _batch(i, lengths))
            got_loss, got = _loss_and_grads(compiled, _batch(i, lengths))
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()


def test_fp8_treats_mla_linears_as_block_linears():
    """Blockwise FP8 swaps every MLA linear whose local sizes are multiples of 128 and keeps the
    others (here the 576-wide kv down-projection, 512 latent + 64 rotary) in the model's precision."""
    from core.train.model import build_model
    from core.train.parallelize import apply_fp8

    cfg = ModelConfig(vocab_size=256, dim=256, num_layers=1, num_heads=2, ffn_dim=256, attention="mla",
                      q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    runs = apply_fp8(build_model(cfg, seed=0), dense=True)
    attn = {k.split("attention.")[1]: v for k, v in runs.items() if ".attention." in k}
    assert attn == {"wq_a": "fp8", "wq_b": "fp8", "wkv_a": "bf16", "wkv_b": "fp8", "wo": "fp8"}, attn


@pytest.mark.parametrize("keys,needle", [
    (["train.recompute_modules=[\"mla_up\"]"], "model.attention='gqa'"),
    (["model.attention=mla", "model.kv_lora_rank=8", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
      "model.v_head_dim=8", "train.offload_modules=[\"mla_up\"]"], "cannot name 'mla_up'"),
])
def test_mla_up_config_errors(keys, needle):
    from pathlib import Path

    from core.config import load_config
    from core.validation import check_config

    config = load_config(Path(__file__).resolve().parents[1] / "launch" / "configs" / "tiny_dense.toml", keys)
    with pytest.raises(ConfigError, match=needle):
        check_config(config)
