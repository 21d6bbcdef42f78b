"""Token dispatchers: move routed tokens to the ranks that own their experts, and back.

Both dispatchers keep what `combine` needs between the two calls, so one layer calls
`dispatch` then `combine` (recomputation calls both again, in the same order on every rank).

`AllToAllDispatcher` (the default; also the single-rank path when its group is None):
  1. permute: sort this rank's (token, choice) assignments by global expert id (a stable
     argsort, so rows destined to each rank, then each of its experts, are contiguous);
  2. exchange the per-expert counts with one small all-to-all, then read the split sizes
     on the host (the one host sync: uneven all-to-all needs them there);
  3. all-to-all the token rows with uneven splits;
  4. local grouping: rows arrive ordered (source rank, local expert); a stable argsort by
     local expert makes each expert's rows contiguous for the grouped GEMM;
  and the reverse for combine: ungroup, all-to-all back, unpermute into [T, k, dim] and
  weigh-and-sum over k in one batched product (no atomics: deterministic; the backward of
  the permute sums the k row gradients with a reduction too).

`AllGatherDispatcher` (small EP, e.g. within a node): all-gather every rank's tokens and
routing, compute the local experts' share of every token, and reduce-scatter the partial
outputs back. Traffic is ep x tokens x dim each way instead of tokens x k x dim, which wins
when k is large relative to ep and the all-to-all's latency dominates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.kernels.fused import gather_sum, gather_weighted_sum, inverse_of, triton_enabled
from core.parallel.comm import all_gather_dim0, all_gather_tokens, reduce_scatter_tokens
from moe.comm import all_to_all, exchange_counts
from moe.router import Routing, expert_counts


def _group_info(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def sort_by_expert(expert_ids: torch.Tensor, keep: torch.Tensor | None, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): assignment ids (into expert_ids.flatten()) sorted by expert, and the
    number per expert [num_experts]. With `keep`, assignments where it is False are left
    out (a host sync learns how many remain); without, ids must be < num_experts."""
    flat = expert_ids.reshape(-1)
    filtered = keep is not None
    if filtered:
        flat = flat.masked_fill(~keep.reshape(-1), num_experts)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat.clamp_max(num_experts), num_experts + 1)
    if filtered:  # the dropped sort last; cut them off
        order = order[: int(counts[:num_experts].sum())]
    return order, counts[:num_experts]


class _Reorder(torch.autograd.Function):
    """rows.index_select(0, inverse) where inverse is a permutation; the backward gathers with
    the forward permutation instead of index_add into zeros (no fill, no atomics)."""

    @staticmethod
    def forward(ctx, rows, order, inverse):
        ctx.save_for_backward(order)
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None


def _scatter_rows(rows: torch.Tensor, order: torch.Tensor, slots: int) -> torch.Tensor:
    """[slots, dim] with rows[i] at slot order[i] and zeros in slots no row fills. When every
    slot is filled (dropless) this is a gather by the inverse permutation: no zero fill."""
    if order.numel() == slots:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(slots, device=order.device)
        return _Reorder.apply(rows, order, inverse)
    return rows.new_zeros(slots, rows.shape[1]).index_copy(0, order, rows)


class _Permute(torch.autograd.Function):
    """rows[i] = x[order[i] // k]. Backward sums each token's k row gradients with a
    reduction over k, not atomics: deterministic, and accumulated in fp32 even for bf16."""

    @staticmethod
    def forward(ctx, x, order, k):
        ctx.save_for_backward(order)
        ctx.k, ctx.tokens = k, x.shape[0]
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        if triton_enabled(grad):  # gather and sum in one pass (core.kernels.fused)
            inverse = inverse_of(order, ctx.tokens * ctx.k).view(ctx.tokens, ctx.k)
            return gather_sum(grad.contiguous(), inverse, None), None, None
        full = _scatter_rows(grad, order, ctx.tokens * ctx.k)
        return full.view(ctx.tokens, ctx.k, -1).sum(1), None, None


def permute(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """The token row of every assignment in `order` (assignment id = token * k + choice)."""
    return _Permute.apply(x, order, k)


class _WeightedSum(torch.autograd.Function):
    """out[t] = sum_k weights[t, k] * slots[t, k]: one batched [1, k] x [k, dim] product per
    token (fp32 accumulation). Its backward is written out because autograd's for bmm computes
    the weight gradient as [1, dim] x [dim, k] products, for which cuBLAS picked an sm80 32x32
    WMMA kernel: 2.5 ms per MoE layer on an H100 (top-2, 8192 tokens, dim 4096), 11% of the step.
    Here: the slot gradient is the outer product (elementwise), the weight gradient the
    [k, dim] x [dim, 1] products (a batched GEMV)."""

    @staticmethod
    def forward(ctx, weights, slots):
        ctx.save_for_backward(weights, slots)
        return torch.bmm(weights.unsqueeze(1), slots).squeeze(1)

    @staticmethod
    def backward(ctx, grad):
        weights, slots = ctx.saved_tensors
        grad_weights = torch.bmm(slots, grad.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[0] else None
        grad_slots = weights.unsqueeze(2) * grad.unsqueeze(1) if ctx.needs_input_grad[1] else None
        return grad_weights, grad_slots


def weighted_unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """sum_k weights[t, k] * rows[assignment (t, k)] -> [num_tokens, dim]; missing (dropped)
    assignments count as zero. rows are in `order`'s order.

    The weighting and the sum over k in one pass with fp32 accumulation (`_WeightedSum`).
    For bf16 rows the fp32 weights are rounded to bf16 first. On CUDA with Triton the gather,
    weighting and sum are one kernel, with the fp32 weights (core.kernels.fused)."""
    if triton_enabled(rows):
        return gather_weighted_sum(rows, order, weights, num_tokens)
    k = weights.shape[1]
    slots = _scatter_rows(rows, order, num_tokens * k).view(num_tokens, k, -1)
    return _WeightedSum.apply(weights.to(rows.dtype), slots)


class _Dispatcher:
    """What every dispatcher knows: the expert-parallel group and this rank's experts."""

    def __init__(self, num_experts: int, group=None):
        self.num_experts = num_experts
        self.group = group
        self.ep, self.ep_rank = _group_info(group)
        if num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide num_experts={num_experts}")
        self.num_local = num_experts // self.ep
        self._state: dict | None = None


class AllToAllDispatcher(_Dispatcher):
    """Permute -> count exchange -> uneven all-to-all -> local grouping, and back."""

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rows grouped by local expert [N, dim], tokens per local expert [E_local])."""
        t, k = routing.indices.shape
        order, counts = sort_by_expert(routing.indices, routing.keep, self.num_experts)
        permuted = permute(x, order, k)
        state = {"order": order, "tokens": t, "weights": routing.weights}
        self._state = state
        if self.ep == 1:
            return permuted, counts
        send = counts.view(self.ep, self.num_local)
        recv = exchange_counts(send, self.group)  # row i: what rank i sends to each of my experts
        sizes = torch.cat([send.sum(1), recv.sum(1)]).tolist()
        in_splits, out_splits = sizes[: self.ep], sizes[self.ep:]
        received = all_to_all(permuted, out_splits, in_splits, self.group)
        local_ids = torch.arange(self.num_local, device=x.device).repeat(self.ep)
        local_ids = torch.repeat_interleave(local_ids, recv.reshape(-1), output_size=sum(out_splits))
        regroup = torch.argsort(local_ids, stable=True)
        ungroup = torch.empty_like(regroup)
        ungroup[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        state.update(in_splits=in_splits, out_splits=out_splits, regroup=regroup, ungroup=ungroup)
        return _Reorder.apply(received, ungroup, regroup), recv.sum(0)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Expert outputs in dispatch's row order -> weighted sum per token [T, dim]."""
        state, self._state = self._state, None
        if state is None:
            raise RuntimeError("combine() called without a matching dispatch()")
        rows = expert_out
        if self.ep > 1:
            rows = _Reorder.apply(rows, state["regroup"], state["ungroup"])
            rows = all_to_all(rows, state["in_splits"], state["out_splits"], self.group)
        return weighted_unpermute(rows, state["order"], state["weights"], state["tokens"])


class AllGatherDispatcher(_Dispatcher):
    """Gather all tokens of the EP group, run the local experts on their share, reduce-scatter."""

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        t, k = routing.indices.shape
        indices, weights = routing.indices, routing.weights
        if routing.keep is not None:  # dropped assignments go to a sentinel expert no rank owns
            indices = indices.masked_fill(~routing.keep, self.num_experts)
        pad = 0
        if self.ep > 1:
            sizes = all_gather_dim0(torch.tensor([t], device=x.device), self.group).tolist()
            pad = max(sizes) - t  # equal chunks for the collectives; padding rows route nowhere
            x = F.pad(x, (0, 0, 0, pad))
            indices = F.pad(indices, (0, 0, 0, pad), value=self.num_experts)
            weights = F.pad(weights, (0, 0, 0, pad))
            # Each rank's gradient of the gathered tokens/weights covers only its experts'
            # share: partial sums, so the backward reduce-scatters (the default).
            x = all_gather_tokens(x, self.group)
            weights = all_gather_tokens(weights, self.group)
            indices = all_gather_dim0(indices, self.group)
        local = indices - self.ep_rank * self.num_local
        mine = (local >= 0) & (local < self.num_local)
        order, counts = sort_by_expert(local.clamp(0, self.num_local), mine, self.num_local)
        self._state = {"order": order, "weights": weights, "tokens": t, "rows": x.shape[0]}
        return permute(x, order, k), counts

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        state, self._state = self._state, None
        if state is None:
            raise RuntimeError("combine() called without a matching dispatch()")
        partial = weighted_unpermute(expert_out, state["order"], state["weights"], state["rows"])
        if self.ep == 1:
            return partial
        return reduce_scatter_tokens(partial, self.group)[: state["tokens"]]


def build_dispatcher(kind: str, num_experts: int, group=None):
    """"alltoall" or "allgather" over `group` (None: this rank holds every expert)."""
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, group)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, group)
    raise ValueError(f"dispatcher={kind!r} must be 'alltoall' or 'allgather'")
