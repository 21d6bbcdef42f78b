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
