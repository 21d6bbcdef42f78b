"""The token embedding's weight gradient added into an fp32 table: `add_embedding_grad_`.

table[t] += sum of grad rows i with tokens[i] == t, touching only the rows the tokens use. torch's
own backward builds a dense [vocab, dim] gradient (a zero fill and a scatter) that then costs a
pass over the whole table to accumulate; `index_put_` with accumulation sums each row serially
after its sort (1.56 ms on an H100 at 8192 tokens of dim 2048 with one token repeated 2000
times, against 1.30 for the dense gradient plus the add).

Deterministic: the token ids are sorted (stably), and each table row is summed by one program in
sorted order. A row used more than CHUNK times is summed in CHUNK-row pieces by several programs
(a long run of one token is not one serial loop) into a scratch row each, and a second launch
adds those pieces in order. On CPU (or without Triton) `index_add_`, which sums in token order.
TRITON_INTERPRET=1 runs the kernels on CPU tensors (tests/test_fused_kernels.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.kernels.fused import _launch, triton_enabled

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CHUNK = 32  # rows of one token summed by one program
_BLOCK = 512  # columns per program


if triton is not None:

    @triton.jit
    def _sum_pieces_kernel(ids, order, starts, ends, grad, table, partial, dim,
                           CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # Program i: sorted position i, if it heads a piece (its run's start, or CHUNK rows on).
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < dim
        start = tl.load(starts + i)
        end = tl.load(ends + i)
        head = (i - start) % CHUNK == 0
        count = tl.where(head, tl.minimum(i + CHUNK, end) - i, 0)  # 0: not a piece's head
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, count):
            row = tl.load(order + i + k).to(tl.int64)
            acc += tl.load(grad + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        if head:
            if end - start <= CHUNK:  # the run's only piece: its program owns the table row
                token = tl.load(ids + i).to(tl.int64)
                ptr = table + token * dim + cols
                tl.store(ptr, tl.load(ptr, mask=mask) + acc, mask=mask)
            else:
                tl.store(partial + i.to(tl.int64) * dim + cols, acc, mask=mask)

    @triton.jit
    def _add_pieces_kernel(ids, starts, ends, table, partial, dim, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # Program i: the start of a run longer than CHUNK adds its pieces, in order.
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < dim
        start = tl.load(starts + i)
        end = tl.load(ends + i)
        if (start == i) & (end - start > CHUNK):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p in range(0, tl.cdiv(end - start, CHUNK)):
                piece = start + p * CHUNK  # int64, as the starts are
                acc += tl.load(partial + piece * dim + cols, mask=mask, other=0.0)
            token = tl.load(ids + i).to(tl.int64)
            ptr = table + token * dim + cols
            tl.store(ptr, tl.load(ptr, mask=mask) + acc, mask=mask)


def _runs(sorted_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each sorted position, the start and end (exclusive) of its run of equal ids."""
    n = sorted_ids.numel()
    positions = torch.arange(n, device=sorted_ids.device)
    first = torch.ones(n, dtype=torch.bool, device=sorted_ids.device)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    starts = torch.cummax(torch.where(first, positions, 0), 0).values
    ends = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    return starts, ends


def add_embedding_grad_(table: Tensor, tokens: Tensor, grad: Tensor) -> None:
    """table (fp32 [vocab, dim]) [tokens[i]] += grad[i] for every i, in fp32; tokens [n] int,
    grad [n, dim] (any float dtype). Deterministic."""
    tokens = tokens.reshape(-1)
    if tokens.numel() == 0:
        return
    grad = grad.reshape(tokens.numel(), -1).contiguous()
    if not (triton_enabled(grad) and table.is_contiguous() and table.dtype == torch.float32):
        table.index_add_(0, tokens, grad.to(table.dtype))
        return
    sorted_ids, order = torch.sort(tokens, stable=True)
    starts, ends = _runs(sorted_ids)
    n, dim = grad.shape
    partial = grad.new_empty((n if n > CHUNK else 1, dim), dtype=torch.float32)  # pieces of runs longer than CHUNK
    grid = (n, triton.cdiv(dim, _BLOCK))
    _launch(_sum_pieces_kernel, grid, sorted_ids, order, starts, ends, grad, table, partial, dim, CHUNK=CHUNK, BLOCK=_BLOCK)
    if n > CHUNK:
        _launch(_add_pieces_kernel, grid, sorted_ids, starts, ends, table, partial, dim, CHUNK=CHUNK, BLOCK=_BLOCK)
