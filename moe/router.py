"""Routers: which experts each token uses, with what combine weight, and the balancing losses.

Scores are always computed in fp32 (the router's logits decide discrete choices: bf16
rounding flips near-ties and makes runs irreproducible across layouts). With bf16 tokens and a
bf16 gate on a GPU (`router_logits`) the logits come from one tensor-core GEMM with fp32
output: the products of bf16 numbers are exact in fp32, so this is the fp32 GEMM of the
upcast operands up to the order of the fp32 sums, without the upcast copy of x or the
CUDA-core fp32 GEMM. Its backward splits the fp32 logit gradient into a bf16 high part and a
bf16 remainder (16 significant bits together) and runs each gradient GEMM once over both.

Scoring (`MoEConfig.router`):
- "softmax": p = softmax(logits); the top-k of p are chosen; with `normalize_topk` the k
  weights are renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob), else they are
  the raw probabilities (Qwen3-MoE without norm_topk_prob). This is transformers' order:
  softmax in fp32 over all experts, top-k of the probabilities, then renormalisation.
- "sigmoid": s = sigmoid(logits) (DeepSeek-V3); the top-k of s are chosen and their weights
  are s / sum(top-k s) (or raw s without `normalize_topk`).
Either way the weights are multiplied by `routed_scaling_factor`.

Group-limited routing (`n_groups` > 1): experts are split into n_groups equal groups; a
group's score is the sum of its best `model.moe.group_score_experts` expert scores (DeepSeek-V3:
2; 0: max(1, top_k // topk_groups), at most the group's experts); each token
may only pick experts from its `topk_groups` best groups (DeepSeek-V2/V3 device-limited
routing).

Auxiliary-loss-free balancing: a per-expert `expert_bias` (a persistent buffer, fp32: saved in
checkpoints, read from `checkpoint.init_from`, DeepSeek-V3's `e_score_correction_bias`) is
added to the scores used for *selection* only; combine weights come from the unbiased scores.
It is always applied (zeros unless trained or imported): with `bias_update_rate` > 0
`update_expert_bias` (moe/layer.py) moves it from the loads observed over an optimizer step,
with 0 it stays as loaded (a DeepSeek-V3 import fine-tunes with its bias fixed).

Capacity (`capacity_factor` > 0): each expert keeps at most ceil(cf * T * k / E) of this
rank's assignments, the highest-weight ones; the rest are dropped (weight 0, not sent).
Dropless (cf = 0) is the default.

Losses, all on this rank's tokens of one micro-batch:
- switch load balancing: E / (k T^2) * sum_e count_e * sum_t p_te, which is 1.0 when loads and
  probabilities are uniform; p are the softmax probabilities, or for sigmoid scoring the
  scores normalised over all experts. The per-sequence variant (DeepSeek-V3) computes the same
  within each sequence and averages over sequences.
- router z-loss: mean_t logsumexp(logits_t)^2 (ST-MoE), keeps logits small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.config import MoEConfig
from core.rules import group_score_experts
from core.validation import check_moe
from core.kernels.topk import topk_indices


class _Bf16Logits(torch.autograd.Function):
    """x [T, dim] @ weight[E, dim]^T in fp32 from bf16 operands (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        high = grad.to(torch.bfloat16)
        parts = torch.cat((high, (grad - high.float()).to(torch.bfloat16)), dim=1)  # [T, 2E]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(parts, torch.cat((weight, weight)))  # fp32 sums, rounded once to bf16
        if ctx.needs_input_grad[1]:
            both = torch.mm(parts.t(), x, out_dtype=torch.float32)  # [2E, dim]
            e = weight.shape[0]
            grad_w = (both[:e] + both[e:]).to(weight.dtype)
        return grad_x, grad_w


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, E] of x [T, dim] under the gate weight [E, dim]."""
    if x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16:
        return _Bf16Logits.apply(x, weight)
    return F.linear(x.float(), weight.float())


@dataclass
class Routing:
    """The router's decision for T tokens with top-k experts each."""

    indices: torch.Tensor  # [T, k] int64 expert ids
    weights: torch.Tensor  # [T, k] fp32 combine weights; 0 where dropped
    probs: torch.Tensor  # [T, E] fp32, each row sums to 1: input of the balancing loss
    logits: torch.Tensor  # [T, E] fp32
    keep: torch.Tensor | None  # [T, k] bool, False where capacity dropped it; None: dropless
    tokens_per_expert: torch.Tensor  # [E] int64 assignments chosen (before dropping)


def limit_to_groups(scores: torch.Tensor, n_groups: int, topk_groups: int, per_group: int) -> torch.Tensor:
    """Scores with experts outside each token's `topk_groups` best groups set to -inf; a group's
    score is the sum of its best `per_group` expert scores (core.rules.group_score_experts)."""
    if n_groups == 1 or topk_groups == n_groups:
        return scores
    t, e = scores.shape
    grouped = scores.view(t, n_groups, e // n_groups)
    # Both choices by the router's top-k kernel: torch.topk on these narrow rows (a radix select,
    # then a sort of the k) took ~220 us a layer at 8192 tokens, 8 groups of 8 (H100).
    picked = topk_indices(grouped.reshape(t * n_groups, e // n_groups), per_group).view(t, n_groups, per_group)
    group_scores = grouped.gather(-1, picked).sum(-1)  # [T, G]
    best = topk_indices(group_scores, topk_groups)
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(t, e)


def route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices [T,k], weights [T,k], probs [T,E]) from fp32 logits [T,E] (see module doc)."""
    k = moe.top_k
    if moe.router == "softmax":
        scores = torch.softmax(logits, dim=-1)
        probs = scores
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
    choice = scores if bias is None else scores + bias  # the bias steers selection only
    choice = limit_to_groups(choice, moe.n_groups, moe.topk_groups, group_score_experts(moe))
    indices = topk_indices(choice, k)  # in no set order: nothing after depends on one
    weights = scores.gather(1, indices)
    if moe.normalize_topk:  # with top_k = 1 too: weight 1 (Mixtral and Qwen3-MoE's norm_topk_prob do the same)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return indices, weights, probs


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] (int64) without a host sync (bincount would need one).
    Compiled, a compare-and-sum that inductor runs as one reduction: its scatter_add falls back to
    ATen's, whose atomics onto E counters serialise (30 us for 131072 assignments, E=64, H100)."""
    flat = indices.reshape(-1)
    if torch.compiler.is_compiling():
        return (flat.unsqueeze(1) == torch.arange(num_experts, device=flat.device)).sum(0)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def capacity_keep(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """[T,k] bool: True for the assignments each expert keeps within its capacity.

    Capacity = ceil(cf * T * k / E). Within an expert the highest-weight assignments win
    (ties: earlier token first), so a token's first choice survives before others' last."""
    t, k = indices.shape
    capacity = math.ceil(capacity_factor * t * k / num_experts)
    flat_e, flat_w = indices.reshape(-1), weights.detach().reshape(-1)
    by_weight = torch.argsort(flat_w, descending=True, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]  # by expert, then weight
    counts = expert_counts(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(t * k, device=flat_e.device) - starts[flat_e[order]]
    keep = torch.empty(t * k, dtype=torch.bool, device=flat_e.device)
    keep[order] = rank_in_expert < capacity
    return keep.view(t, k)


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch loss over all T tokens of the micro-batch (1.0 when perfectly uniform)."""
    t, e = probs.shape
    return (probs.sum(0) * tokens_per_expert.to(probs.dtype)).sum() * (e / (top_k * max(t, 1) ** 2))


def balancing_stats(probs: torch.Tensor, indices: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int,
                    weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (sequence, expert): assignments [S, E] and sums of probabilities [S, E], and tokens per
    sequence [S], over the given tokens, each token counted with its weight (`weights` [T], 1 or
    0: document or padding; None: all 1). All are sums over tokens, so shards of a sequence add up
    (TP "split", context parallelism)."""
    t, e = probs.shape
    w = torch.ones(t, dtype=probs.dtype, device=probs.device) if weights is None else weights.to(probs.dtype)
    counts = torch.zeros(num_seqs * e, dtype=probs.dtype, device=probs.device)
    flat = (seq_ids.unsqueeze(1) * e + indices).reshape(-1)
    counts.index_add_(0, flat, w.repeat_interleave(indices.shape[1]))
    weighted = probs if weights is None else probs * w.unsqueeze(1)
    prob_sums = torch.zeros(num_seqs, e, dtype=probs.dtype, device=probs.device).index_add(0, seq_ids, weighted)
    lengths = torch.zeros(num_seqs, dtype=probs.dtype, device=probs.device).index_add_(0, seq_ids, w)
    return counts.view(num_seqs, e), prob_sums, lengths


def sequence_balancing_losses(counts: torch.Tensor, prob_sums: torch.Tensor, lengths: torch.Tensor,
                              top_k: int) -> torch.Tensor:
    """[S]: E / (k n_s^2) * sum_e counts[s, e] * prob_sums[s, e] for each sequence s (0 for one
    without tokens). Linear in prob_sums: with the full counts and lengths, the losses of token
    shards sum to the full loss."""
    e = counts.shape[1]
    n = lengths.to(prob_sums.dtype).clamp_min(1)
    return (counts * prob_sums).sum(-1) * (e / top_k) / (n * n)


def balancing_loss_from_stats(counts: torch.Tensor, prob_sums: torch.Tensor, lengths: torch.Tensor, top_k: int) -> torch.Tensor:
    """The mean over sequences of `sequence_balancing_losses`."""
    return sequence_balancing_losses(counts, prob_sums, lengths, top_k).mean()


def sequence_ids(cu_seqlens: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Sequence index of tokens start .. start+n-1 of a micro-batch with boundaries cu_seqlens."""
    positions = torch.arange(start, start + n, device=cu_seqlens.device)
    # Search the whole array (cu_seqlens[0] = 0 <= every position) rather than cu_seqlens[1:]:
    # inductor cannot lower searchsorted over a sliced boundaries tensor (NotImplementedError: SliceView).
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def sequence_load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor, cu_seqlens: torch.Tensor, top_k: int) -> torch.Tensor:
    """The switch loss within each sequence [cu[i], cu[i+1]), averaged over sequences."""
    cu = cu_seqlens.to(device=probs.device, dtype=torch.int64)
    counts, prob_sums, lengths = balancing_stats(probs, indices, sequence_ids(cu, 0, probs.shape[0]), cu.numel() - 1)
    return balancing_loss_from_stats(counts, prob_sums, lengths, top_k)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class TopKRouter(nn.Module):
    """Linear gate [E, dim] -> fp32 logits -> `Routing` (scoring, groups, bias, capacity)."""

    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        check_moe(moe)  # the config's own rule, for routers built outside a validated run
        self.moe = moe
        self.num_experts = moe.num_experts
        self.weight = nn.Parameter(torch.empty(moe.num_experts, dim))
        nn.init.normal_(self.weight, 0.0, 0.02)
        # Always present (zeros when balancing by aux loss) so checkpoints have one layout.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = router_logits(x, self.weight)
        indices, weights, probs = route(logits, self.moe, self.expert_bias)
        counts = expert_counts(indices, self.num_experts)
        keep = None
        if self.moe.capacity_factor > 0:
            keep = capacity_keep(indices, weights, self.num_experts, self.moe.capacity_factor)
            weights = weights * keep
        return Routing(indices, weights, probs, logits, keep, counts)
