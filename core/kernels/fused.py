"""Memory-bound passes fused into one Triton kernel each on CUDA.

- `accumulate_fp32_(dst, src, copy)`: dst (fp32) += src (bf16/fp16), or dst = src. PyTorch's
  mixed-dtype `add_` takes a non-vectorised kernel (2.4 TB/s on an H100, where a plain copy
  reaches 3.0); the fp32 main grads of a 2.2B-parameter MoE spent 66 ms of a 640 ms step in it.
- `gather_weighted_sum(rows, inverse, weights)`: out[t] = sum_j weights[t, j] * rows[inverse[t, j]]
  (`inverse_of` the assignments' order; missing rows, -1, count as zero), accumulated in fp32. The MoE combine: without
  fusion it is a gather of every routed row into [T, k, dim] and a batched GEMV over k, whose
  cuBLAS kernel ran at ~1 TB/s. Autograd included; its backward writes both gradients in one
  pass per token. `gather_sum(rows, inverse, None)` is the plain sum (the backward of the token
  permutation), `permute_rows(x, inverse, n)` the permutation itself (each token read once and
  written to its k rows, where a gather by row reads it k times). `unpermute_sum(rows, inverse)`
  is the unweighted combine with autograd (its backward is `permute_rows` of the gradient).

- `swiglu(a, b)`: silu(a) * b, forward in one pass and backward in one (reads a, b and the
  output's gradient, writes both input gradients), saving only a and b. Eager PyTorch runs it as
  silu, mul, and in the backward two muls and silu_backward, each a pass over [rows, hidden]
  (1.7 ms of a 17.6 ms fine-grained E=64 MoE layer on an H100).
- `swiglu_fused(h13)`: the same on the routed experts' fused gate/up GEMM output [rows, 2H] (gate
  in the first H columns of each row, up in the last H): forward writes [rows, H], backward ONE
  [rows, 2H] gradient (gate part first), so the GEMM's backward is one dgrad GEMM of K = 2H with no
  add of two input gradients, and one wgrad GEMM. The experts run it eagerly.
  `swiglu_fused(h13, weights)` also scales each row by its routing weight: the weight moves from
  the combine to before the (linear) down projection, so the combine's backward needs no pass
  over the expert outputs for the weights' gradient; it comes from the SwiGLU's backward, which
  reads the row's inputs anyway (one program per row, a fixed-order dot product).

Offsets: every address that can pass 2^31 - 1 elements (a [T, hidden] tensor at a million tokens
holds ~1e10) is computed in int64: the program id is widened before it multiplies a row size, and
row numbers read from `inverse` are widened whatever its dtype (an int32 `inverse` is fine).
Column offsets inside a row stay int32. tests/test_kernel_offsets.py checks it past 2^31 in the
interpreter (on tensors mostly never touched, so the host commits only the rows read).

Triton is used when it imports and the tensors are on CUDA (`TESSERA_TRITON=0` turns it off).
`accumulate_fp32_` falls back to PyTorch itself; for the combine the callers (moe.dispatcher)
keep their PyTorch path and ask `triton_enabled` first. TRITON_INTERPRET=1 runs the kernels on CPU
tensors (tests/test_fused_kernels.py).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: triton_enabled() is False, callers take PyTorch ops
    triton = None

_ROW_BLOCK = 1024  # elements of a row per program: 2 KB of bf16, 16-byte loads per thread
_FLAT_BLOCK = 4096


def matmul_into_(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (fp32) = [out +] a @ b, with a, b in a 16-bit dtype: on a GPU one GEMM whose epilogue
    adds in fp32 (Megatron's gradient-accumulation fusion), no 16-bit product in between."""
    if out.is_cuda and a.dtype != out.dtype:
        torch.addmm(out, a, b, out_dtype=out.dtype, beta=1 if accumulate else 0, out=out)
    elif accumulate:
        out.add_(torch.mm(a, b).to(out.dtype))
    else:
        out.copy_(torch.mm(a, b))


def _add_weight_grad(main_grad: Tensor, grad_out: Tensor, inputs: Tensor) -> None:
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    matmul_into_(main_grad, dy.t(), inputs.reshape(-1, inputs.shape[-1]), accumulate=True)


# A library op, not `torch.library.custom_op` (whose Python wrapper costs the host ~60 us a call
# against 23 on a CPU core), and not traced inside: in a compiled backward the graph calls it in
# place on the main grad, where a traced `add_` on a parameter's attribute became a functional
# copy of the whole fp32 main grad per chunk of a tiled MLP (out of memory at 8B).
_LIB = torch.library.Library("tessera", "FRAGMENT")
_LIB.define("add_weight_grad_(Tensor(a!) main_grad, Tensor grad_out, Tensor inputs) -> ()")
_LIB.impl("add_weight_grad_", _add_weight_grad, "CompositeExplicitAutograd")
torch.library.register_fake("tessera::add_weight_grad_", lambda main_grad, grad_out, inputs: None, lib=_LIB)
#: main_grad += grad_out^T @ inputs over all leading dims, accumulated in fp32 (backward only).
add_weight_grad_ = torch.ops.tessera.add_weight_grad_.default


def triton_enabled(t: Tensor) -> bool:
    return triton is not None and os.environ.get("TESSERA_TRITON", "1") != "0" and (
        t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _accumulate_kernel(dst, src, n, COPY: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        value = tl.load(src + offs, mask=mask).to(tl.float32)
        if not COPY:
            value += tl.load(dst + offs, mask=mask)
        tl.store(dst + offs, value, mask=mask)

    @triton.jit
    def _swiglu_kernel(a, b, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(a + offs, mask=mask).to(tl.float32)
        y = tl.load(b + offs, mask=mask).to(tl.float32)
        tl.store(out + offs, (x * tl.sigmoid(x) * y).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(a, b, grad, grad_a, grad_b, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(a + offs, mask=mask).to(tl.float32)
        y = tl.load(b + offs, mask=mask).to(tl.float32)
        g = tl.load(grad + offs, mask=mask).to(tl.float32)
        sig = tl.sigmoid(x)
        silu = x * sig
        tl.store(grad_b + offs, (g * silu).to(grad_b.dtype.element_ty), mask=mask)
        tl.store(grad_a + offs, (g * y * (sig + silu * (1.0 - sig))).to(grad_a.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_fused_kernel(h13, weights, out, hidden_vecs, VEC: tl.constexpr, BLOCK: tl.constexpr,
                             WEIGHTED: tl.constexpr):
        # One row's column block: gate = h13[row, :H], up = h13[row, H:], out [rows, H], times
        # the row's weight when WEIGHTED. H is passed as hidden_vecs * VEC so the compiler knows
        # every row and half starts on a VEC-element boundary and issues 16-byte loads (VEC = 8
        # for bf16).
        hidden = hidden_vecs * VEC
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        gate_ptr = h13 + row * 2 * hidden + cols
        x = tl.load(gate_ptr, mask=mask).to(tl.float32)
        y = tl.load(gate_ptr + hidden, mask=mask).to(tl.float32)
        value = x * tl.sigmoid(x) * y
        if WEIGHTED:
            value *= tl.load(weights + row).to(tl.float32)
        tl.store(out + row * hidden + cols, value.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_fused_backward_kernel(h13, grad, grad13, hidden_vecs, VEC: tl.constexpr, BLOCK: tl.constexpr):
        hidden = hidden_vecs * VEC
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        pair = row * 2 * hidden + cols
        x = tl.load(h13 + pair, mask=mask).to(tl.float32)
        y = tl.load(h13 + pair + hidden, mask=mask).to(tl.float32)
        g = tl.load(grad + row * hidden + cols, mask=mask).to(tl.float32)
        sig = tl.sigmoid(x)
        silu = x * sig
        tl.store(grad13 + pair, (g * y * (sig + silu * (1.0 - sig))).to(grad13.dtype.element_ty), mask=mask)
        tl.store(grad13 + pair + hidden, (g * silu).to(grad13.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_weighted_backward_kernel(h13, weights, grad, grad13, grad_weights, hidden_vecs, VEC: tl.constexpr,
                                         BLOCK: tl.constexpr):
        # One row per program, its columns in blocks: the weight's gradient is the row's dot
        # product <grad, silu(gate) * up> (fp32), summed in one fixed order.
        hidden = hidden_vecs * VEC
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(weights + row).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < hidden
            pair = row * 2 * hidden + cols
            x = tl.load(h13 + pair, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(h13 + pair + hidden, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(grad + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(x)
            silu = x * sig
            acc += g * silu * y
            g *= w
            tl.store(grad13 + pair, (g * y * (sig + silu * (1.0 - sig))).to(grad13.dtype.element_ty), mask=mask)
            tl.store(grad13 + pair + hidden, (g * silu).to(grad13.dtype.element_ty), mask=mask)
        tl.store(grad_weights + row, tl.sum(acc))

    @triton.jit
    def _gather_sum_kernel(rows, inverse, weights, out, dim, K: tl.constexpr, WEIGHTED: tl.constexpr,
                           BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < dim
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(inverse + t * K + j).to(tl.int64)  # row * dim may pass 2^31 (module doc)
            v = tl.load(rows + tl.maximum(r, 0) * dim + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.where(r >= 0, v, 0.0)  # a missing row (dropped assignment) adds nothing
            if WEIGHTED:
                v *= tl.load(weights + t * K + j).to(tl.float32)
            acc += v
        tl.store(out + t * dim + offs, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _permute_rows_kernel(x, inverse, rows, dim, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        # rows[inverse[t, j]] = x[t] for each of token t's k assignments that has a row (>= 0):
        # the token's row read once for all of its copies.
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < dim
        j = tl.arange(0, KP)
        r = tl.load(inverse + t * K + j, mask=j < K, other=-1).to(tl.int64)
        v = tl.load(x + t * dim + offs, mask=mask)
        where = tl.maximum(r, 0)[:, None] * dim + offs[None, :]
        tl.store(rows + where, tl.broadcast_to(v[None, :], (KP, BLOCK)), mask=(r >= 0)[:, None] & mask[None, :])

    @triton.jit
    def _combine_backward_kernel(grad, rows, inverse, weights, grad_rows, grad_weights, dim, K: tl.constexpr,
                                 KP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, WEIGHTS: tl.constexpr):
        # One token per program, its output gradient read once for all of its k assignments:
        # grad_rows[r] = weights[t, j] * grad[t] and grad_weights[t, j] = <rows[r], grad[t]> (fp32),
        # r = inverse[t, j]; a missing row (-1) gets nothing and a zero weight gradient.
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        valid = j < K
        r = tl.load(inverse + t * K + j, mask=valid, other=-1).to(tl.int64)
        present = r >= 0
        row_start = tl.maximum(r, 0) * dim
        w = tl.load(weights + t * K + j, mask=valid, other=0.0).to(tl.float32)
        acc = tl.zeros([KP, BLOCK], dtype=tl.float32)
        for start in range(0, dim, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < dim
            g = tl.load(grad + t * dim + offs, mask=mask, other=0.0).to(tl.float32)
            where = row_start[:, None] + offs[None, :]
            both = present[:, None] & mask[None, :]
            if ROWS:
                tl.store(grad_rows + where, (w[:, None] * g[None, :]).to(grad_rows.dtype.element_ty), mask=both)
            if WEIGHTS:
                v = tl.load(rows + where, mask=both, other=0.0).to(tl.float32)
                acc += v * g[None, :]
        if WEIGHTS:
            tl.store(grad_weights + t * K + j, tl.sum(acc, axis=1), mask=valid)


def _launch(kernel, grid, *args, remedy: str = "TESSERA_TRITON=0 runs the PyTorch ops instead", **meta) -> None:
    """kernel[grid](*args, **meta), with a failure (a Triton that cannot compile or launch on this
    machine) said in terms of what to do about it (`remedy`)."""
    try:
        kernel[grid](*args, **meta)
    except Exception as exc:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        raise RuntimeError(f"Triton kernel {name} failed ({type(exc).__name__}: {exc}); {remedy}") from exc


def accumulate_fp32_(dst: Tensor, src: Tensor, copy: bool) -> None:
    """dst = src (copy) or dst += src, dst fp32; one vectorised pass when fused."""
    fused = (triton_enabled(src) and src.dtype in (torch.bfloat16, torch.float16) and dst.dtype == torch.float32
             and src.is_contiguous() and dst.is_contiguous() and src.shape == dst.shape)
    if not fused:
        dst.copy_(src) if copy else dst.add_(src)
        return
    n = src.numel()
    if n:
        _launch(_accumulate_kernel, (triton.cdiv(n, _FLAT_BLOCK),), dst, src, n, COPY=copy, BLOCK=_FLAT_BLOCK,
                num_warps=4)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        out = torch.empty_like(a)
        if a.numel():
            _launch(_swiglu_kernel, (triton.cdiv(a.numel(), _FLAT_BLOCK),), a, b, out, a.numel(), BLOCK=_FLAT_BLOCK,
                    num_warps=4)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
        if a.numel():
            _launch(_swiglu_backward_kernel, (triton.cdiv(a.numel(), _FLAT_BLOCK),), a, b, grad, grad_a, grad_b,
                    a.numel(), BLOCK=_FLAT_BLOCK, num_warps=4)
        return grad_a, grad_b


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b in a's dtype, fp32 inside (Triton; a and b of one shape and dtype, see the
    module doc). Needs `triton_enabled(a)`."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"swiglu needs a and b of one shape and dtype, got {list(a.shape)} {a.dtype} and "
                         f"{list(b.shape)} {b.dtype}")
    return _SwiGLU.apply(a, b)


def _row_vectors(hidden: int) -> int:
    """VEC of the fused SwiGLU kernels: 8 elements (16 bytes of bf16) when the hidden size allows."""
    return 8 if hidden % 8 == 0 else 1


class _SwiGLUFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h13, weights):
        h13 = h13.contiguous()
        ctx.save_for_backward(h13, weights)
        rows, hidden = h13.shape[0], h13.shape[1] // 2
        out = h13.new_empty(rows, hidden)
        if out.numel():
            vec = _row_vectors(hidden)
            _launch(_swiglu_fused_kernel, (rows, triton.cdiv(hidden, _ROW_BLOCK)), h13,
                    weights if weights is not None else h13, out, hidden // vec, VEC=vec, BLOCK=_ROW_BLOCK,
                    WEIGHTED=weights is not None, num_warps=4)
        return out

    @staticmethod
    def backward(ctx, grad):
        h13, weights = ctx.saved_tensors
        grad = grad.contiguous()
        rows, hidden = grad.shape
        grad13 = torch.empty_like(h13)  # one tensor: the GEMM's backward takes it whole
        grad_weights = None
        if weights is not None:
            grad_weights = torch.empty(rows, dtype=torch.float32, device=grad.device)
        if grad.numel():
            vec = _row_vectors(hidden)
            if weights is None:
                _launch(_swiglu_fused_backward_kernel, (rows, triton.cdiv(hidden, _ROW_BLOCK)), h13, grad, grad13,
                        hidden // vec, VEC=vec, BLOCK=_ROW_BLOCK, num_warps=4)
            else:
                block = min(2 * _ROW_BLOCK, triton.next_power_of_2(hidden))
                _launch(_swiglu_weighted_backward_kernel, (rows,), h13, weights, grad, grad13, grad_weights,
                        hidden // vec, VEC=vec, BLOCK=block, num_warps=8 if block > _ROW_BLOCK else 4)
        elif grad_weights is not None:
            grad_weights.zero_()
        if grad_weights is not None:
            grad_weights = grad_weights.to(weights.dtype)
        return grad13, grad_weights


def swiglu_fused(h13: Tensor, weights: Tensor | None = None) -> Tensor:
    """silu(gate) * up for h13 [rows, 2H] holding gate in columns [0, H) and up in [H, 2H), times
    weights[row] when given ([rows]: the MoE routing weight of each row, applied before the down
    projection), in h13's dtype, fp32 inside (Triton; see the module doc). Needs
    `triton_enabled(h13)`."""
    if h13.dim() != 2 or h13.shape[1] % 2:
        raise ValueError(f"swiglu_fused needs h13 [rows, 2 x hidden], got {list(h13.shape)}")
    if weights is not None and tuple(weights.shape) != (h13.shape[0],):
        raise ValueError(f"swiglu_fused needs one weight per row ({h13.shape[0]}), got {list(weights.shape)}")
    return _SwiGLUFused.apply(h13, weights.contiguous() if weights is not None else None)


def inverse_of(order: Tensor, slots: int) -> Tensor:
    """[slots] int64: the position of each slot in `order`, -1 for slots `order` leaves out."""
    inverse = torch.full((slots,), -1, dtype=torch.int64, device=order.device)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def permute_rows(x: Tensor, inverse: Tensor, num_rows: int) -> Tensor:
    """[num_rows, dim] with rows[inverse[t, j]] = x[t] (inverse [T, k], -1 for no row): the MoE
    dispatch's copy of each token to its k assignments' rows, each token's row read once."""
    t, k = inverse.shape
    dim = x.shape[1]
    rows = x.new_empty(num_rows, dim)
    if t and dim and num_rows:
        kp = triton.next_power_of_2(k)
        block = max(128, min(_ROW_BLOCK, 4096 // kp))
        _launch(_permute_rows_kernel, (t, triton.cdiv(dim, block)), x.contiguous(), inverse, rows, dim, K=k, KP=kp,
                BLOCK=block, num_warps=4)
    return rows


def gather_sum(rows: Tensor, inverse: Tensor, weights: Tensor | None) -> Tensor:
    """[T, dim] = sum over j of weights[t, j] * rows[inverse[t, j]] (Triton; see the module doc)."""
    t, k = inverse.shape
    dim = rows.shape[1]
    out = rows.new_empty(t, dim)
    if t and dim:
        grid = (t, triton.cdiv(dim, _ROW_BLOCK))
        _launch(_gather_sum_kernel, grid, rows, inverse, weights if weights is not None else inverse, out, dim, K=k,
                WEIGHTED=weights is not None, BLOCK=_ROW_BLOCK, num_warps=4)
    return out


class _GatherSum(torch.autograd.Function):
    """gather_sum(rows, inverse, None) with autograd: its backward copies each token's gradient
    to its k rows (permute_rows), reading the gradient once and no rows at all."""

    @staticmethod
    def forward(ctx, rows, inverse):
        ctx.save_for_backward(inverse)
        ctx.num_rows = rows.shape[0]
        return gather_sum(rows.contiguous(), inverse, None)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return permute_rows(grad.contiguous(), inverse, ctx.num_rows), None


def unpermute_sum(rows: Tensor, inverse: Tensor) -> Tensor:
    """[T, dim]: sum over j of rows[inverse[t, j]] (-1, a missing row, counts as zero): the MoE
    combine when the routing weights were applied in the experts. fp32 accumulation, autograd
    for rows. Needs `triton_enabled(rows)`."""
    return _GatherSum.apply(rows, inverse)


class _GatherWeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, inverse, weights):
        rows = rows.contiguous()
        ctx.save_for_backward(rows, inverse, weights)
        return gather_sum(rows, inverse, weights)

    @staticmethod
    def backward(ctx, grad):
        rows, inverse, weights = ctx.saved_tensors
        grad = grad.contiguous()
        t, k = inverse.shape
        dim = rows.shape[1]
        want_rows, want_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_rows = torch.empty_like(rows) if want_rows else None
        grad_weights = torch.empty(t, k, dtype=torch.float32, device=grad.device) if want_weights else None
        if t and (want_rows or want_weights):
            kp = triton.next_power_of_2(k)
            # Both gradients in one pass over the tokens: each token's gradient row read once.
            _launch(_combine_backward_kernel, (t,), grad, rows, inverse, weights,
                    grad_rows if want_rows else rows, grad_weights if want_weights else weights, dim, K=k, KP=kp,
                    BLOCK=max(128, min(_ROW_BLOCK, 2048 // kp)), ROWS=want_rows, WEIGHTS=want_weights, num_warps=4)
        if want_weights:
            grad_weights = grad_weights.to(weights.dtype)
        return grad_rows, None, grad_weights


def gather_weighted_sum(rows: Tensor, inverse: Tensor, weights: Tensor) -> Tensor:
    """[T, dim]: sum over j of weights[t, j] * rows[inverse[t, j]] (inverse [T, k] from `inverse_of`
    the assignments' order; -1, a missing row, counts as zero). fp32 accumulation, the result in
    rows' dtype; autograd for rows and weights. Needs `triton_enabled(rows)`."""
    return _GatherWeightedSum.apply(rows, inverse, weights.contiguous())
