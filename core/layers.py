"""The model's plain building blocks: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

They know nothing of parallelism or of how the model is assembled. Every tensor flows flattened
as [tokens, ...] over a packed micro-batch; `AttentionMeta.cu_seqlens` marks the document
boundaries attention must not cross. The parallelize steps rewrite submodules in place (linear
layers, `core_attention`), so head counts are read from tensor shapes, never from the config.
"""

from __future__ import annotations

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
