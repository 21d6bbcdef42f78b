"""Token dispatchers: move routed tokens to the ranks that own their experts, and back.

Each direction runs in three phases, preprocess (local), exchange (the only one that
communicates) and postprocess (local), each a method taking the dispatch's `DispatchHandle`
(`_Dispatcher` lists them); a layer calls `dispatch` then `combine`, which run the phases in
order and keep the handle between the two (recomputation calls both again, in the same order
on every rank). With the phases apart, a schedule can overlap one micro-batch's exchange with
another's computation.

`AllToAllDispatcher` (the default; also the single-rank path when its group is None):
  1. preprocess, permute: sort this rank's (token, choice) assignments by global expert id (a
     stable argsort, so rows destined to each rank, then each of its experts, are contiguous);
  2. exchange: the per-expert counts with one small all-to-all, then the split sizes read on
     the host (the one host sync: uneven all-to-all needs them there), then the token rows with
     uneven splits;
  3. postprocess, local grouping: rows arrive ordered (source rank, local expert); a stable
     argsort by local expert makes each expert's rows contiguous for the grouped GEMM;
  and the reverse for combine: ungroup, all-to-all back, unpermute into [T, k, dim] and
  weigh-and-sum over k in one batched product (no atomics: deterministic; the backward of
  the permute sums the k row gradients with a reduction too). With `weigh_in_experts` the
  weights travel with their rows, the experts apply them and the combine only sums (`_Dispatcher`).

With `align` > 1 (`model.moe.grouped_gemm = "triton"`) each local expert's rows start at a
multiple of `align` with zero rows after them (moe.aligned: the layout, built on the device
without a host sync). Where the permute itself yields the grouped rows (one EP rank, or the
all-gather dispatcher) and Triton runs, the permute writes the rows straight to their aligned
places (the assignments' `inverse` composed with the layout): no pass more than the default
layout. Elsewhere (the all-to-all over several ranks, or without Triton) the grouped rows are
gathered into the aligned buffer after the postprocess and back before the combine (one copy
each way). `handle.layout` holds the layout; `pending_layout()` gives it to the experts.

`AllGatherDispatcher` (small EP, e.g. within a node): all-gather every rank's tokens and
routing, compute the local experts' share of every token, and reduce-scatter the partial
outputs back. Traffic is ep x tokens x dim each way instead of tokens x k x dim, which wins
when k is large relative to ep and the all-to-all's latency dominates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.kernels.fused import gather_weighted_sum, inverse_of, permute_rows, triton_enabled, unpermute_sum
from core.parallel.comm import all_gather_dim0, all_gather_tokens, reduce_scatter_tokens
from moe.aligned import AlignedLayout, ZeroPaddingGrad, aligned_layout, compose_inverse, from_aligned, to_aligned
from moe.comm import ExchangeTimer, all_to_all, exchange_counts
from moe.router import Routing, expert_counts


def _group_info(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _narrow_keys(ids: torch.Tensor, bound: int) -> torch.Tensor:
    """ids (all < bound) in the narrowest integer type that holds them: a radix sort makes one
    pass per key byte, so int64 expert ids cost eight passes where one byte needs one."""
    if bound <= 256:
        return ids.to(torch.uint8)
    if bound <= 32768:
        return ids.to(torch.int16)
    return ids


def sort_by_expert(expert_ids: torch.Tensor, keep: torch.Tensor | None, num_experts: int,
                   counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): assignment ids (into expert_ids.flatten()) sorted by expert, and the
    number per expert [num_experts]. With `keep`, assignments where it is False are left
    out (a host sync learns how many remain) and the rest counted; without, ids must be
    < num_experts, and `counts`, when the caller has them (the router's), are returned as they are."""
    flat = expert_ids.reshape(-1)
    if keep is None:
        order = torch.argsort(_narrow_keys(flat, num_experts), stable=True)
        return order, counts if counts is not None else expert_counts(flat, num_experts)
    flat = flat.masked_fill(~keep.reshape(-1), num_experts)
    order = torch.argsort(_narrow_keys(flat, num_experts + 1), stable=True)
    counts = expert_counts(flat, num_experts + 1)
    order = order[: int(counts[:num_experts].sum())]  # the dropped sort last; cut them off
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


def unpermute(rows: torch.Tensor, order: torch.Tensor, num_tokens: int, k: int,
              inverse: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k rows[assignment (t, k)] -> [num_tokens, dim]: the permute's backward, and the combine
    when the routing weights were applied in the experts. Missing (dropped) assignments count as
    zero; fp32 accumulation."""
    if triton_enabled(rows):
        if inverse is None:
            inverse = inverse_of(order, num_tokens * k).view(num_tokens, k)
        return unpermute_sum(rows, inverse)
    return _scatter_rows(rows, order, num_tokens * k).view(num_tokens, k, rows.shape[-1]).sum(1)


class _Permute(torch.autograd.Function):
    """rows[i] = x[order[i] // k]. Backward sums each token's k row gradients with a
    reduction over k, not atomics: deterministic, and accumulated in fp32 even for bf16."""

    @staticmethod
    def forward(ctx, x, order, k, inverse, layout):
        ctx.k, ctx.tokens = k, x.shape[0]
        ctx.save_for_backward(order, inverse)
        if layout is not None:  # inverse composed with the layout: rows written to their aligned places
            return layout.zero_padding_(permute_rows(x, inverse, layout.rows))
        if inverse is not None:  # each token read once, written to its k rows (core.kernels.fused)
            return permute_rows(x, inverse, order.numel())
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        order, inverse = ctx.saved_tensors
        return unpermute(grad, order, ctx.tokens, ctx.k, inverse), None, None, None, None


def assignment_inverse(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor | None:
    """[tokens of x, k]: the row of each assignment in `order` (-1: none), for the Triton permute
    and combine; None where they do not run (both then take their PyTorch paths)."""
    if not triton_enabled(x):
        return None
    return inverse_of(order, x.shape[0] * k).view(x.shape[0], k)


def permute(x: torch.Tensor, order: torch.Tensor, k: int, inverse: torch.Tensor | None = None,
            layout: AlignedLayout | None = None) -> torch.Tensor:
    """The token row of every assignment in `order` (assignment id = token * k + choice);
    `inverse` from `assignment_inverse`. With `layout` (Triton only), `inverse` maps to aligned
    rows (`compose_inverse`) and the result is the aligned buffer, padding zero."""
    return _Permute.apply(x, order, k, inverse, layout)


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


def weighted_unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int,
                       inverse: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * rows[assignment (t, k)] -> [num_tokens, dim]; missing (dropped)
    assignments count as zero. rows are in `order`'s order.

    The weighting and the sum over k in one pass with fp32 accumulation (`_WeightedSum`).
    For bf16 rows the fp32 weights are rounded to bf16 first. On CUDA with Triton the gather,
    weighting and sum are one kernel, with the fp32 weights (core.kernels.fused), reading the
    dispatch's `inverse` (`assignment_inverse`) when given."""
    k = weights.shape[1]
    if triton_enabled(rows):
        if inverse is None:
            inverse = inverse_of(order, num_tokens * k).view(num_tokens, k)
        return gather_weighted_sum(rows, inverse, weights)
    slots = _scatter_rows(rows, order, num_tokens * k).view(num_tokens, k, rows.shape[-1])
    return _WeightedSum.apply(weights.to(rows.dtype), slots)


class _RowWeights(torch.autograd.Function):
    """weights.flatten()[order]; the backward gathers through the inverse permutation (-1: a
    dropped assignment, gradient zero) instead of an index_put into zeros, which sorts."""

    @staticmethod
    def forward(ctx, weights, order, inverse):
        ctx.save_for_backward(inverse)
        return weights.reshape(-1).index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        picked = grad.index_select(0, inverse.clamp(min=0).reshape(-1)).view(inverse.shape)
        return torch.where(inverse >= 0, picked, 0.0), None, None


def row_weights(weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
    """[rows]: the routing weight of each dispatched row (rows in `order`'s order)."""
    if inverse is None:
        return weights.reshape(-1)[order]
    return _RowWeights.apply(weights, order, inverse)


def _sum_rows(rows: torch.Tensor, handle: "DispatchHandle", tokens: int) -> torch.Tensor:
    """[tokens, dim]: each token's k rows (in `handle.order`'s order) summed, weighted by the
    routing weights unless the experts applied them (`handle.row_weights`)."""
    if handle.row_weights is not None:
        return unpermute(rows, handle.order, tokens, handle.k, handle.inverse)
    return weighted_unpermute(rows, handle.order, handle.weights, tokens, handle.inverse)


@dataclass
class DispatchHandle:
    """What one dispatch leaves for its combine. Each phase takes the handle (and fills in what
    it learns), so a dispatcher can have several dispatches in flight: one micro-batch's
    exchange can run while another's experts compute."""

    weights: torch.Tensor  # [rows of tokens, k] routing weights
    tokens: int  # this rank's tokens
    k: int
    order: torch.Tensor | None = None  # assignment ids (token * k + choice) of the rows, in dispatch order
    inverse: torch.Tensor | None = None  # [tokens, k]: each assignment's row in `order` (Triton paths only)
    # [rows]: routing weights for the experts to apply (then the combine does not), in the rows' order of the latest phase
    row_weights: torch.Tensor | None = None
    indices: torch.Tensor | None = None  # all-gather: [rows of tokens, k] expert ids, dropped -> E
    counts: torch.Tensor | None = None  # rows per expert (all experts: all-to-all; local: all-gather)
    rows: int = 0  # tokens the combine's weighted sum covers (all-gather: the gathered tokens)
    in_splits: list[int] | None = None  # rows sent to each EP rank (all-to-all)
    out_splits: list[int] | None = None  # rows received from each EP rank
    regroup: torch.Tensor | None = None  # received rows -> grouped by local expert
    ungroup: torch.Tensor | None = None  # its inverse
    received_counts: torch.Tensor | None = None  # [ep, local experts]: rows from each rank to each expert
    layout: AlignedLayout | None = None  # the experts' aligned layout (align > 1)
    composed: bool = False  # the permute wrote the aligned rows itself (inverse maps to aligned rows)


class _Dispatcher:
    """What every dispatcher knows: the expert-parallel group and this rank's experts.

    Both directions run in three phases; only `*_exchange` communicates (over the EP group),
    the others are local GPU work, and none of them waits on another rank's data but the
    exchange:

        dispatch_preprocess(x, routing) -> (rows, handle)
        dispatch_exchange(rows, handle) -> rows
        dispatch_postprocess(rows, handle) -> (expert inputs grouped by local expert, rows per local expert)
        combine_preprocess(expert outputs, handle) -> rows
        combine_exchange(rows, handle) -> rows
        combine_postprocess(rows, handle) -> [tokens, dim]

    `dispatch` and `combine` run them in order for one micro-batch (the handle kept in between).

    weigh_in_experts (the default, what MoELayer runs): dispatch also gives each expert row its
    routing weight (`handle.row_weights`) for the experts to apply before their (linear) down
    projection, and the combine only sums.
    The combine's backward then copies each token's gradient to its rows, where weighing in the
    combine also reads every expert output row for the weights' gradient, and keeps those rows
    for it. The all-to-all dispatcher over several ranks sends the weights with their rows (one
    more all-to-all of 4 bytes per row; its backward returns their gradients).

    timer: the run's `moe.comm.ExchangeTimer`, which times the all-to-all dispatcher's token
    exchanges (None: untimed)."""

    def __init__(self, num_experts: int, group=None, weigh_in_experts: bool = True,
                 timer: ExchangeTimer | None = None, align: int = 1):
        if align < 1:
            raise ValueError(f"align={align} must be >= 1")
        self.num_experts = num_experts
        self.align = align
        self.group = group
        self.weigh_in_experts = weigh_in_experts
        self.timer = timer
        self.ep, self.ep_rank = _group_info(group)
        if num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide num_experts={num_experts}")
        self.num_local = num_experts // self.ep
        self._state: DispatchHandle | None = None

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (rows grouped by local expert [N, dim], tokens per local expert [E_local], the rows'
        routing weights [N] for the experts to apply, or None when the combine applies them)."""
        rows, handle = self.dispatch_preprocess(x, routing)
        rows = self.dispatch_exchange(rows, handle)
        expert_in, counts = self.dispatch_postprocess(rows, handle)
        self._state = handle
        return expert_in, counts, handle.row_weights

    def pending_layout(self) -> AlignedLayout | None:
        """The aligned layout of the dispatch awaiting its combine (None: the plain layout)."""
        return self._state.layout if self._state is not None else None

    def _permute_grouped(self, x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                         handle: DispatchHandle) -> torch.Tensor:
        """The permute when its rows are the experts' grouped rows: aligned in place where it can
        (align > 1 and Triton), else plain (`_align` aligns them after)."""
        if self.align > 1 and handle.inverse is not None:
            layout = aligned_layout(counts, order.numel(), self.align)
            grouped_inverse, handle.inverse = handle.inverse, compose_inverse(handle.inverse, layout)
            handle.layout, handle.composed = layout, True
            if self.weigh_in_experts:
                handle.row_weights = to_aligned(row_weights(handle.weights, order, grouped_inverse), layout)
            return permute(x, order, handle.k, handle.inverse, layout)
        if self.weigh_in_experts:
            handle.row_weights = row_weights(handle.weights, order, handle.inverse)
        return permute(x, order, handle.k, handle.inverse)

    def _align(self, rows: torch.Tensor, counts: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Grouped rows into the aligned layout when asked and the permute did not do it."""
        if self.align == 1 or handle.composed:
            return rows
        handle.layout = aligned_layout(counts, rows.shape[0], self.align)
        if handle.row_weights is not None:
            handle.row_weights = to_aligned(handle.row_weights, handle.layout)
        return to_aligned(rows, handle.layout)

    def _unalign(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Aligned expert outputs -> what the combine reads (the grouped rows, or, composed, the
        aligned rows themselves, whose gradient's padding is then zeroed)."""
        if handle.layout is None:
            return expert_out
        if handle.composed:
            return ZeroPaddingGrad.apply(expert_out, handle.layout)
        return from_aligned(expert_out, handle.layout)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Expert outputs in dispatch's row order -> weighted sum per token [T, dim]."""
        handle, self._state = self._state, None
        if handle is None:
            raise RuntimeError("combine() called without a matching dispatch()")
        rows = self.combine_preprocess(expert_out, handle)
        rows = self.combine_exchange(rows, handle)
        return self.combine_postprocess(rows, handle)


class AllToAllDispatcher(_Dispatcher):
    """Permute -> count exchange -> uneven all-to-all -> local grouping, and back."""

    def dispatch_preprocess(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, DispatchHandle]:
        """Local: sort the assignments by global expert and gather their token rows."""
        t, k = routing.indices.shape
        order, counts = sort_by_expert(routing.indices, routing.keep, self.num_experts, routing.tokens_per_expert)
        inverse = assignment_inverse(x, order, k)
        handle = DispatchHandle(routing.weights, t, k, order=order, inverse=inverse, counts=counts, rows=t)
        if self.ep == 1:  # the sorted rows are the experts' grouped rows
            return self._permute_grouped(x, order, counts, handle), handle
        if self.weigh_in_experts:
            handle.row_weights = row_weights(routing.weights, order, inverse)
        return permute(x, order, k, inverse), handle

    def dispatch_exchange(self, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Communicating: the per-expert counts (one small all-to-all, then the split sizes on
        the host: the one host sync), then the rows with uneven splits (and their weights)."""
        if self.ep == 1:
            return rows
        send = handle.counts.view(self.ep, self.num_local)
        recv = exchange_counts(send, self.group)  # row i: what rank i sends to each of my experts
        sizes = torch.cat([send.sum(1), recv.sum(1)]).tolist()
        handle.in_splits, handle.out_splits, handle.received_counts = sizes[: self.ep], sizes[self.ep:], recv
        if handle.row_weights is not None:
            handle.row_weights = all_to_all(handle.row_weights, handle.out_splits, handle.in_splits, self.group,
                                            self.timer)
        return all_to_all(rows, handle.out_splits, handle.in_splits, self.group, self.timer)

    def dispatch_postprocess(self, rows: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """Local: rows arrive ordered (source rank, local expert); make each expert's contiguous
        (and aligned, when asked)."""
        if self.ep == 1:
            return self._align(rows, handle.counts, handle), handle.counts
        recv = handle.received_counts
        local_ids = torch.arange(self.num_local, device=rows.device).repeat(self.ep)
        local_ids = torch.repeat_interleave(local_ids, recv.reshape(-1), output_size=sum(handle.out_splits))
        regroup = torch.argsort(local_ids, stable=True)
        ungroup = torch.empty_like(regroup)
        ungroup[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        handle.regroup, handle.ungroup = regroup, ungroup
        if handle.row_weights is not None:
            handle.row_weights = _Reorder.apply(handle.row_weights, ungroup, regroup)
        counts = recv.sum(0)
        return self._align(_Reorder.apply(rows, ungroup, regroup), counts, handle), counts

    def combine_preprocess(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Local: back to the order the rows arrived in."""
        expert_out = self._unalign(expert_out, handle)
        if self.ep == 1:
            return expert_out
        return _Reorder.apply(expert_out, handle.regroup, handle.ungroup)

    def combine_exchange(self, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Communicating: every row back to the rank of its token."""
        if self.ep == 1:
            return rows
        return all_to_all(rows, handle.in_splits, handle.out_splits, self.group, self.timer)

    def combine_postprocess(self, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Local: weigh each token's k rows (unless the experts did) and sum them."""
        return _sum_rows(rows, handle, handle.tokens)


class AllGatherDispatcher(_Dispatcher):
    """Gather all tokens of the EP group, run the local experts on their share, reduce-scatter."""

    def dispatch_preprocess(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, DispatchHandle]:
        """Local: dropped assignments go to a sentinel expert no rank owns."""
        t, k = routing.indices.shape
        indices = routing.indices
        if routing.keep is not None:
            indices = indices.masked_fill(~routing.keep, self.num_experts)
        return x, DispatchHandle(routing.weights, t, k, indices=indices, rows=t)

    def dispatch_exchange(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Communicating: every rank's token count, then its tokens, weights and expert ids."""
        if self.ep == 1:
            return x
        indices, weights, t = handle.indices, handle.weights, handle.tokens
        sizes = all_gather_dim0(torch.tensor([t], device=x.device), self.group).tolist()
        pad = max(sizes) - t  # equal chunks for the collectives; padding rows route nowhere
        x = F.pad(x, (0, 0, 0, pad))
        indices = F.pad(indices, (0, 0, 0, pad), value=self.num_experts)
        weights = F.pad(weights, (0, 0, 0, pad))
        # Each rank's gradient of the gathered tokens/weights covers only its experts' share:
        # partial sums, so the backward reduce-scatters (the default).
        x = all_gather_tokens(x, self.group)
        handle.weights = all_gather_tokens(weights, self.group)
        handle.indices = all_gather_dim0(indices, self.group)
        handle.rows = x.shape[0]
        return x

    def dispatch_postprocess(self, x: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """Local: this rank's experts' assignments of every gathered token, sorted by expert."""
        local = handle.indices - self.ep_rank * self.num_local
        mine = (local >= 0) & (local < self.num_local)
        order, counts = sort_by_expert(local.clamp(0, self.num_local), mine, self.num_local)
        handle.order, handle.counts = order, counts
        handle.inverse = assignment_inverse(x, order, handle.k)
        return self._align(self._permute_grouped(x, order, counts, handle), counts, handle), counts

    def combine_preprocess(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Local: this rank's partial sum for every gathered token."""
        return _sum_rows(self._unalign(expert_out, handle), handle, handle.rows)

    def combine_exchange(self, partial: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Communicating: sum the partials over the EP group, each rank keeping its tokens' share."""
        if self.ep == 1:
            return partial
        return reduce_scatter_tokens(partial, self.group)

    def combine_postprocess(self, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return rows[: handle.tokens]  # the padding rows, if any


def build_dispatcher(kind: str, num_experts: int, group=None, weigh_in_experts: bool = True,
                     timer: ExchangeTimer | None = None, align: int = 1):
    """"alltoall" or "allgather" over `group` (None: this rank holds every expert);
    weigh_in_experts (what MoELayer runs; False: the combine weighs) and timer: see `_Dispatcher`;
    align > 1: the experts' rows in the aligned layout (module docstring)."""
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, group, weigh_in_experts, timer, align)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, group, weigh_in_experts, timer, align)
    raise ValueError(f"dispatcher={kind!r} must be 'alltoall' or 'allgather'")
