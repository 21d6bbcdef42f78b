"""FP8 training recipe (`train.precision = "fp8"`): blockwise-scaled e4m3 GEMMs in the blocks.

`apply_fp8(model)` makes every GEMM of the transformer blocks' linear layers (attention
wq/wk/wv/wo, the dense SwiGLU w1/w2/w3, shared experts; plain `nn.Linear` or the tensor-parallel
Column/RowParallelLinear) and of the routed experts (`GroupedExperts`) run in FP8, forward and
backward. The tensor formats, DeepSeek-V3's fine-grained scheme (all e4m3, one scale per 1x128
activation/gradient tile and per 128x128 weight block, fp32 accumulation):

| GEMM                  | operand a (1x128 along the reduction dim) | operand b (128x128 blocks)  |
|-----------------------|-------------------------------------------|-----------------------------|
| forward y = x W^T     | x [M, K], per token                       | W [N, K]                    |
| dgrad dx = dy W       | dy [M, N], per token                      | W^T [K, N]                  |
| wgrad dW = dy^T x     | dy^T [N, M], per output channel           | x^T [K, M] (128 tokens)     |
| experts' wgrad x^T dy | x^T [K, M], per input channel             | dy^T [N, M] (128 tokens)    |

Outputs are bf16 (fp32 accumulation inside). For backward x and W stay bf16 (W is the parameter
itself, so nothing is copied); dgrad quantises W^T in one transposing pass (the forward's
blocks and scales), and dy, dy^T and x^T are quantised along each backward GEMM's own
reduction dim, dy^T and x^T without writing a bf16 transpose. Master
weights stay fp32 in the data-parallel step; embedding, output head, norms, router, softmax,
attention and the loss are untouched (bf16 / fp32). docs/fp8.md says why for each choice.

Routed experts: forward, dgrad and wgrad are one grouped blockwise GEMM each (no host sync).
The weight gradient groups along K (tokens): each expert's tokens start a fresh 128-token scale
block (core/kernels/fp8_wgrad.py). `expert_wgrad="fp8"` (default) runs it, "bf16" the bf16
grouped wgrad kernel instead (`train.fp8_expert_wgrad`, through the precision plan). Gate and
up run as one GEMM on w13's [E, dim, 2 x hidden] view; the hidden size being a multiple of 128,
no weight block or gradient tile straddles the two.

The weight operands come through the model's `Fp8WeightCache` when it has one (several
micro-batches per step): each layer holds the cache and passes its handle to the ops.

Shapes whose features are not multiples of 128 keep their bf16 GEMMs, listed once in the log.
Without the kernel library (CPU, no sm_90) the quantisers and GEMMs run their exact PyTorch
fallbacks: the same FP8 numerics, emulated.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.kernels import fp8 as kfp8
from core.kernels import fp8_wgrad as kwgrad
from core.kernels import grouped_mm_wgrad
from core.kernels.grouped_gemm import grouped_mm_wgrad_into_, main_grad_sink
from core.kernels.library import custom_op, kernel_library, report_once
from core.precision.weight_cache import Fp8WeightCache, cache_of

log = logging.getLogger(__name__)

BLOCK = kfp8.BLOCK
EXPERT_WGRAD_MODES = ("fp8", "bf16")  # train.fp8_expert_wgrad's values
ROW_ALIGN = 16  # the kernels take reduction dims (here: token counts) in multiples of 16


def _pad_rows(t: Tensor, multiple: int = ROW_ALIGN) -> Tensor:
    """Zero rows up to a multiple: zeros change neither a block's amax nor a product's sum."""
    extra = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def _weight_blocks(w: Tensor, transpose: bool, cache: int) -> tuple[Tensor, Tensor]:
    """quantize_128x128(w, transpose), through the weight cache of handle `cache` when there is
    one: then once per optimizer step for the trainer's weights (core/precision/weight_cache.py)."""
    found = cache_of(cache)
    if found is None:
        return kfp8.quantize_128x128(w, transpose)
    return found.quantize(w, transpose, kfp8.quantize_128x128)


def _handle(cache: Fp8WeightCache | None) -> int:
    return cache.handle if cache is not None else 0


def _as_operand(dy: Tensor, dtype: torch.dtype) -> Tensor:
    """A gradient as the kernels take it: dense rows in the activations' dtype (bf16)."""
    return dy.to(dtype).contiguous()


def _note_device(x: Tensor) -> None:
    if not torch.compiler.is_compiling() and kernel_library(x.device) is None:
        report_once(f"fp8 recipe: GEMMs emulated by the PyTorch fallbacks on {x.device.type} "
                    "(same e4m3 quantisation, fp32 matmuls)", logging.INFO)


# ---------------------------------------------------------------------------------------
# The GEMMs of one layer, as plain functions (tests call them directly).
# ---------------------------------------------------------------------------------------

def fp8_matmul_fwd(x: Tensor, qw: Tensor, sw: Tensor) -> Tensor:
    """bf16 x W^T for x [M, K] (quantised here, 1x128) and W [N, K] given as quantize_128x128(W)."""
    qx, sx = kfp8.quantize_1x128(x)
    return kfp8.gemm_blockwise(qx, sx, qw, sw)


def fp8_matmul_dgrad(dy: Tensor, qwt: Tensor, swt: Tensor) -> Tensor:
    """bf16 dy W for dy [M, N] (quantised here, 1x128 along N) and W^T [K, N] quantised
    (`quantize_128x128(W, transpose=True)`: the same 128x128 blocks as the forward's W)."""
    qd, sd = kfp8.quantize_1x128(dy)
    return kfp8.gemm_blockwise(qd, sd, qwt, swt)


def fp8_matmul_wgrad(dy: Tensor, x: Tensor) -> Tensor:
    """bf16 dy^T x [N, K] for dy [M, N], x [M, K]: the reduction runs over the M tokens, so dy^T
    takes 1x128 scales along tokens (per output channel) and x^T 128x128 blocks (128 tokens x
    128 input channels)."""
    dy, x = _pad_rows(dy), _pad_rows(x)
    qd, sd = kfp8.quantize_1x128_t(dy)
    qx, sx = kfp8.quantize_128x128(x, transpose=True)
    return kfp8.gemm_blockwise(qd, sd, qx, sx)


# The layer-level ops are custom ops with registered autograd (not autograd.Functions): on
# CUDA, torch.compile traced an autograd.Function around these opaque kernels with zeros in
# place of its output gradient, so every weight gradient came out 0 (docs/fp8.md).

@custom_op("fp8_linear", differentiable=True)
def _linear(x: Tensor, weight: Tensor, cache: int) -> Tensor:
    """y = x W^T with x [M, K] (2-D), W [N, K]; forward, dgrad and wgrad GEMMs in FP8; `cache`:
    the handle of the model's weight cache (0: none)."""
    _note_device(x)
    # The kernels read dense rows; anything else would take the slow fallback.
    return fp8_matmul_fwd(x.contiguous(), *_weight_blocks(weight, False, cache)).to(x.dtype)


@_linear.register_fake
def _(x, weight, cache):
    return x.new_empty(x.shape[0], weight.shape[0])


@custom_op("fp8_linear_dgrad")
def _linear_dgrad(dy: Tensor, weight: Tensor, cache: int) -> Tensor:
    """dy W: W^T quantised in one transposing pass (the forward's 128x128 blocks and scales)."""
    return fp8_matmul_dgrad(dy, *_weight_blocks(weight, True, cache)).to(dy.dtype)


@_linear_dgrad.register_fake
def _(dy, weight, cache):
    return dy.new_empty(dy.shape[0], weight.shape[1])


@custom_op("fp8_linear_wgrad")
def _linear_wgrad(dy: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    return fp8_matmul_wgrad(dy, x).to(dtype)


@_linear_wgrad.register_fake
def _(dy, x, dtype):
    return x.new_empty(dy.shape[1], x.shape[1], dtype=dtype)


def _save_linear(ctx, inputs, output) -> None:
    x, weight, ctx.cache = inputs
    # W is the parameter itself: saving it costs nothing, unlike an FP8 copy per layer.
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, dy: Tensor):
    x, weight = ctx.saved_tensors
    dy = _as_operand(dy, x.dtype)
    dx = _linear_dgrad(dy, weight, ctx.cache) if ctx.needs_input_grad[0] else None
    dw = _linear_wgrad(dy, x.contiguous(), weight.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_linear.register_autograd(_linear_backward, setup_context=_save_linear)


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, cache: Fp8WeightCache | None = None) -> Tensor:
    """Drop-in for `F.linear` (x [..., K], weight [N, K]) with FP8 GEMMs; the bias is added in
    the output's precision. `cache`: the model's weight cache, where it keeps one."""
    y = _linear(x.reshape(-1, x.shape[-1]), weight, _handle(cache)).view(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class Fp8Matmul:
    """The tensor-parallel layers' `matmul` (an `F.linear`-like callable): fp8_linear with the
    model's weight cache."""

    def __init__(self, cache: Fp8WeightCache | None = None):
        self.cache = cache

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return fp8_linear(x, weight, bias, self.cache)

    def __repr__(self) -> str:
        return f"Fp8Matmul(weight_cache={self.cache is not None})"


# ---------------------------------------------------------------------------------------
# Grouped (MoE expert) GEMMs.
# ---------------------------------------------------------------------------------------

def fp8_grouped_fwd(x: Tensor, qw: Tensor, sw: Tensor, offsets: Tensor) -> Tensor:
    """bf16 [rows, out]: rows of group g times w[g], for experts w [G, in, out] given as
    quantize_128x128(w, transpose=True) ([G, out, in], K-major)."""
    qx, sx = kfp8.quantize_1x128(x, offsets)
    return kfp8.grouped_mm_blockwise(qx, sx, qw, sw, offsets)


def fp8_grouped_dgrad(dy: Tensor, qw: Tensor, sw: Tensor, offsets: Tensor) -> Tensor:
    """bf16 [rows, in]: rows of group g of dy times w[g]^T, with w given as quantize_128x128(w)
    ([G, in, out]: K = out is already the inner dim)."""
    qd, sd = kfp8.quantize_1x128(dy, offsets)
    return kfp8.grouped_mm_blockwise(qd, sd, qw, sw, offsets)


def _grouped_wgrad_operands(x: Tensor, dy: Tensor, offsets: Tensor) -> tuple:
    """(qx, sx, qd, sd, block_starts): x^T 1x128 (per input channel and 128 tokens) and dy^T
    128x128, each expert's tokens on their own 128-token blocks (core/kernels/fp8_wgrad.py)."""
    rows, groups = x.shape[0], offsets.shape[0]
    row_starts, block_starts = kwgrad.group_blocks(offsets, rows)
    blocks = kwgrad.padded_blocks(rows, groups)
    qx, sx = kwgrad.quantize_grouped_t(x, row_starts, block_starts, blocks, True)  # x^T [in, Kp], 1x128
    qd, sd = kwgrad.quantize_grouped_t(dy, row_starts, block_starts, blocks, False)  # dy^T [out, Kp], 128x128
    return qx, sx, qd, sd, block_starts


def fp8_grouped_wgrad(x: Tensor, dy: Tensor, offsets: Tensor, dtype: torch.dtype) -> Tensor:
    """[G, in, out] with entry g = x_g^T dy_g, one K-grouped blockwise FP8 GEMM for all experts,
    each expert's tokens quantised on their own: x^T 1x128 (per input channel and 128 tokens),
    dy^T 128x128, the operand order that yields the experts' stored [in, out] layout (the
    dense layers' wgrad swaps them for the same reason); empty groups get zeros. No host sync."""
    if x.shape[0] == 0:
        return x.new_zeros(offsets.shape[0], x.shape[1], dy.shape[1], dtype=dtype)
    return kwgrad.grouped_wgrad_blockwise(*_grouped_wgrad_operands(x, dy, offsets)).to(dtype)


def fp8_grouped_wgrad_into_(main_grad: Tensor, x: Tensor, dy: Tensor, offsets: Tensor, accumulate: bool) -> None:
    """fp8_grouped_wgrad written into (accumulate: added to) the fp32 `main_grad` [G, in, out] by
    the GEMM itself (gradient-accumulation fusion): no bf16 gradient, no separate fp32 pass."""
    if x.shape[0] == 0:
        if not accumulate:
            main_grad.zero_()
        return
    kwgrad.grouped_wgrad_blockwise_into_(main_grad, *_grouped_wgrad_operands(x, dy, offsets), accumulate)


@custom_op("fp8_grouped_mm", differentiable=True)
def _grouped(x: Tensor, w: Tensor, offsets: Tensor, expert_wgrad: str, cache: int) -> Tensor:
    """Rows of group g times w[g] for experts w [G, in, out]; all three GEMMs in FP8 (the
    weight gradient as `expert_wgrad` says); `cache`: the weight cache's handle (0: none)."""
    _note_device(x)
    return fp8_grouped_fwd(x.contiguous(), *_weight_blocks(w, True, cache), offsets).to(x.dtype)


@_grouped.register_fake
def _(x, w, offsets, expert_wgrad, cache):
    return x.new_empty(x.shape[0], w.shape[2])


@custom_op("fp8_grouped_dgrad")
def _grouped_dgrad(dy: Tensor, w: Tensor, offsets: Tensor, cache: int) -> Tensor:
    return fp8_grouped_dgrad(dy, *_weight_blocks(w, False, cache), offsets).to(dy.dtype)


@_grouped_dgrad.register_fake
def _(dy, w, offsets, cache):
    return dy.new_empty(dy.shape[0], w.shape[1])


@custom_op("fp8_grouped_wgrad")
def _grouped_wgrad(x: Tensor, dy: Tensor, offsets: Tensor, dtype: torch.dtype) -> Tensor:
    # One op for compiled graphs: without the library its fallbacks read the bounds on the host.
    return fp8_grouped_wgrad(x, dy, offsets, dtype)


@_grouped_wgrad.register_fake
def _(x, dy, offsets, dtype):
    return x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1], dtype=dtype)


def _save_grouped(ctx, inputs, output) -> None:
    x, w, offsets, ctx.expert_wgrad, ctx.cache = inputs
    ctx.save_for_backward(x, w, offsets)
    # Data parallelism's fp32 main grad of the expert weight (w13 comes as a view), when the
    # wgrad may write it itself.
    ctx.sink = main_grad_sink(w)


def _grouped_backward(ctx, dy: Tensor):
    x, w, offsets = ctx.saved_tensors
    dy = _as_operand(dy, x.dtype)
    dx = _grouped_dgrad(dy, w, offsets, ctx.cache) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:
        x = x.contiguous()
        if ctx.sink is not None:  # gradient-accumulation fusion: the GEMM writes the fp32 main grad
            if ctx.expert_wgrad == "fp8":
                ctx.sink.write(lambda main_grad, accumulate: fp8_grouped_wgrad_into_(main_grad, x, dy, offsets,
                                                                                    accumulate))
            else:
                xb, dyb = x.to(torch.bfloat16), dy.to(torch.bfloat16)
                ctx.sink.write(lambda main_grad, accumulate: grouped_mm_wgrad_into_(main_grad, xb, dyb, offsets,
                                                                                   accumulate))
            dw = ctx.sink.stand_in()
        elif ctx.expert_wgrad == "fp8":
            dw = _grouped_wgrad(x, dy, offsets, w.dtype)
        else:
            dw = grouped_mm_wgrad(x.to(torch.bfloat16), dy.to(torch.bfloat16), offsets).to(w.dtype)
    return dx, dw, None, None, None


_grouped.register_autograd(_grouped_backward, setup_context=_save_grouped)


class Fp8GroupedMM:
    """`GroupedExperts.mm` replacement: expert_mm(x, w, offsets) with FP8 GEMMs, the weights
    through the model's weight cache where it keeps one."""

    def __init__(self, expert_wgrad: str = "fp8", cache: Fp8WeightCache | None = None):
        if expert_wgrad not in EXPERT_WGRAD_MODES:
            raise ValueError(f"expert_wgrad={expert_wgrad!r} must be one of {EXPERT_WGRAD_MODES}")
        self.expert_wgrad, self.cache = expert_wgrad, cache

    def __call__(self, x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
        return _grouped(x, w, offsets, self.expert_wgrad, _handle(self.cache))

    def __repr__(self) -> str:
        return f"Fp8GroupedMM(expert_wgrad={self.expert_wgrad!r}, weight_cache={self.cache is not None})"


# ---------------------------------------------------------------------------------------
# Applying the recipe to a model.
# ---------------------------------------------------------------------------------------

class Fp8Linear(nn.Linear):
    """`nn.Linear` with FP8 GEMMs; it holds the original parameters, so names are unchanged, and
    the model's weight cache (None: none)."""

    weight_cache: Fp8WeightCache | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, cache: Fp8WeightCache | None = None) -> "Fp8Linear":
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias, new.weight_cache = linear.weight, linear.bias, cache
        return new

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, self.weight_cache)


def fits_blocks(*dims: int) -> bool:
    return all(d % BLOCK == 0 for d in dims)
