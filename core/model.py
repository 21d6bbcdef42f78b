"""The plain GPT: embedding, RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.

It knows nothing of parallelism. Every tensor flows flattened as [tokens, ...] over a packed
micro-batch; `AttentionMeta.cu_seqlens` marks the document boundaries attention must not
cross. The parallelize steps in `core/parallel/` rewrite submodules in place (linear layers,
`core_attention`), so the math here is the reference for every layout: head counts are read
from tensor shapes, never from the config, for that reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.attention import varlen_attention
from core.config import ModelConfig


@dataclass
class AttentionMeta:
    """What attention needs to know about the packed batch besides q, k, v."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1] over this rank's tokens
    max_seqlen: int
    extra: dict[str, Any] = field(default_factory=dict)  # context-parallel plans and the like
    doc_lengths: tuple[int, ...] | None = None  # cu_seqlens' segment lengths on the host, if known


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 mean-of-squares loses too much on long hidden sizes.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [tokens, head_dim/2] for the true positions of each token (packed or split)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class CoreAttention(nn.Module):
    """softmax(q k^T) v within documents; a module so parallel steps can swap or recompute it."""

    # Outside torch.compile: the document boundaries (cu_seqlens length, max_seqlen) change
    # with every packed batch, so a compiled block recompiled on each one until dynamo's
    # recompile limit; the attention kernels are opaque to inductor anyway.
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        return varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, doc_lengths=meta.doc_lengths)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core_attention = CoreAttention()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.core_attention(q, k, v, meta)
        return self.wo(out.flatten(-2))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    moe = cfg.moe
    return moe.num_experts > 0 and layer_id >= moe.first_k_dense and (layer_id - moe.first_k_dense) % moe.moe_every == 0


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if is_moe_layer(cfg, layer_id):
            from moe.layer import MoELayer  # the slot the MoE issue fills

            self.feed_forward = MoELayer(cfg, layer_id)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, meta)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer over a packed, flattened micro-batch."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by the global layer index: pipeline stages keep a subset and
        # checkpoints keep their names whatever the split.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        # Output projections of residual branches are scaled down with depth (GPT-2's rule)
        # so the residual stream's variance does not grow with the number of layers.
        residual_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:  # norm gains
                param.fill_(1.0)
            elif {"wo", "w2"} & set(name.split(".")[-2:]):
                nn.init.normal_(param, 0.0, residual_std)
            else:
                nn.init.normal_(param, 0.0, std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """tokens, position_ids: [T] (a flattened micro-batch) -> logits [T, vocab]."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = rotary_tables(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers.values():
            h = layer(h, rope, meta)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """The same weights on every rank for the same seed: parallel steps slice them afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)
