"""Grouped GEMMs in Triton on the M-grouped aligned layout (DeepGEMM's "contiguous" layout).

The layout: each group's rows start at a multiple of `align` rows and are followed by zero rows
up to the next multiple, so every `align`-row tile belongs to one group; rows past the last used
tile belong to none. `tile_expert` (int32 [rows // align]) names each tile's group, -1 for the
unused ones; `offsets` (int32 [G]) are the padded groups' cumulative ends (multiples of align).
Both live on the device; nothing here reads them on the host, so no call syncs.

- `aligned_mm(x, w, offsets, tile_expert)`: x [R, K] (R = tiles x align), w [G, K, N] of any
  strides (a transposed view included) -> [R, N], tile t of x times w[tile_expert[t]]; unused
  tiles give zero rows. One program per (row tile, column tile): it reads its tile's group id,
  no per-group pointer arrays, no partial row tiles, no row masks.
- `aligned_wgrad(x, dy, offsets)`: [G, K, N] with entry g = x_g^T dy_g over group g's rows (padding
  rows are zero, so they add nothing), fp32 accumulation; `aligned_wgrad_into_(out, x, dy, offsets,
  accumulate)` writes (or adds) it straight into an fp32 buffer (the main grad).
- `AlignedGroupedMM`: autograd for the first, dx = aligned_mm(dy, w^T), dw = aligned_wgrad(x, dy).
- `zero_padding_rows_(rows, ends, offsets)`: zeroes each group's rows [ends[g], offsets[g]) and
  every row past offsets[-1] (what the dispatcher's aligned layout needs of a fresh buffer).

bf16 (or fp16) operands, fp32 accumulation. On a GPU the kernels are autotuned over a few Hopper
configurations (128-row tiles: the layout's align must be 128); under TRITON_INTERPRET=1 (tests)
they run one small configuration whose row tile is the layout's align. Offsets that can pass
2^31 elements (row x row size) are int64, as in core.kernels.fused.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from core.kernels.fused import _launch, triton_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers check triton_enabled() first
    triton = None

ALIGN = 128  # the row tile of the tuned kernels, so the layout's alignment on a GPU
_ZERO_BLOCK = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(x: Tensor, w_or_dy: Tensor, offsets: Tensor) -> None:
    if x.dtype != w_or_dy.dtype or x.device != w_or_dy.device:
        raise ValueError(f"operands must share dtype and device, got {x.dtype}/{w_or_dy.dtype} on "
                         f"{x.device}/{w_or_dy.device}")
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.device != x.device:
        raise ValueError(f"offsets must be int32 [G] on {x.device}, got {offsets.dtype} {list(offsets.shape)} "
                         f"on {offsets.device}")


def _align_of(rows: int, tiles: int) -> int:
    if tiles == 0 or rows % tiles:
        raise ValueError(f"{rows} rows are not {tiles} equal row tiles (the aligned layout's tile_expert)")
    return rows // tiles


if triton is not None:

    @triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
                        "EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0})
    @triton.jit
    def _mm_kernel(x, w, out, tile_expert, num_tiles, K, N, stride_wg, stride_wk, stride_wn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
        # Row tiles in groups of GROUP_M walk the column tiles together: neighbouring programs
        # share x's rows and w[e]'s columns in L2 (a row tile's neighbours are mostly the same expert).
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first = (pid // per_group) * GROUP_M
        size = tl.minimum(num_tiles - first, GROUP_M)
        pid_m = first + (pid % per_group) % size
        pid_n = (pid % per_group) // size
        e = tl.load(tile_expert + pid_m)
        k_end = tl.where(e >= 0, K, 0)  # an unused tile multiplies nothing and stores zeros
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptr = x + rows[:, None] * K + ks[None, :]
        b_ptr = w + tl.maximum(e, 0).to(tl.int64) * stride_wg + ks[:, None] * stride_wk + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptr)
                if EVEN_N:
                    b = tl.load(b_ptr)
                else:
                    b = tl.load(b_ptr, mask=cols[None, :] < N, other=0.0)
            else:
                a = tl.load(a_ptr, mask=(k0 + ks)[None, :] < K, other=0.0)
                b = tl.load(b_ptr, mask=((k0 + ks)[:, None] < K) & (cols[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K * stride_wk
        o_ptr = out + rows[:, None] * N + cols[None, :]
        value = acc.to(out.dtype.element_ty)
        if EVEN_N:
            tl.store(o_ptr, value)
        else:
            tl.store(o_ptr, value, mask=cols[None, :] < N)

    @triton.jit
    def _wgrad_kernel(x, dy, out, offsets, K, N, ACCUMULATE: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr):
        # out[g] tile (k, n) = sum over group g's rows r of x[r, k] dy[r, n]. The group is the slow
        # grid axis: all of one group's output tiles run together, its x_g and dy_g stay in L2.
        # Group bounds are multiples of the layout's align, BLOCK_R divides it: no row masks.
        pid = tl.program_id(0)
        g = tl.program_id(1)
        tiles_k = tl.cdiv(K, BLOCK_K)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_K * tiles_n
        first = (pid // per_group) * GROUP_K
        size = tl.minimum(tiles_k - first, GROUP_K)
        pid_k = first + (pid % per_group) % size
        pid_n = (pid % per_group) // size
        start = tl.load(offsets + g - 1, mask=g > 0, other=0)
        end = tl.load(offsets + g)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = ks < K
        n_ok = ns < N
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        first = start.to(tl.int64)
        for r0 in range(0, end - start, BLOCK_R):
            rs = first + r0 + tl.arange(0, BLOCK_R)
            a = tl.load(x + rs[None, :] * K + ks[:, None], mask=k_ok[:, None], other=0.0)
            b = tl.load(dy + rs[:, None] * N + ns[None, :], mask=n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        o_ptr = out + g.to(tl.int64) * K * N + ks[:, None].to(tl.int64) * N + ns[None, :]
        mask = k_ok[:, None] & n_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(o_ptr, mask=mask, other=0.0)
        tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _zero_rows_kernel(rows, begin, end, dim, BLOCK: tl.constexpr):
        # rows [begin[i], end[i]) set to zero, column block by column block.
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < dim
        zero = tl.zeros((BLOCK,), dtype=rows.dtype.element_ty)
        first = tl.load(begin + i).to(tl.int64)
        for j in range(0, tl.load(end + i) - tl.load(begin + i)):
            tl.store(rows + (first + j) * dim + cols, zero, mask=mask)

    def _hopper_configs(names: tuple[str, str, str]) -> list:
        # 128-row tiles (the layout's align); BLOCK_N 128 or 256, BLOCK_K 64; few enough to tune fast.
        m, n, k = names
        shapes = ((128, 4, 4), (128, 8, 3), (256, 8, 3), (256, 8, 4))
        return [triton.Config({m: ALIGN, n: bn, k: 64}, num_warps=warps, num_stages=stages)
                for bn, warps, stages in shapes]

    _mm_tuned = triton.autotune(configs=_hopper_configs(("BLOCK_M", "BLOCK_N", "BLOCK_K")), key=["K", "N"])(
        _mm_kernel)
    # The weight gradient's output rows are K, its reduction the group's rows (BLOCK_R, which divides 128).
    _wgrad_tuned = triton.autotune(configs=_hopper_configs(("BLOCK_K", "BLOCK_N", "BLOCK_R")), key=["K", "N"],
                                   restore_value=["out"])(_wgrad_kernel)


# The interpreter's (and a layout of another align's) configuration; its row tile is the layout's align.
_SMALL = {"BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2, "GROUP_M": 4}


def _run(kernel, grid, *args, **meta) -> None:
    _launch(kernel, grid, *args, remedy="model.moe.grouped_gemm='auto' runs the default kernels instead", **meta)


def aligned_mm(x: Tensor, w: Tensor, offsets: Tensor, tile_expert: Tensor) -> Tensor:
    """[R, N]: tile t of x [R, K] times w[tile_expert[t]] (w [G, K, N], any strides), zero rows
    for unused tiles (tile_expert -1). Needs `triton_enabled(x)`; no autograd (`AlignedGroupedMM`)."""
    _check(x, w, offsets)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"aligned_mm needs x [R, K] and w [G, K, N], got {list(x.shape)} and {list(w.shape)}")
    rows, k = x.shape
    n = w.shape[2]
    x = x.contiguous()
    out = x.new_empty(rows, n)
    tiles = tile_expert.numel()
    if rows == 0 or n == 0:
        return out
    align = _align_of(rows, tiles)
    args = (x, w, out, tile_expert, tiles, k, n, w.stride(0), w.stride(1), w.stride(2))
    if align == ALIGN and not _interpreting():
        _run(_mm_tuned, lambda meta: (tiles * triton.cdiv(n, meta["BLOCK_N"]),), *args, GROUP_M=8)
    else:
        _run(_mm_kernel, (tiles * triton.cdiv(n, _SMALL["BLOCK_N"]),), *args, BLOCK_M=align, **_SMALL)
    return out


def aligned_wgrad_into_(out: Tensor, x: Tensor, dy: Tensor, offsets: Tensor, accumulate: bool) -> Tensor:
    """out [G, K, N] (contiguous; fp32 for a main grad, or x's dtype) = (or += with accumulate)
    x_g^T dy_g over each group's rows, fp32 accumulation. Needs `triton_enabled(x)`."""
    _check(x, dy, offsets)
    groups, k, n = offsets.shape[0], x.shape[1], dy.shape[1]
    if x.dim() != 2 or dy.dim() != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"aligned wgrad needs x [R, K] and dy [R, N], got {list(x.shape)} and {list(dy.shape)}")
    if list(out.shape) != [groups, k, n] or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"aligned wgrad needs a contiguous out [{groups}, {k}, {n}] on {x.device}, got "
                         f"{list(out.shape)} on {out.device}")
    if groups == 0 or k == 0 or n == 0:
        return out
    if x.shape[0] == 0:
        return out if accumulate else out.zero_()
    x, dy = x.contiguous(), dy.contiguous()
    args = (x, dy, out, offsets, k, n)
    if not _interpreting():
        _run(_wgrad_tuned, lambda meta: (triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n, meta["BLOCK_N"]), groups),
             *args, ACCUMULATE=accumulate, GROUP_K=8)
    else:
        bk, bn, br = 32, 32, 16
        _run(_wgrad_kernel, (triton.cdiv(k, bk) * triton.cdiv(n, bn), groups), *args, ACCUMULATE=accumulate,
             BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, GROUP_K=4, num_warps=4)
    return out


def aligned_wgrad(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    """[G, K, N] in x's dtype: x_g^T dy_g per group (zeros for empty groups)."""
    out = x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1])
    return aligned_wgrad_into_(out, x, dy, offsets, accumulate=False)


class AlignedGroupedMM(torch.autograd.Function):
    """aligned_mm with autograd: dx = aligned_mm(dy, w^T), dw = aligned_wgrad(x, dy)."""

    @staticmethod
    def forward(ctx, x, w, offsets, tile_expert):
        ctx.save_for_backward(x, w, offsets, tile_expert)
        return aligned_mm(x, w, offsets, tile_expert)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets, tile_expert = ctx.saved_tensors
        grad = grad.contiguous()
        dx = aligned_mm(grad, w.transpose(1, 2), offsets, tile_expert) if ctx.needs_input_grad[0] else None
        dw = aligned_wgrad(x, grad, offsets) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def zero_padding_rows_(rows: Tensor, ends: Tensor, offsets: Tensor) -> Tensor:
    """Zero rows [ends[g], offsets[g]) of every group g and rows [offsets[-1], R) (in place; rows
    [R, ...] contiguous, ends and offsets int32 [G] on its device). No host sync."""
    if rows.shape[0] == 0 or rows.numel() == 0:
        return rows
    total = rows.shape[0]
    begin = torch.cat((ends, offsets[-1:])) if offsets.numel() else torch.zeros(1, dtype=torch.int32, device=rows.device)
    stop = torch.cat((offsets, offsets.new_full((1,), total)))
    flat = rows.view(total, -1)
    if triton_enabled(rows) and rows.is_contiguous():
        dim = flat.shape[1]
        _run(_zero_rows_kernel, (begin.numel(), triton.cdiv(dim, _ZERO_BLOCK)), flat, begin, stop, dim,
             BLOCK=_ZERO_BLOCK, num_warps=4)
        return rows
    # PyTorch: a mask over all rows (one pass; the CPU's and TESSERA_TRITON=0's path)
    r = torch.arange(total, device=rows.device)
    group = torch.searchsorted(stop, r, right=True).clamp(max=begin.numel() - 1)
    flat.masked_fill_((r >= begin[group])[:, None], 0)
    return rows
