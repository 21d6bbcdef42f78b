"""Routed experts: SwiGLU weights stacked per rank [E_local, ...] and one grouped GEMM.

`expert_mm(x, w, offsets)` is the experts' single entry point for the grouped matrix product
(the autocast cast and the main-grad fusion around the kernel), so the CUTLASS kernels in
csrc/ can replace it in one place:

- CUDA: the `tessera::grouped_mm` custom op of `core.kernels`, with the group offsets a
  device tensor (no host sync; its autograd gives both backward GEMMs): CUTLASS sm_90a kernels
  from csrc/ for bf16 when the library is built, else `torch._grouped_mm` (bf16, sm_90+), else
  an exact per-group loop; core.kernels logs the path taken once.
- CPU: an exact per-group loop over experts (not tokens), one matmul per expert; it reads the
  offsets on the host. The fallback is logged once.
- `model.moe.grouped_gemm = "triton"`: the dispatcher hands over the rows in the aligned layout
  (moe.aligned; `expert_align`), and `expert_mm(..., tile_expert=...)` runs the Triton kernels of
  core.kernels.grouped_triton on it (each 128-row tile one expert's), the weight gradient into
  the fp32 main grad as on the CUTLASS path. Without Triton the same layout runs the default
  kernels above on the padded offsets (padding rows are zero, so they add nothing).

Weights are stored [E, in, out] so every GEMM is x @ w[e] without a transpose: `w13`
[E, dim, 2, hidden] holds each expert's gate (w13[e, :, 0]) and up (w13[e, :, 1]) projections,
run as ONE GEMM on its contiguous view [E, dim, 2 x hidden] (gate columns first), and `w2`
[E, hidden, dim] the down projection. The fused gate/up GEMM reads the rows once, and its
backward is one data-gradient GEMM (the SwiGLU's backward hands it one [rows, 2 x hidden]
gradient) where separate gate and up GEMMs needed two and an add of their results (the add
alone: 6.2 ms of a 533 ms training step on an H100). The 2 is a dim of its own so that expert
tensor parallelism splits the hidden size as a plain slice of the last dim (each rank keeps
matching gate and up columns). State dicts from before, with separate `w1` (gate) and `w3`
(up), load into w13.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from core import kernels, placement
from core.state.layouts import FUSED_DIM, FUSED_TENSORS
from core.layers import FusedSwiGLU
from core.config import MoEConfig
from core.kernels.fused import triton_enabled
from core.kernels.grouped_gemm import grouped_mm_wgrad_into_, main_grad_sink
from core.kernels.grouped_triton import ALIGN, AlignedGroupedMM, aligned_mm, aligned_wgrad_into_
from core.kernels.library import report_once

log = logging.getLogger(__name__)
_OLDER_W13 = tuple(key.rpartition(".")[2] for key in FUSED_TENSORS["experts.w13"])  # this module's names: w1, w3


def _native_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """None when torch._grouped_mm can run these operands, else why not."""
    if not x.is_cuda:
        return f"device {x.device.type}"
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm missing"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"dtype {x.dtype}/{w.dtype} (needs bf16)"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "GPU older than sm_90"
    if x.shape[-1] % 8 or w.shape[-1] % 8:
        return f"dims {x.shape[-1]}x{w.shape[-1]} not multiples of 8 (16-byte rows)"
    return None


def expert_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference: rows [offsets[g-1], offsets[g]) of x times w[g], one matmul per group."""
    ends = offsets.tolist()
    sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
    rest = x.shape[0] - (ends[-1] if ends else 0)
    # split/unbind (not slicing/indexing): their backward is one cat/stack, where each
    # slice's or index's would be a full-size zero tensor per group.
    pieces = x.split(sizes + [rest], dim=0)
    outs = [piece @ wg for piece, wg in zip(pieces[:-1], w.unbind(0))]
    if rest:  # rows past the last offset belong to no group: zeros
        outs.append(x.new_zeros(rest, w.shape[-1]))
    return torch.cat(outs, dim=0)


def expert_align(moe: MoEConfig) -> int:
    """Rows each expert's group is aligned to in the dispatcher's layout (1: not aligned)."""
    return ALIGN if moe.grouped_gemm == "triton" else 1


def _product(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, tile_expert: torch.Tensor | None = None,
             grad: bool = True) -> torch.Tensor:
    if tile_expert is not None and triton_enabled(x):
        return AlignedGroupedMM.apply(x, w, offsets, tile_expert) if grad else aligned_mm(x, w, offsets, tile_expert)
    if x.is_cuda:
        return kernels.grouped_mm(x, w, offsets)
    report_once(f"moe expert_mm: per-expert loop fallback (device {x.device.type})", logging.INFO, log)
    return expert_mm_loop(x, w, offsets)


class _GroupedMMIntoMainGrad(torch.autograd.Function):
    """expert_mm(x, weight, offsets) whose weight gradient the backward writes into the fp32 main
    grad of the weight's parameter through `sink` (its `main_grad_sink`, gradient-accumulation
    fusion set up by core.parallel.data; seen in the weight's shape when the weight is a view of
    the parameter, as w13's is): on the CUTLASS path the wgrad GEMM's epilogue adds to the main
    grad, so no bf16 gradient is written and read back and the separate fp32 accumulation pass
    is gone."""

    @staticmethod
    def forward(ctx, x, weight, offsets, dtype, sink, tile_expert):
        w = weight.to(dtype)  # the cast stays inside: its gradient never goes through autograd
        ctx.save_for_backward(x, w, offsets, tile_expert)
        ctx.sink = sink
        return _product(x, w, offsets, tile_expert, grad=False)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets, tile_expert = ctx.saved_tensors
        grad = grad.contiguous()
        dx = _product(grad, w.transpose(-2, -1), offsets, tile_expert, grad=False) if ctx.needs_input_grad[0] else None
        wgrad = grouped_mm_wgrad_into_
        if tile_expert is not None and triton_enabled(x):
            wgrad = aligned_wgrad_into_
        ctx.sink.write(lambda main_grad, accumulate: wgrad(main_grad, x, grad, offsets, accumulate))
        return dx, ctx.sink.stand_in(), None, None, None, None


def expert_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
              tile_expert: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] with rows grouped by expert, w [G, K, M], offsets int32 [G] cumulative group
    ends (offsets[-1] == N) -> [N, M] where rows of group g are multiplied by w[g]. With
    `tile_expert` the rows are in the aligned layout (moe.aligned) and Triton runs them.

    Under autocast both operands are cast to the autocast dtype first, as torch.matmul's are:
    custom ops are invisible to autocast, and fp32 master weights there sent every expert
    GEMM to the fp32 per-group loop (measured on an H100, 2026-11-23). A parameter with a
    `main_grad_sink` (data parallelism with gradient_accumulation_fusion), or a view of all of
    one (w13 as [E, dim, 2 x hidden]), gets its gradient written into its fp32 main grad by the
    backward itself."""
    dtype = w.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x = x.to(dtype)
    sink = main_grad_sink(w)
    if sink is not None and w.requires_grad and torch.is_grad_enabled():
        return _GroupedMMIntoMainGrad.apply(x, w, offsets, dtype, sink, tile_expert)
    return _product(x, w.to(dtype), offsets, tile_expert)


def offsets_from_counts(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """int32 cumulative ends of the expert groups, on the counts' device (no host sync)."""
    return torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: (silu(x gate_e) * (x up_e)) w2_e for the rows routed to expert e, with
    gate_e, up_e = w13[e, :, 0], w13[e, :, 1] (module docstring).

    Parameters carry `expert_parallel = True`: their gradients are reduced over the
    expert-data-parallel group ("edp"), not "dp_cp". `moe.parallel.apply_ep` keeps only this
    rank's experts (and with expert tensor parallelism a slice of the hidden size)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, mm=expert_mm):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.w13 = nn.Parameter(torch.empty(num_experts, dim, 2, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for param in (self.w13, self.w2):
            nn.init.normal_(param, 0.0, 0.02)
            placement.tag_expert(param)
        self.mm = mm  # the bench swaps in expert_mm_loop as its baseline, the FP8 recipe Fp8GroupedMM
        self.act = FusedSwiGLU()
        self.chunk_rows = 0  # > 0: tiled (train.mlp_chunk_tokens x top_k rows at a time, set by parallelize)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                row_weights: torch.Tensor | None = None, layout=None) -> torch.Tensor:
        """x [N, dim] grouped by expert; tokens_per_expert [E_local] sums to N; row_weights [N]
        (optional): each row's routing weight, applied to its SwiGLU product before w2 (the same
        as weighting the output: w2 is linear). `layout` (a moe.aligned.AlignedLayout): x and
        row_weights are in the aligned layout instead, its offsets used; the default `mm` then
        runs the aligned Triton kernels, any other `mm` (the FP8 recipe's) the padded offsets.

        Tiled (`chunk_rows` > 0): the rows run `chunk_rows` at a time (whole tiles of an aligned
        layout), each chunk recomputed in the backward, so the [rows, 2 x hidden] intermediates
        exist for one chunk only and the experts keep their input rows alone. A chunk may cut an
        expert's rows in two: its group ends are the offsets clipped to the chunk, computed on the
        device (no host sync)."""
        if layout is None:
            offsets, tile_expert, align = offsets_from_counts(tokens_per_expert), None, 1
        else:
            offsets, tile_expert, align = layout.offsets, layout.tile_expert, layout.align
        rows, chunk = x.shape[0], -(-self.chunk_rows // align) * align
        if not chunk or rows <= chunk:
            return self._swiglu(x, offsets, row_weights, tile_expert)
        recompute = torch.is_grad_enabled()
        outs = []
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            args = (x[start:end], (offsets - start).clamp_(0, end - start),
                    row_weights[start:end] if row_weights is not None else None,
                    tile_expert[start // align:end // align] if tile_expert is not None else None)
            outs.append(checkpoint(self._swiglu, *args, use_reentrant=False) if recompute else self._swiglu(*args))
        return torch.cat(outs)

    def _swiglu(self, x: torch.Tensor, offsets: torch.Tensor, row_weights: torch.Tensor | None,
                tile_expert: torch.Tensor | None) -> torch.Tensor:
        mm = self.mm
        if tile_expert is not None and mm is expert_mm:
            mm = functools.partial(expert_mm, tile_expert=tile_expert)
        h = self.act(mm(x, self.w13.flatten(2), offsets), row_weights)
        return mm(h, self.w2, offsets)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A state dict from before gate and up were one weight (core.state.layouts): w1 and w3 [E, dim, hidden].
        keys = [prefix + name for name in _OLDER_W13]
        if all(k in state_dict for k in keys) and prefix + "w13" not in state_dict:
            state_dict[prefix + "w13"] = torch.stack([state_dict.pop(k) for k in keys], dim=FUSED_DIM)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}"
