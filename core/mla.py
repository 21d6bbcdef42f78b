"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the attention of `model.attention = "mla"`.

Keys and values come from one compressed latent per token: `wkv_a` maps the hidden state to
`kv_lora_rank` latent features plus one rotary key of `qk_rope_head_dim` features shared by
every head; the latent is RMS-normalised (`kv_norm`) and `wkv_b` expands it into each head's
non-rotary key (`qk_nope_head_dim`) and value (`v_head_dim`). Queries are either one
projection (`wq`, `q_lora_rank = 0`: the V2-Lite / Moonlight shape) or compressed the same way
(`wq_a`, `q_norm`, `wq_b`). Each head's query and key are [nope | rope] (the rotary part on the
halves of its features, like the rest of Tessera; `interop` permutes DeepSeek's interleaved
checkpoints into that layout), and the value head can be narrower than the query/key head.

The core is the same document-causal `core_attention(q, k, v, meta)` as grouped-query
attention (one key/value head per query head, v narrower than q/k), so ring and dynamic context
parallelism and the recompute targets apply unchanged. Recompute `mla_up`
(`recompute_up = True`, set by core.parallel.recompute) runs everything after the latents --
q_norm and wq_b (or wq), kv_norm and wkv_b, the rotary embedding and the core -- under one
checkpoint: the backward keeps only the latents (and wq's input), not the per-head q, k and v,
which are heads * (2 * (nope + rope) + v) features per token against kv_lora_rank + rope
(+ q_lora_rank). Yarn's DeepSeek softmax scale (mscale squared) is
folded into the queries so every core keeps its default 1/sqrt(head dim) scale.

Submodule names follow DeepSeek's reference implementation; the parallelize steps rewrite
them in place (heads split over tp: `wq`/`wq_b`, `wkv_b` column-parallel, `wo` row-parallel;
the down-projections and their norms replicated).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.config import ModelConfig
from core.layers import AttentionMeta, CoreAttention, RMSNorm, apply_rotary

# DeepSeek's latent norms use RMSNorm's default epsilon whatever rms_norm_eps says (the
# reference code and transformers both construct them without it).
LATENT_NORM_EPS = 1e-6


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """The factor DeepSeek's yarn puts on the 1/sqrt(d) softmax scale: mscale(factor, mscale_all_dim)
    squared when the rotary scaling is yarn with `mscale_all_dim` set, else 1."""
    r = cfg.rope_scaling
    if r.type == "none" or not r.mscale_all_dim or r.factor <= 1:
        return 1.0
    mscale = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
    return mscale * mscale


class MLAttention(nn.Module):
    """Multi-head latent attention; forward(x [T, dim], rope, meta) -> [T, dim]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.head_dim = self.nope_dim + self.rope_dim  # of queries and keys
        heads, bias = cfg.num_heads, cfg.attention_bias
        if cfg.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * self.head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(cfg.dim, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, cfg.dim, bias=bias)
        self.core_attention = CoreAttention()
        self.query_scale = softmax_scale_factor(cfg)
        self.recompute_up = False  # recompute "mla_up" (core.parallel.recompute)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        q_in = x if self.wq is not None else self.wq_a(x)  # the query latent, or x itself
        kv_in = self.wkv_a(x)  # [T, kv_lora_rank + rope]: the key/value latent and the rotary key
        if self.recompute_up:
            out = checkpoint(self._expand_and_attend, q_in, kv_in, rope, meta, use_reentrant=False)
        else:
            out = self._expand_and_attend(q_in, kv_in, rope, meta)
        return self.wo(out.flatten(-2))

    def _expand_and_attend(self, q_in: torch.Tensor, kv_in: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                           meta: AttentionMeta) -> torch.Tensor:
        """The up-projections, the rotary embedding and the core: [T, heads, v_dim] (this rank's heads)."""
        q = self.wq(q_in) if self.wq is not None else self.wq_b(self.q_norm(q_in))
        q_nope, q_rope = q.unflatten(-1, (-1, self.head_dim)).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = kv_in.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).unflatten(-1, (-1, self.nope_dim + self.v_dim))
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = apply_rotary(q_rope, *rope)
        k_rope = apply_rotary(k_rope.unsqueeze(1), *rope)  # one rotary key shared by the heads
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1)), dim=-1)
        return self.core_attention(q, k, v, meta)
