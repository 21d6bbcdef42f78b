"""The Hugging Face model families Tessera reads and writes, and how their configs and tensors map.

Families: Llama (3.x; `LlamaForCausalLM`), Qwen3 (`Qwen3ForCausalLM`), Qwen3-MoE
(`Qwen3MoeForCausalLM`), Mixtral (`MixtralForCausalLM`), DeepSeek-V3 (`DeepseekV3ForCausalLM`:
V3/V3.1, Kimi K2, Moonlight; multi-head latent attention, see below) and GLM-4-MoE
(`Glm4MoeForCausalLM`: grouped-query attention with DeepSeek-V3's MoE). The first four are the same decoder as
`core.train.model.GPT`: RMSNorm before attention and feed-forward, grouped-query attention with
rotary positions on the two halves of each head (Hugging Face's `rotate_half`, the layout its
checkpoints use, so q/k weights need no permutation), SwiGLU feed-forward layers, and routed
SwiGLU experts chosen by a softmax over the router's logits.

Config: `model_config(hf)` turns config.json into a `core.config.ModelConfig` or raises
`Unsupported` (one sentence) for what Tessera's model cannot compute (sliding windows, rope
types other than linear/llama3/yarn, MLP biases, activations other than SiLU, ...);
`hf_config(model)` writes a config.json for a Tessera model that was not imported.

DeepSeek-V3 and GLM-4-MoE route by DeepSeek's `noaux_tc`: sigmoid scores, a group's score the
sum of its best 2 (imported as `model.moe.group_score_experts = 2`; an export needs that
count), the correction bias (`e_score_correction_bias` = the router's `expert_bias` buffer)
in the selection only, one shared SwiGLU of n_shared_experts * moe_intermediate_size, and dense
layers before first_k_dense_replace. DeepSeek's checkpoints interleave the rotary rows of the
queries and of the shared rotary key (`rope_interleave`, default true); Tessera rotates the two
halves, so those rows are permuted on the way in and back on the way out (`Link.interleaved`).
Its MTP layers, `model.layers.{num_hidden_layers + k}`, map to `mtp.{k}` where the model has them.

Tensors: `tensor_map(family, names)` pairs every Tessera parameter name with the Hugging Face
key(s) it comes from. A `Link` is either a copy (same layout: `nn.Linear` weights are
[out, in] on both sides) or the experts of one MoE layer: Tessera stacks them as
[E, in, out] (`moe.experts.GroupedExperts`), Hugging Face checkpoints hold one [out, in]
matrix per expert, so expert e is the transpose of slice e. The gate and up projections are
one Tessera tensor, w13 [E, in, 2, out]: its link has two keys per expert (`parts`), gate_proj
the transpose of w13[e, :, 0] and up_proj of w13[e, :, 1].
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from core.config import ModelConfig
from core.rules import group_score_experts, moe_layer_rule

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
}
MODEL_TYPES = {family: family for family in ARCHITECTURES.values()}
ARCHITECTURE_OF = {family: arch for arch, family in ARCHITECTURES.items()}

# Non-weight files of a Hugging Face model folder that travel with the weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


class Unsupported(ValueError):
    """A model or value the conversion cannot represent; the message is one sentence for the user."""


def _has(section, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(section))


def family_of(hf: dict) -> str:
    """The family of a config.json, from `architectures` (or `model_type`); Unsupported otherwise."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    named = ", ".join(archs) if archs else f"model_type {hf.get('model_type')!r}"
    raise Unsupported(f"unknown architecture {named}; supported: {', '.join(ARCHITECTURES)}")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope theta, the scaling dict or None) from either config.json style: `rope_theta` +
    `rope_scaling` (older files) or `rope_parameters` (transformers 5)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), (None if kind in (None, "default") else params)
    theta = hf.get("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) not in (None, "default"):
        return float(theta), scaling
    return float(theta), None


def _rope_scaling(model: ModelConfig, scaling: dict, hf: dict) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("linear", "llama3", "yarn"):
        raise Unsupported(f"rope scaling type {kind!r} is not supported (supported: linear, llama3, yarn)")
    if not _has(ModelConfig, "rope_scaling"):
        raise Unsupported(f"rope scaling {kind!r} needs model.rope_scaling, which this Tessera does not have")
    rs = model.rope_scaling
    rs.type = kind
    rs.factor = float(scaling.get("factor", 1.0))
    original = scaling.get("original_max_position_embeddings")
    if kind == "llama3":
        rs.original_max_position_embeddings = int(original or 8192)
        rs.low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        rs.high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    elif kind == "yarn":
        rs.original_max_position_embeddings = int(original or hf.get("max_position_embeddings") or 0)
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if scaling.get(key) is not None and _has(type(rs), key):
                setattr(rs, key, float(scaling[key]))
            elif scaling.get(key) is not None:
                raise Unsupported(f"yarn rope scaling with {key} needs model.rope_scaling.{key}, which this Tessera lacks")
        if scaling.get("truncate") is not None and _has(type(rs), "truncate"):
            rs.truncate = bool(scaling["truncate"])


def model_config(hf: dict) -> tuple[str, ModelConfig]:
    """(family, Tessera model config) of a config.json; Unsupported for what cannot be represented."""
    family = family_of(hf)
    m = ModelConfig()
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise Unsupported(f"hidden_act={act!r} is not supported (Tessera's feed-forward layers are SwiGLU: silu)")
    if hf.get("mlp_bias"):
        raise Unsupported("mlp_bias=true is not supported (Tessera's feed-forward layers have no biases)")
    if family in ("mixtral",) and hf.get("sliding_window") is not None:
        raise Unsupported(f"sliding_window={hf['sliding_window']} is not supported (attention is causal over "
                          f"whole documents); set it to null if the model does not need it")
    if family in ("qwen3", "qwen3_moe"):
        if hf.get("use_sliding_window"):
            raise Unsupported("use_sliding_window=true is not supported (attention is causal over whole documents)")
        if any(t != "full_attention" for t in hf.get("layer_types") or []):
            raise Unsupported("layer_types other than full_attention (sliding-window layers) are not supported")
    m.vocab_size = int(hf["vocab_size"])
    m.dim = int(hf["hidden_size"])
    m.num_layers = int(hf["num_hidden_layers"])
    m.num_heads = int(hf["num_attention_heads"])
    m.num_kv_heads = int(hf.get("num_key_value_heads") or m.num_heads)
    m.ffn_dim = int(hf["intermediate_size"])
    m.norm_eps = float(hf.get("rms_norm_eps", 1e-6))
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    m.rope_theta, scaling = _rope(hf)
    if scaling is not None:
        _rope_scaling(m, scaling, hf)
    if family == "deepseek_v3":
        _deepseek(m, hf)
        return family, m
    if family == "glm4_moe":
        _glm4_moe(m, hf)
    head_dim = hf.get("head_dim") or m.dim // m.num_heads
    if head_dim != m.dim // m.num_heads or m.dim % m.num_heads:
        if not _has(ModelConfig, "head_dim"):
            raise Unsupported(f"head_dim={head_dim} differs from hidden_size/num_attention_heads; this Tessera has no "
                              f"model.head_dim")
        m.head_dim = int(head_dim)
    if hf.get("attention_bias"):
        if not _has(ModelConfig, "attention_bias"):
            raise Unsupported("attention_bias=true needs model.attention_bias, which this Tessera does not have")
        m.attention_bias = True
    if family in ("qwen3", "qwen3_moe") or (family == "glm4_moe" and hf.get("use_qk_norm")):
        if not _has(ModelConfig, "qk_norm"):
            raise Unsupported(f"{family} normalises queries and keys per head; this Tessera has no model.qk_norm")
        m.qk_norm = True
    if family == "mixtral":
        _moe(m, experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], hidden=m.ffn_dim, normalize=True,
             aux=hf.get("router_aux_loss_coef", 0.0))
    elif family == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        _moe(m, experts=experts, top_k=hf["num_experts_per_tok"], hidden=int(hf["moe_intermediate_size"]),
             normalize=bool(hf.get("norm_topk_prob", False)), aux=hf.get("router_aux_loss_coef", 0.0))
        _qwen3_moe_layers(m, int(hf.get("decoder_sparse_step", 1) or 1), list(hf.get("mlp_only_layers") or []))
    return family, m


def _deepseek(m: ModelConfig, hf: dict) -> None:
    """DeepSeek-V3 (also V3.1, Kimi K2, Moonlight): multi-head latent attention and sigmoid-scored
    experts chosen within the best groups with the correction bias, plus shared experts; the
    first `first_k_dense_replace` layers dense."""
    if hf.get("num_key_value_heads") not in (None, m.num_heads):
        raise Unsupported(f"num_key_value_heads={hf['num_key_value_heads']} differs from num_attention_heads={m.num_heads}; "
                          f"multi-head latent attention has one key and value per head")
    m.attention, m.num_kv_heads = "mla", m.num_heads
    m.q_lora_rank = int(hf.get("q_lora_rank") or 0)
    m.kv_lora_rank, m.v_head_dim = int(hf["kv_lora_rank"]), int(hf["v_head_dim"])
    m.qk_nope_head_dim, m.qk_rope_head_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    m.attention_bias = bool(hf.get("attention_bias", False))
    if hf.get("moe_layer_freq", 1) not in (None, 1):
        raise Unsupported(f"moe_layer_freq={hf['moe_layer_freq']} is not supported (transformers' DeepseekV3 makes every "
                          f"layer from first_k_dense_replace on an MoE layer: set it to 1)")
    _deepseek_routing(m, hf, experts=int(hf["n_routed_experts"]))
    if _has(ModelConfig, "mtp_layers"):
        m.mtp_layers = int(hf.get("num_nextn_predict_layers") or 0)


def _deepseek_routing(m: ModelConfig, hf: dict, experts: int) -> None:
    """The MoE of DeepSeek-V3 and GLM-4-MoE (one router design: `noaux_tc`)."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise Unsupported(f"scoring_func={hf['scoring_func']!r} is not supported (this architecture scores experts by a "
                          f"sigmoid)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise Unsupported(f"topk_method={hf['topk_method']!r} is not supported (supported: noaux_tc, the group-limited "
                          f"top-k of the sigmoid scores plus the correction bias)")
    top_k, groups, topk_groups = int(hf["num_experts_per_tok"]), int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    _moe(m, experts=experts, top_k=top_k, hidden=int(hf["moe_intermediate_size"]),
         normalize=bool(hf.get("norm_topk_prob", True)), aux=float(hf.get("aux_loss_alpha") or 0.0))
    moe = m.moe
    moe.router, moe.n_groups, moe.topk_groups = "sigmoid", groups, topk_groups
    if groups > 1:  # the architecture scores a group by its best 2 experts
        if not _has(type(moe), "group_score_experts"):
            raise Unsupported("group-limited routing needs model.moe.group_score_experts, which this Tessera lacks")
        moe.group_score_experts = DEEPSEEK_GROUP_SCORE_EXPERTS
    moe.aux_loss_per_sequence = bool(hf.get("seq_aux", False))
    moe.routed_scaling_factor = float(hf.get("routed_scaling_factor", 1.0))
    moe.num_shared_experts = int(hf.get("n_shared_experts") or 0)
    if not moe.num_shared_experts:
        raise Unsupported("n_shared_experts=0 is not supported (the architecture then holds empty shared-expert "
                          "tensors, which Tessera does not read)")
    moe.first_k_dense = int(hf.get("first_k_dense_replace") or 0)


DEEPSEEK_GROUP_SCORE_EXPERTS = 2  # DeepSeek-V3 and GLM-4-MoE score a group by its best two experts


def _glm4_moe(m: ModelConfig, hf: dict) -> None:
    """GLM-4-MoE: grouped-query attention (optional qk-norm, biases on q, k, v only) with
    DeepSeek-V3's MoE."""
    rope = hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))  # transformers' default: 0.5
    if partial != 1.0:
        raise Unsupported(f"partial_rotary_factor={partial} is not supported (Tessera's rotary covers the whole head)")
    if hf.get("attention_bias"):
        raise Unsupported("attention_bias=true is not supported for glm4_moe (biases on q, k and v without one on "
                          "o_proj; Tessera's attention biases are on all four)")
    _deepseek_routing(m, hf, experts=int(hf["n_routed_experts"]))


def _moe(m: ModelConfig, experts: int, top_k: int, hidden: int, normalize: bool, aux: float) -> None:
    moe = m.moe
    moe.num_experts, moe.top_k, moe.ffn_dim = int(experts), int(top_k), int(hidden)
    moe.router, moe.normalize_topk = "softmax", normalize
    moe.aux_loss_coeff = float(aux or 0.0)


def _qwen3_moe_layers(m: ModelConfig, step: int, mlp_only: list[int]) -> None:
    """Qwen3-MoE: layer i is sparse when (i+1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers. Tessera: first_k_dense, moe_every, and the dense_layers list."""
    sparse = [i for i in range(m.num_layers) if (i + 1) % step == 0 and i not in mlp_only]
    if not sparse:
        raise Unsupported("decoder_sparse_step and mlp_only_layers leave no MoE layer; convert it as a dense model")
    moe = m.moe
    moe.first_k_dense, moe.moe_every = step - 1, step
    pattern = [i for i in range(m.num_layers) if i >= moe.first_k_dense and (i - moe.first_k_dense) % step == 0]
    dense = sorted(set(pattern) - set(sparse))
    if dense:
        if not _has(type(moe), "dense_layers"):
            raise Unsupported(f"mlp_only_layers={mlp_only} needs model.moe.dense_layers, which this Tessera lacks")
        moe.dense_layers = dense


def _rope_dict(m: ModelConfig) -> dict | None:
    rs = getattr(m, "rope_scaling", None)
    if rs is None or rs.type == "none":
        return None
    out = {"rope_type": rs.type, "factor": rs.factor}
    if rs.type == "llama3":
        out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                   original_max_position_embeddings=rs.original_max_position_embeddings)
    elif rs.type == "yarn":
        out.update(original_max_position_embeddings=rs.original_max_position_embeddings, beta_fast=rs.beta_fast,
                   beta_slow=rs.beta_slow)
        if rs.attention_factor:
            out["attention_factor"] = rs.attention_factor
        for key in ("mscale", "mscale_all_dim"):
            if getattr(rs, key, 0.0):
                out[key] = getattr(rs, key)
        if hasattr(rs, "truncate") and not rs.truncate:
            out["truncate"] = False
    return out


def export_family(m: ModelConfig) -> str:
    """The family a Tessera model is written as when it was not imported; Unsupported when none fits.

    Multi-head latent attention: DeepSeek-V3. Grouped-query attention: Llama or Qwen3 (dense,
    without or with qk-norm), Mixtral or Qwen3-MoE (softmax routing, no shared experts), or
    GLM-4-MoE (DeepSeek-V3's routing: sigmoid scores, correction bias, groups, shared experts,
    dense first layers). Softmax routing with shared experts has no Hugging Face family here:
    Qwen2-MoE gates its shared expert by a sigmoid of the token, which Tessera lacks."""
    moe = m.moe
    qk = getattr(m, "qk_norm", False)
    deepseek_routing = moe.num_experts and (moe.router == "sigmoid" or moe.num_shared_experts > 0)
    if getattr(m, "attention", "gqa") != "mla" and moe.num_experts and moe.router == "softmax" and moe.num_shared_experts:
        raise Unsupported("no Hugging Face family here represents softmax routing with shared experts (GLM-4-MoE and "
                          "DeepSeek-V3 score experts by a sigmoid; Qwen2-MoE gates its shared expert by a learned "
                          "sigmoid, which Tessera lacks): train with model.moe.router='sigmoid' to export")
    if getattr(m, "attention", "gqa") == "mla" or deepseek_routing:
        family = "deepseek_v3" if getattr(m, "attention", "gqa") == "mla" else "glm4_moe"
        _check_deepseek_export(m, family)
        return family
    if not moe.num_experts:
        return "qwen3" if qk else "llama"
    problems = [what for what, bad in (
        ("group-limited routing", moe.n_groups > 1), ("routed_scaling_factor != 1", moe.routed_scaling_factor != 1.0),
        ("expert bias balancing", moe.bias_update_rate > 0), ("capacity dropping", moe.capacity_factor > 0),
    ) if bad]
    if problems:
        raise Unsupported(f"no Hugging Face family here represents a softmax-routed MoE model with {', '.join(problems)}")
    if qk:
        return "qwen3_moe"
    if moe.first_k_dense or moe.moe_every != 1 or getattr(moe, "dense_layers", None) or not moe.normalize_topk:
        raise Unsupported("no Hugging Face family represents this MoE model: Mixtral has no dense layers and "
                          "renormalises the top-k weights, Qwen3-MoE needs model.qk_norm")
    return "mixtral"


def _check_deepseek_export(m: ModelConfig, family: str) -> None:
    moe = m.moe
    arch = ARCHITECTURE_OF[family]
    if not moe.num_experts:
        raise Unsupported(f"{arch} (the family of model.attention='mla') needs MoE layers: set model.moe.num_experts")
    problems = [what for what, bad in (
        ("softmax routing (it scores experts by a sigmoid)", moe.router != "sigmoid"),
        ("no shared expert (set model.moe.num_shared_experts >= 1)", moe.num_shared_experts < 1),
        ("a shared expert size other than num_shared_experts * the expert size",
         moe.shared_ffn_dim not in (0, moe.num_shared_experts * (moe.ffn_dim or m.ffn_dim))),
        ("dense layers other than the first first_k_dense", moe.moe_every != 1 or bool(getattr(moe, "dense_layers", None))),
        ("capacity dropping", moe.capacity_factor > 0),
        ("group scores over other than the best 2 experts (set model.moe.group_score_experts=2)",
         moe.n_groups > 1 and moe.topk_groups < moe.n_groups
         and group_score_experts(moe) != min(DEEPSEEK_GROUP_SCORE_EXPERTS, moe.num_experts // moe.n_groups)),
        ("attention biases (it has none on o_proj)", family == "glm4_moe" and getattr(m, "attention_bias", False)),
    ) if bad]
    if problems:
        raise Unsupported(f"{arch} cannot represent this model: {'; '.join(problems)}")


def hf_config(m: ModelConfig, family: str, dtype: str) -> dict:
    """A config.json for a Tessera model (`export_family` picks the family)."""
    if family in DEEPSEEK_MOE:
        return _deepseek_config(m, family, dtype)
    head_dim = m.attention_head_dim if hasattr(m, "attention_head_dim") else m.dim // m.num_heads
    out = {
        "architectures": [ARCHITECTURE_OF[family]], "model_type": family, "vocab_size": m.vocab_size,
        "hidden_size": m.dim, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": _max_positions(m), "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": _rope_dict(m), "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": bool(getattr(m, "attention_bias", False)), "attention_dropout": 0.0, "dtype": dtype,
    }
    if family == "llama":
        out["mlp_bias"] = False
    moe = m.moe
    if family == "mixtral":
        out.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k, sliding_window=None,
                   intermediate_size=moe.ffn_dim or m.ffn_dim, router_aux_loss_coef=moe.aux_loss_coeff)
    if family in ("qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3_moe":
        moe_layers = [i for i in range(m.num_layers) if moe_layer_rule(moe, i)]
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.ffn_dim or m.ffn_dim,
                   norm_topk_prob=moe.normalize_topk, decoder_sparse_step=1, router_aux_loss_coef=moe.aux_loss_coeff,
                   mlp_only_layers=[i for i in range(m.num_layers) if i not in moe_layers])
    return out


def _deepseek_config(m: ModelConfig, family: str, dtype: str) -> dict:
    """DeepSeek-V3 (MLA) or GLM-4-MoE (GQA) with DeepSeek-V3's MoE; rotary rows on the halves
    (rope_interleave false: Tessera's layout, no permutation)."""
    moe = m.moe
    out = {
        "architectures": [ARCHITECTURE_OF[family]], "model_type": family, "vocab_size": m.vocab_size,
        "hidden_size": m.dim, "intermediate_size": m.ffn_dim, "moe_intermediate_size": moe.ffn_dim or m.ffn_dim,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads, "hidden_act": "silu",
        "max_position_embeddings": _max_positions(m), "rms_norm_eps": m.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta, **(_rope_dict(m) or {})},
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": bool(getattr(m, "attention_bias", False)),
        "attention_dropout": 0.0, "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.num_shared_experts, "routed_scaling_factor": moe.routed_scaling_factor,
        "n_group": moe.n_groups, "topk_group": moe.topk_groups, "norm_topk_prob": moe.normalize_topk,
        "first_k_dense_replace": moe.first_k_dense, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": int(getattr(m, "mtp_layers", 0) or 0), "dtype": dtype,
    }
    if family == "deepseek_v3":
        out.update(num_key_value_heads=m.num_heads, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                   qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                   rope_interleave=False)
    else:
        out.update(num_key_value_heads=m.num_kv_heads, head_dim=m.attention_head_dim,
                   use_qk_norm=bool(getattr(m, "qk_norm", False)), partial_rotary_factor=1.0)
        out["rope_parameters"]["partial_rotary_factor"] = 1.0
    return out


def with_context_of(hf: dict, m: ModelConfig) -> dict:
    """An import's config.json carrying model `m`'s RoPE scaling and context length, when they
    differ from the import's (a long-context fine-tune changes them); otherwise `hf` itself."""
    if model_config(hf)[1].rope_scaling == m.rope_scaling:
        return hf
    out, rope = dict(hf), _rope_dict(m)
    if "rope_parameters" in out:  # transformers 5 keeps rope_theta and the scaling together
        out["rope_parameters"] = {"rope_theta": m.rope_theta, **(rope or {"rope_type": "default"})}
    else:
        out["rope_scaling"] = rope
    if rope is not None and m.rope_scaling.original_max_position_embeddings:
        out["max_position_embeddings"] = _max_positions(m)
    return out


def _max_positions(m: ModelConfig) -> int:
    rs = getattr(m, "rope_scaling", None)
    if rs is not None and rs.type != "none" and rs.original_max_position_embeddings:
        return int(math.ceil(rs.original_max_position_embeddings * rs.factor))
    return 8192


# ------------------------------------------------------------------------------------ tensors
@dataclass(frozen=True)
class Link:
    """One Tessera tensor and the Hugging Face key(s) it is made of."""

    name: str  # Tessera parameter name
    hf: tuple[str, ...]  # one key (a copy), or `parts` per expert, expert by expert (stacked and transposed)
    experts: bool = False
    parts: int = 1  # keys per expert: several are stacked along Tessera's dim 2 (w13: gate, up)
    # (block, rope): the rows come in blocks of `block` whose last `rope` rows hold rotary
    # features, interleaved in pairs in the Hugging Face tensor (DeepSeek's rope_interleave) and
    # on the two halves in Tessera's: `to_tessera` / `to_hf` permute them.
    interleaved: tuple[int, int] | None = None
    fp32: bool = False  # written as float32 whatever the output dtype (DeepSeek's correction bias)

    def expert_keys(self) -> list[tuple[str, ...]]:
        """Each expert's keys, in the order they stack."""
        return [self.hf[i:i + self.parts] for i in range(0, len(self.hf), self.parts)]

    def expert_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        """The stacked tensor's shape for Hugging Face matrices of [out, in]: [E, in, out], or
        [E, in, parts, out] with several keys per expert."""
        experts = len(self.hf) // self.parts
        if self.parts == 1:
            return experts, in_features, out_features
        return experts, in_features, self.parts, out_features

    def _rows(self, inverse: bool) -> torch.Tensor | None:
        if self.interleaved is None:
            return None
        block, rope = self.interleaved
        order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))  # pairs -> halves
        if inverse:
            order = torch.argsort(order)
        return torch.cat((torch.arange(block - rope), block - rope + order))

    def to_tessera(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = self._rows(inverse=False)
        if rows is None:
            return tensor
        return tensor.unflatten(0, (-1, rows.numel()))[:, rows].flatten(0, 1).contiguous()

    def to_hf(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = self._rows(inverse=True)
        if rows is None:
            return tensor
        return tensor.unflatten(0, (-1, rows.numel()))[:, rows].flatten(0, 1).contiguous()


_BLOCK = [  # Tessera suffix inside layers.{i}. -> Hugging Face suffix inside model.layers.{i}.
    (r"attention_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"attention\.w([qkv])\.(weight|bias)", r"self_attn.\1_proj.\2"),
    (r"attention\.wo\.(weight|bias)", r"self_attn.o_proj.\1"),
    (r"attention\.(q|k)_norm\.weight", r"self_attn.\1_norm.weight"),
    (r"feed_forward\.w1\.weight", "mlp.gate_proj.weight"),
    (r"feed_forward\.w3\.weight", "mlp.up_proj.weight"),
    (r"feed_forward\.w2\.weight", "mlp.down_proj.weight"),
]
_MLA = [  # multi-head latent attention (core/mla.py), before _BLOCK: its q_norm is q_a_layernorm
    (r"attention\.wq\.weight", "self_attn.q_proj.weight"),
    (r"attention\.wq_a\.(weight|bias)", r"self_attn.q_a_proj.\1"),
    (r"attention\.q_norm\.weight", "self_attn.q_a_layernorm.weight"),
    (r"attention\.wq_b\.weight", "self_attn.q_b_proj.weight"),
    (r"attention\.wkv_a\.(weight|bias)", r"self_attn.kv_a_proj_with_mqa.\1"),
    (r"attention\.kv_norm\.weight", "self_attn.kv_a_layernorm.weight"),
    (r"attention\.wkv_b\.weight", "self_attn.kv_b_proj.weight"),
]
_SHARED = [  # DeepSeek-V3's shared experts: one SwiGLU of n_shared_experts * moe_intermediate_size
    (r"feed_forward\.shared_experts\.w1\.weight", "mlp.shared_experts.gate_proj.weight"),
    (r"feed_forward\.shared_experts\.w3\.weight", "mlp.shared_experts.up_proj.weight"),
    (r"feed_forward\.shared_experts\.w2\.weight", "mlp.shared_experts.down_proj.weight"),
    (r"feed_forward\.router\.expert_bias", "mlp.gate.e_score_correction_bias"),
]
_PER_EXPERT = {"w13": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
               "w2": ("mlp.experts.{e}.down_proj.weight",)}
_MOE = {  # family -> (router key, {Tessera expert tensor: its per-expert key patterns, in stacking order})
    "mixtral": ("block_sparse_moe.gate.weight",
                {"w13": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
                 "w2": ("block_sparse_moe.experts.{e}.w2.weight",)}),
    "qwen3_moe": ("mlp.gate.weight", _PER_EXPERT),
    "deepseek_v3": ("mlp.gate.weight", _PER_EXPERT),
    "glm4_moe": ("mlp.gate.weight", _PER_EXPERT),
}
DEEPSEEK_MOE = ("deepseek_v3", "glm4_moe")  # families with shared experts and the correction bias
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
# Tessera's MTP module k -> DeepSeek's layer num_hidden_layers + k (besides a decoder layer's keys)
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight"}
EXPERT_BIAS = "feed_forward.router.expert_bias"


def _block_link(family: str, name: str, rest: str, prefix: str, shape: tuple[int, ...], model: ModelConfig | None,
                hf: dict | None) -> Link | None:
    """The link of a decoder block's tensor (`rest` inside the block), or None where none fits."""
    moe = _MOE.get(family)
    if moe is not None and rest == "feed_forward.router.weight":
        return Link(name, (prefix + moe[0],))
    expert = re.fullmatch(r"feed_forward\.experts\.(w13|w2)", rest)
    if moe is not None and expert:
        patterns = moe[1][expert.group(1)]
        keys = tuple(prefix + pattern.format(e=e) for e in range(shape[0]) for pattern in patterns)
        return Link(name, keys, experts=True, parts=len(patterns))
    table = _BLOCK
    if family in DEEPSEEK_MOE:
        table = _SHARED + table
    if family == "deepseek_v3":
        table = _MLA + table
    for tessera, key in table:
        if re.fullmatch(tessera, rest):
            return Link(name, (prefix + re.sub(tessera, key, rest),), interleaved=_interleaved(family, rest, model, hf),
                        fp32=rest == EXPERT_BIAS)
    return None


def _interleaved(family: str, rest: str, model: ModelConfig | None, hf: dict | None) -> tuple[int, int] | None:
    """DeepSeek's rope_interleave (true unless the config says otherwise): the rotary rows of the
    queries (per head) and of the shared rotary key (after the kv latent) are in pairs."""
    if family != "deepseek_v3" or model is None or hf is None or not hf.get("rope_interleave", True):
        return None
    rope = model.qk_rope_head_dim
    if rest in ("attention.wq.weight", "attention.wq_b.weight"):
        return model.qk_nope_head_dim + rope, rope
    if rest in ("attention.wkv_a.weight", "attention.wkv_a.bias"):
        return model.kv_lora_rank + rope, rope
    return None


def tensor_map(family: str, shapes: dict[str, tuple[int, ...]], model: ModelConfig | None = None,
               hf: dict | None = None) -> list[Link]:
    """A Link for every Tessera tensor in `shapes` ({name: full shape}, tied weights once; the
    routers' expert biases where the family holds them); Unsupported for a parameter no key of
    the family holds. `model` and `hf` (the config.json) give DeepSeek's layer count and rotary
    layout; without `hf` the rotary rows are not interleaved (what to-hf writes for a new model)."""
    links = []
    for name, shape in shapes.items():
        if name in _TOP:
            links.append(Link(name, (_TOP[name],)))
            continue
        layer = _LAYER.match(name)
        mtp = _MTP.match(name)
        link = None
        if layer is not None:
            index, rest = layer.groups()
            if rest == EXPERT_BIAS and family not in DEEPSEEK_MOE:
                continue  # the family has no bias: to-hf checks it is zero
            link = _block_link(family, name, rest, f"model.layers.{index}.", shape, model, hf)
        elif mtp is not None and family == "deepseek_v3" and model is not None:
            k, rest = mtp.groups()
            prefix = f"model.layers.{model.num_layers + int(k)}."
            if rest in _MTP_OWN:
                link = Link(name, (prefix + _MTP_OWN[rest],))
            elif rest.startswith("block."):
                link = _block_link(family, name, rest[len("block."):], prefix, shape, model, hf)
        if link is None:
            raise Unsupported(f"the {family} format has no place for the tensor '{name}'")
        links.append(link)
    return links


def mtp_copies(family: str, model: ModelConfig) -> list[tuple[str, str]]:
    """(Hugging Face key, the Tessera tensor it copies) of the embedding and output head that
    DeepSeek's files hold again in each MTP layer (Tessera shares the main model's)."""
    if family != "deepseek_v3":
        return []
    head = "tok_embeddings.weight" if model.tie_embeddings else "output.weight"
    out = []
    for k in range(int(getattr(model, "mtp_layers", 0) or 0)):
        prefix = f"model.layers.{model.num_layers + k}."
        out += [(prefix + "embed_tokens.weight", "tok_embeddings.weight"), (prefix + "shared_head.head.weight", head)]
    return out


def mtp_layers_in(keys, num_layers: int) -> int:
    """How many MTP layers (model.layers.{num_layers + k}.*) a checkpoint's keys hold."""
    found = set()
    for key in keys:
        match = re.match(r"^model\.layers\.(\d+)\.", key)
        if match and int(match.group(1)) >= num_layers:
            found.add(int(match.group(1)))
    return len(found)


# Keys of some Hugging Face checkpoints that are not weights (recomputed by the model).
IGNORED_KEYS = re.compile(r".*rotary_emb\.inv_freq$")
