"""The GPT assembled from `core.layers` and, on MoE layers, `moe.layer.MoELayer`.

It knows nothing of parallelism: the math here is the reference for every layout, and the
parallelize steps (`core.train.parallelize`) rewrite its submodules in place.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.config import ModelConfig
from core.rules import moe_layer_rule
from core.layers import Attention, AttentionMeta, FeedForward, RMSNorm, rope_frequencies, rotary_tables
from core.mla import MLAttention
from moe.layer import MoELayer, moe_layers

__all__ = ["GPT", "MTPModule", "TransformerBlock", "build_model", "count_params", "is_moe_layer", "AttentionMeta"]


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    return moe_layer_rule(cfg.moe, layer_id)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.checkpoint_feed_forward = False  # set by recompute "mlp" (core.parallel.recompute)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # An MoE layer reads the micro-batch's sequence boundaries (per-sequence balancing) from
        # the meta it is handed; a dense FFN takes the hidden states alone.
        self.routed = is_moe_layer(cfg, layer_id)
        if self.routed:
            self.feed_forward = MoELayer(cfg, layer_id)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, meta)
        args = (x, meta) if self.routed else (x,)
        if self.checkpoint_feed_forward:  # recomputed with its norm, the branch keeps only x
            return x + checkpoint(self.feed_forward_branch, *args, use_reentrant=False)
        return x + self.feed_forward_branch(*args)

    def feed_forward_branch(self, x: torch.Tensor, meta: AttentionMeta | None = None) -> torch.Tensor:
        h = self.ffn_norm(x)
        return self.feed_forward(h, meta) if self.routed else self.feed_forward(h)


class MTPModule(nn.Module):
    """One multi-token prediction depth (DeepSeek-V3): at position i it joins the previous
    depth's hidden state h_i (depth 0: the main model's last block output, before the final
    norm) with the embedding of the token one further ahead, runs one transformer block and
    gives its own hidden state; `norm` then feeds the model's shared output head.

    The submodule names are the checkpoint's (Hugging Face: model.layers.{num_layers + k}.
    enorm, hnorm, eh_proj, shared_head.norm and the block's own names)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = TransformerBlock(cfg, layer_id)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMeta) -> torch.Tensor:
        """h: the previous depth's hidden states [T, dim]; embedded: the shifted tokens' embeddings."""
        joined = torch.cat((self.enorm(embedded), self.hnorm(h)), dim=-1)  # embedding first, as DeepSeek-V3
        return self.block(self.eh_proj(joined), rope, meta)


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
        # Multi-token prediction, sharing the embedding and head. Registered after the head and
        # built on a forked generator (reset_parameters draws every value after), so the main
        # model's parameters and initial values are the same with and without it.
        self.mtp = None
        if cfg.mtp_layers:
            with torch.random.fork_rng(devices=[]):
                self.mtp = nn.ModuleList([MTPModule(cfg, cfg.num_layers + k) for k in range(cfg.mtp_layers)])
        # False on a pipeline chunk that receives hidden states but keeps the embedding for
        # its MTP modules (the last stage).
        self.embeds_tokens = True
        # Rotary frequencies: fp32 on the CPU (as transformers computes them), copied once per
        # device; a plain attribute, so casting the model's dtype never touches them.
        self.rope_inv_freq, self.rope_scale = rope_frequencies(cfg)
        self._rope_on: dict[torch.device, torch.Tensor] = {}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        # Output projections of residual branches are scaled down with depth (GPT-2's rule)
        # so the residual stream's variance does not grow with the number of layers.
        residual_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif param.dim() == 1:  # norm gains
                param.fill_(1.0)
            elif {"wo", "w2"} & set(name.split(".")[-2:]):
                nn.init.normal_(param, 0.0, residual_std)
            else:
                nn.init.normal_(param, 0.0, std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """tokens, position_ids: [T] (a flattened micro-batch) -> logits [T, vocab] (the main head only)."""
        h = self.hidden_states(tokens, position_ids, meta)
        return self.output(h) if self.output is not None else h

    def hidden_states(self, tokens: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta,
                      normed: bool = True) -> torch.Tensor:
        """What the output head reads: the final norm's output [T, dim] (a loss may fuse the head in);
        with `normed` false the last block's output, for a loss that runs the norm itself (`head_norms`)."""
        h, _ = self._trunk(tokens, position_ids, meta)
        return self.norm(h) if self.norm is not None and normed else h

    def heads(self, tokens: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta,
              mtp_tokens: torch.Tensor | None = None, normed: bool = True) -> list[torch.Tensor]:
        """What the output head reads for the main model and each MTP depth: [final norm's output,
        depth 0's normed hidden state, ...], each [T, dim]; with `normed` false the same before
        each depth's norm (`head_norms`). mtp_tokens [D, T]: row k holds, at position i, token
        i+k+1 of its document (`core.train.data.mtp_inputs`). On a chunk without the head (a
        pipeline stage before the last): [its hidden states]."""
        h, rope = self._trunk(tokens, position_ids, meta)
        if self.norm is None:
            return [h]
        out = [self.norm(h) if normed else h]
        if self.mtp is not None and mtp_tokens is not None:
            for k, module in enumerate(self.mtp):
                h = module(h, self.tok_embeddings(mtp_tokens[k]), rope, meta)
                out.append(module.norm(h) if normed else h)
        return out

    def head_norms(self) -> list[nn.Module]:
        """The norm before the head of each entry of `heads`: the final norm, then each MTP depth's."""
        return [self.norm] + [module.norm for module in (self.mtp or ())]

    def _trunk(self, tokens: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta):
        """(the last block's output, before the final norm; the rotary tables)."""
        embeds = self.tok_embeddings is not None and self.embeds_tokens
        h = self.tok_embeddings(tokens) if embeds else tokens
        inv_freq = self._rope_on.get(position_ids.device)
        if inv_freq is None:
            inv_freq = self._rope_on[position_ids.device] = self.rope_inv_freq.to(position_ids.device)
        rope = rotary_tables(position_ids, inv_freq, self.rope_scale)
        for layer in self.layers.values():
            h = layer(h, rope, meta)
        return h, rope


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """The same weights on every rank for the same seed: parallel steps slice them afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def count_params(model: nn.Module) -> tuple[int, int, int]:
    """(all parameters, input-embedding parameters, parameters one token uses) of the
    UNSHARDED model. A token runs top_k of each MoE layer's E routed experts, so MFU counts
    that share of the expert weights (MFU on active parameters, as MoE papers quote it)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel() if model.tok_embeddings is not None else 0
    idle = 0
    for layer in moe_layers(model):
        experts = sum(p.numel() for p in layer.experts.parameters())
        idle += experts - experts * layer.moe.top_k // layer.moe.num_experts
    return total, embedding, total - idle
