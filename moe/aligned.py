"""The experts' rows in the M-grouped aligned layout (`model.moe.grouped_gemm = "triton"`).

Each local expert's rows start at a multiple of `align` (128: the grouped kernels' row tile) and
are followed by zero rows up to the next multiple, so every row tile belongs to one expert and
the kernel reads the tile's expert id (core.kernels.grouped_triton). All of it is built on the
device from the per-expert counts without a host sync: the number of rows is not known on the
host, so the buffer takes the upper bound

    tiles = min((n + E (align - 1)) // align, n),   rows = tiles x align

(each expert pads fewer than `align` rows, and a used tile holds at least one real row); the
tiles past the last expert's are unused (tile_expert -1), zero in every buffer, and skipped by
the kernels. At n = 131072 routed rows over 64 experts that is 6.2% more rows than n, of which on
average half an align per expert is padding and the rest unused.

Padding rows are zero in the experts' input (the permute zeroes them), hence in every GEMM and
SwiGLU output; the combine reads only real rows, and the gradient reaching the expert outputs
gets its padding rows zeroed (`ZeroPaddingGrad`), so padding adds nothing to any weight gradient
whatever kernel runs on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from core.kernels.grouped_triton import zero_padding_rows_


@dataclass
class AlignedLayout:
    """Where the grouped rows (n of them, expert after expert) sit in the aligned buffer."""

    align: int
    rows: int  # the buffer's rows: tiles x align (host int, from n and E only)
    dest: Tensor  # int64 [n]: the aligned row of each grouped row
    src: Tensor  # int64 [rows]: the grouped row of each aligned row, n for padding and unused rows
    offsets: Tensor  # int32 [E]: cumulative ends of the padded groups (multiples of align)
    ends: Tensor  # int32 [E]: each group's end of real rows (its padding is [ends, offsets))
    tile_expert: Tensor  # int32 [tiles]: each row tile's expert, -1 for the unused tiles

    def zero_padding_(self, rows: Tensor) -> Tensor:
        return zero_padding_rows_(rows, self.ends, self.offsets)


def aligned_layout(counts: Tensor, n: int, align: int) -> AlignedLayout:
    """The layout of n grouped rows with `counts` [E] rows per expert (on the device; they sum to
    n, which the caller knows on the host), each group padded to a multiple of align."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    experts, device = counts.shape[0], counts.device
    counts = counts.to(torch.int64)
    tiles = min((n + experts * (align - 1)) // align, n)
    padded = (counts + align - 1) // align * align
    aligned_ends = torch.cumsum(padded, 0)
    shift = (aligned_ends - padded) - (torch.cumsum(counts, 0) - counts)  # aligned start - grouped start
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=device), counts, output_size=n)
    dest = torch.arange(n, device=device) + shift[expert_of_row]
    src = torch.full((tiles * align,), n, dtype=torch.int64, device=device)
    src[dest] = torch.arange(n, device=device)
    tile_expert = torch.searchsorted(aligned_ends, torch.arange(tiles, device=device) * align, right=True)
    tile_expert = torch.where(tile_expert < experts, tile_expert, -1).to(torch.int32)
    return AlignedLayout(align, tiles * align, dest, src, aligned_ends.to(torch.int32),
                         (aligned_ends - padded + counts).to(torch.int32), tile_expert)


def _gather_aligned(rows: Tensor, layout: AlignedLayout) -> Tensor:
    if rows.shape[0] == 0:
        return rows.new_zeros(layout.rows, *rows.shape[1:])
    return layout.zero_padding_(rows.index_select(0, layout.src.clamp(max=rows.shape[0] - 1)))


class _ToAligned(torch.autograd.Function):
    """grouped rows [n, ...] -> the aligned buffer [rows, ...] (padding zero); backward gathers
    each grouped row's gradient back from its aligned row. Gathers both ways: no atomics."""

    @staticmethod
    def forward(ctx, rows, layout):
        ctx.layout = layout
        return _gather_aligned(rows, layout)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.layout.dest), None


class _FromAligned(torch.autograd.Function):
    """The aligned buffer -> the grouped rows; backward puts the gradient in aligned rows, padding zero."""

    @staticmethod
    def forward(ctx, rows, layout):
        ctx.layout = layout
        return rows.index_select(0, layout.dest)

    @staticmethod
    def backward(ctx, grad):
        return _gather_aligned(grad.contiguous(), ctx.layout), None


class ZeroPaddingGrad(torch.autograd.Function):
    """Identity on aligned expert outputs; the backward zeroes the gradient's padding and unused
    rows (the combine's backward leaves them unwritten)."""

    @staticmethod
    def forward(ctx, rows, layout):
        ctx.layout = layout
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        return ctx.layout.zero_padding_(grad.contiguous()), None


def to_aligned(rows: Tensor, layout: AlignedLayout) -> Tensor:
    return _ToAligned.apply(rows, layout)


def from_aligned(rows: Tensor, layout: AlignedLayout) -> Tensor:
    return _FromAligned.apply(rows, layout)


def compose_inverse(inverse: Tensor, layout: AlignedLayout) -> Tensor:
    """An assignment -> grouped row map (-1: none) turned into assignment -> aligned row."""
    return torch.where(inverse >= 0, layout.dest[inverse.clamp(min=0)], -1)
