"""The MoE experts' FP8 weight gradient as one K-grouped GEMM (no host sync, graph-capturable).

dW_g = x_g^T dy_g ([in, out], the experts' layout) reduces over the tokens of expert g, so the
groups sit along K. Blockwise scales run along K too (core/precision/blockwise.py takes 1x128 for x^T per
input channel, 128x128 for dy^T), and a scale block must not straddle two experts: each group
is laid out on its own run of 128-token blocks, zero-padded at its end (zeros change neither a
block's amax nor a sum). That is exactly the quantisation of each expert's tokens on their
own, as the per-expert loop it replaces did.

- `group_blocks(offsets, rows)` -> (row_starts, block_starts), int32 [G + 1] each, computed
  on the device: group g = rows [row_starts[g], row_starts[g+1]) goes to 128-token blocks
  [block_starts[g], block_starts[g+1]).
- `quantize_grouped_t(x, row_starts, block_starts, out_blocks, per_column)` -> x^T in that
  padded layout, q e4m3 [cols, 128 * out_blocks], with 1x128 (per_column) or 128x128 scales.
- `grouped_wgrad_blockwise(a, sfa, b, sfb, block_starts)` -> bf16 [G, M, N], entry g =
  (a * sfa) (b * sfb)^T over group g's blocks (zeros for an empty group);
  `grouped_wgrad_blockwise_into_(out, ..., accumulate)` the same into an fp32 `out` it
  overwrites or adds to (the fp32 main grad: gradient-accumulation fusion).

`out_blocks = padded_blocks(rows, G)` bounds the blocks any routing needs (ceil(rows/128) + G)
without reading the offsets on the host; blocks past the last group are left unwritten and
never read. Without the kernel library: PyTorch fallbacks with the same arithmetic (they read
the group bounds on the host).
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.kernels.fp8 import (BLOCK, FP8, _blocks, _call, _device_stream, _fp8_lib, _kernel_input, _ref_1x128,
                              _ref_128x128, dequantize_1x128, dequantize_128x128, run_fp8_grouped)
from core.kernels.fused import accumulate_fp32_
from core.kernels.library import custom_op

__all__ = ["group_blocks", "padded_blocks", "quantize_grouped_t", "grouped_wgrad_blockwise",
           "grouped_wgrad_blockwise_into_"]


def padded_blocks(rows: int, groups: int) -> int:
    """128-token blocks enough for any split of `rows` tokens into `groups` padded groups."""
    return _blocks(rows) + groups


def group_blocks(offsets: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(row_starts, block_starts) int32 [G + 1] from the MoE group ends `offsets` (read as the
    kernels read them: clamped to [0, rows], a decrease is an empty group)."""
    ends = torch.cummax(offsets.long().clamp(0, rows), 0).values
    row_starts = torch.cat((ends.new_zeros(1), ends))
    blocks = (row_starts[1:] - row_starts[:-1] + BLOCK - 1) // BLOCK
    block_starts = torch.cat((blocks.new_zeros(1), torch.cumsum(blocks, 0)))
    return row_starts.int(), block_starts.int()


def _check_starts(row_starts: Tensor, block_starts: Tensor, x: Tensor) -> None:
    for name, t in (("row_starts", row_starts), ("block_starts", block_starts)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.device != x.device or t.shape[0] < 2:
            raise ValueError(f"{name} must be int32 [G + 1] on {x.device}, got {t.dtype} {list(t.shape)} on {t.device}")
    if row_starts.shape != block_starts.shape:
        raise ValueError(f"row_starts {list(row_starts.shape)} and block_starts {list(block_starts.shape)} differ")


def _group_spans(row_starts: Tensor, block_starts: Tensor, rows: int, out_blocks: int):
    """(group, first row, rows, first block, blocks) of every non-empty group, on the host."""
    rs, bs = row_starts.tolist(), block_starts.tolist()
    for g in range(len(rs) - 1):
        r0, r1 = max(0, min(rs[g], rows)), max(0, min(rs[g + 1], rows))
        b0 = max(0, min(bs[g], out_blocks))
        nb = max(0, min(bs[g + 1], out_blocks) - b0)
        if r1 > r0 and nb > 0:
            yield g, r0, r1 - r0, b0, nb


@custom_op("fp8_quantize_grouped_t")
def quantize_grouped_t(x: Tensor, row_starts: Tensor, block_starts: Tensor, out_blocks: int,
                       per_column: bool) -> tuple[Tensor, Tensor]:
    """x [rows, cols] -> (q e4m3 [cols, 128 * out_blocks], scale): scale [out_blocks, cols]
    (per_column: 1x128 blocks of x^T) or [out_blocks, ceil(cols/128)] (128x128 blocks)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_grouped_t needs x [rows, cols], got {list(x.shape)}")
    _check_starts(row_starts, block_starts, x)
    rows, cols = x.shape
    groups = row_starts.shape[0] - 1
    scale_cols = cols if per_column else _blocks(cols)
    lib = _fp8_lib(x, "fp8_quantize_grouped_t", _kernel_input(x, 8) and 0 < out_blocks <= 65535)
    if lib is None:
        q = torch.zeros(cols, BLOCK * out_blocks, dtype=FP8, device=x.device)
        scale = torch.ones(out_blocks, scale_cols, dtype=torch.float32, device=x.device)
        for _, r0, n, b0, nb in _group_spans(row_starts, block_starts, rows, out_blocks):
            part = torch.nn.functional.pad(x[r0:r0 + min(n, nb * BLOCK)], (0, 0, 0, nb * BLOCK - min(n, nb * BLOCK)))
            if per_column:
                qg, sg = _ref_1x128(part.t(), None)  # [cols, nb*128], [nb, cols]
            else:
                qg, sg = (t[0] for t in _ref_128x128(part[None], transpose=True))  # [cols, nb*128], [nb, cb]
            q[:, b0 * BLOCK:(b0 + nb) * BLOCK] = qg
            scale[b0:b0 + nb] = sg
        return q, scale
    q = torch.empty(cols, BLOCK * out_blocks, dtype=FP8, device=x.device)
    scale = torch.empty(out_blocks, scale_cols, dtype=torch.float32, device=x.device)
    _call(lib, "fp8_quantize_grouped_t", x.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, cols,
          row_starts.data_ptr(), block_starts.data_ptr(), groups, out_blocks, int(per_column), *_device_stream(x))
    return q, scale


@quantize_grouped_t.register_fake
def _(x, row_starts, block_starts, out_blocks, per_column):
    cols = x.shape[1]
    return (x.new_empty(cols, BLOCK * out_blocks, dtype=FP8),
            x.new_empty(out_blocks, cols if per_column else _blocks(cols), dtype=torch.float32))


def _check_wgrad_operands(a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor, block_starts: Tensor) -> tuple[int, int, int]:
    """(m, n, kp) after checking the operands of the K-grouped weight gradient."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.shape[1] % BLOCK:
        raise ValueError(f"need a [M, Kp] and b [N, Kp] with Kp a multiple of {BLOCK}, got {list(a.shape)}, "
                         f"{list(b.shape)}")
    (m, kp), n = a.shape, b.shape[0]
    kb = kp // BLOCK
    if (a.dtype, b.dtype, sfa.dtype, sfb.dtype) != (FP8, FP8, torch.float32, torch.float32) or \
            list(sfa.shape) != [kb, m] or list(sfb.shape) != [kb, _blocks(n)]:
        raise ValueError(f"need e4m3 a, b with fp32 scales [{kb}, {m}] and [{kb}, {_blocks(n)}], got {a.dtype}, "
                         f"{b.dtype}, {sfa.dtype} {list(sfa.shape)}, {sfb.dtype} {list(sfb.shape)}")
    if block_starts.dtype != torch.int32 or block_starts.dim() != 1 or block_starts.shape[0] < 2:
        raise ValueError(f"block_starts must be int32 [G + 1], got {block_starts.dtype} {list(block_starts.shape)}")
    return m, n, kp


def _wgrad_kernel_ready(a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor, block_starts: Tensor, m: int, n: int) -> bool:
    return (all(t.is_contiguous() for t in (a, b, sfa, sfb)) and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
            and sfa.data_ptr() % 16 == 0 and m % 4 == 0 and n % 16 == 0 and block_starts.device == a.device)


def _wgrad_fallback(a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor, block_starts: Tensor, dtype: torch.dtype) -> Tensor:
    """The kernel's arithmetic in PyTorch ([G, M, N] in `dtype`; reads block_starts on the host)."""
    (m, kp), n = a.shape, b.shape[0]
    kb = kp // BLOCK
    groups = block_starts.shape[0] - 1
    out = torch.zeros(groups, m, n, dtype=dtype, device=a.device)
    bs = block_starts.tolist()
    for g in range(groups):
        b0 = max(0, min(bs[g], kb))
        b1 = max(b0, min(bs[g + 1], kb))
        if b1 > b0:
            cols = slice(b0 * BLOCK, b1 * BLOCK)
            da = dequantize_1x128(a[:, cols], sfa[b0:b1])
            db = dequantize_128x128(b[:, cols], sfb[b0:b1])
            out[g] = (da @ db.t()).to(dtype)
    return out


@custom_op("fp8_grouped_wgrad_blockwise")
def grouped_wgrad_blockwise(a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor, block_starts: Tensor) -> Tensor:
    """bf16 [G, M, N]: entry g = (a * sfa)[:, K_g] @ ((b * sfb)[:, K_g])^T over group g's K columns
    K_g = [128 block_starts[g], 128 block_starts[g+1]); a [M, Kp] (1x128 scales [Kp/128, M]),
    b [N, Kp] (128x128 scales [Kp/128, N/128]), both from quantize_grouped_t."""
    m, n, kp = _check_wgrad_operands(a, sfa, b, sfb, block_starts)
    groups = block_starts.shape[0] - 1
    lib = _fp8_lib(a, "fp8_grouped_wgrad_blockwise", _wgrad_kernel_ready(a, sfa, b, sfb, block_starts, m, n))
    if lib is None:
        return _wgrad_fallback(a, sfa, b, sfb, block_starts, torch.bfloat16)
    out = torch.empty(groups, m, n, dtype=torch.bfloat16, device=a.device)
    return run_fp8_grouped(lib, "fp8_gg_wgrad", (a, sfa, b, sfb), out, block_starts, groups, (m, n, kp), kp / groups)


@torch.library.custom_op("tessera::fp8_grouped_wgrad_blockwise_into_", mutates_args=("out",))
def grouped_wgrad_blockwise_into_(out: Tensor, a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor, block_starts: Tensor,
                                  accumulate: bool) -> None:
    """grouped_wgrad_blockwise into fp32 `out` [G, M, N], overwritten (empty groups zeroed) or,
    with accumulate, added to: the GEMM epilogue writes the fp32 main grad itself."""
    m, n, kp = _check_wgrad_operands(a, sfa, b, sfb, block_starts)
    groups = block_starts.shape[0] - 1
    if out.dtype != torch.float32 or list(out.shape) != [groups, m, n] or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{groups}, {m}, {n}], got {out.dtype} {list(out.shape)}")
    ready = _wgrad_kernel_ready(a, sfa, b, sfb, block_starts, m, n) and out.data_ptr() % 16 == 0
    lib = _fp8_lib(a, "fp8_grouped_wgrad_blockwise_into_", ready)
    if lib is None:
        accumulate_fp32_(out, _wgrad_fallback(a, sfa, b, sfb, block_starts, torch.float32), copy=not accumulate)
        return
    run_fp8_grouped(lib, "fp8_gg_wgrad_f32", (a, sfa, b, sfb), out, block_starts, groups, (m, n, kp), kp / groups,
                    accumulate=accumulate)


@grouped_wgrad_blockwise_into_.register_fake
def _(out, a, sfa, b, sfb, block_starts, accumulate):
    return None


@grouped_wgrad_blockwise.register_fake
def _(a, sfa, b, sfb, block_starts):
    return a.new_empty(block_starts.shape[0] - 1, a.shape[0], b.shape[0], dtype=torch.bfloat16)
