"""Transformer Engine's fused norm + projection modules over the model's own parameters.

With `model.dense_backend = "te"` and `model.te_norm_fusion`, each block's attention norm and
q/k/v projections run as one `te.LayerNormLinear`, and a dense block's FFN norm, w1/w3, SwiGLU
and w2 as one `te.LayerNormMLP`: the norm writes the GEMM's (FP8) operand itself, the input is
quantised once for q, k and v, and a block makes three TE calls instead of seven.

TE's modules take one weight per GEMM ([wq; wk; wv], [w1; w3]); the model keeps its separate
parameters, names and shapes (checkpoints, ZeRO, the optimizer and interop see the torch
backend's model). The parameters of one joined weight share one storage, back to back
(`join_storage`, redone whenever something gave a parameter new storage, such as data
parallelism's cast), so the joined weight is a view made per call (`_JoinedRows`), not a copy.
Their fp32 main grads are adjacent too (data parallelism lays out `joined_params` groups in
order), so TE's fused weight-gradient accumulation adds into them through one view.

The norm's module stays in the tree, holding its weight under its own name, and passes its input
through (`NormInNextLayer`); TE's module is kept outside the tree, as in core.precision.te_backend.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from core.eager import eager_only

JOINED_ATTR = "joined_params"  # on each member: the tuple of parameters joined, in order


def _adjacent(tensors) -> bool:
    """Whether the 2-D row-major tensors lie back to back in one storage, in order."""
    first = tensors[0]
    if any(t.dim() != 2 or not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
           or t.shape[1] != first.shape[1] for t in tensors):
        return False
    if first.untyped_storage().data_ptr() != tensors[-1].untyped_storage().data_ptr():
        return False
    ptr = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != ptr:
            return False
        ptr += t.numel() * t.element_size()
    return True


def _rows_view(tensors) -> torch.Tensor:
    """The adjacent `tensors` as one [sum of rows, cols] view."""
    first = tensors[0]
    return first.as_strided((sum(t.shape[0] for t in tensors), first.shape[1]), first.stride())


@torch.no_grad()
def join_storage(params) -> None:
    """Move `params` (2-D, same width) into one storage, back to back, keeping the Parameter objects."""
    if _adjacent(params):
        return
    joined = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = joined[start:start + p.shape[0]]
        start += p.shape[0]


class _JoinedRows(torch.autograd.Function):
    """[p0; p1; ...] over the parameters' shared storage; the backward hands each its rows of the
    gradient, or, where TE added the gradient into the joined main grad itself, marks each
    parameter's main grad as written (Megatron's `grad_added_to_main_grad`) with a stand-in."""

    @staticmethod
    def forward(ctx, *params):
        ctx.sizes = [p.shape[0] for p in params]
        ctx.params = params
        joined = _rows_view([p.data for p in params])
        ctx.joined = joined  # what TE flags; dropped in the backward
        return joined

    @staticmethod
    def backward(ctx, grad):
        joined, params = ctx.joined, ctx.params
        del ctx.joined, ctx.params
        if getattr(joined, "grad_added_to_main_grad", False):
            copy_back = getattr(joined, "main_grad_copy_back", None)
            if copy_back is not None:
                copy_back()
            for p in params:
                p.grad_added_to_main_grad = True
            stand_in = grad.new_zeros(())
            return tuple(stand_in.expand(p.shape) for p in params)
        return tuple(grad.split(ctx.sizes))


def joined_weight(params, fuse_wgrad: bool) -> torch.Tensor:
    """The parameters as one weight for a TE module, with `.main_grad` where `fuse_wgrad`."""
    join_storage(params)
    joined = _JoinedRows.apply(*params)
    if fuse_wgrad:
        joined.grad_added_to_main_grad = False  # TE flags (and skips returning a gradient) only where this is set
        grads = [p.main_grad for p in params]
        if _adjacent(grads):
            joined.main_grad = _rows_view(grads)
        else:  # not laid out by data parallelism: accumulate into a joined copy, then back
            joined.main_grad = torch.cat(grads)

            def copy_back(grads=grads, buffer=joined.main_grad):
                for g, rows in zip(grads, buffer.split([g.shape[0] for g in grads])):
                    g.copy_(rows)
            joined.main_grad_copy_back = copy_back
    return joined


def mark_joined(params) -> None:
    """Tell data parallelism to lay these parameters' main grads out back to back, in order."""
    group = tuple(params)
    for p in group:
        setattr(p, JOINED_ATTR, group)


class NormInNextLayer(nn.Module):
    """An RMSNorm whose work moved into the following TE module: keeps its weight and name,
    passes its input through."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return "applied by the next Transformer Engine module"


FP8_ALIGN = 16  # TE's FP8 GEMMs take both dims of an operand in multiples of 16


class WeightVersion:
    """One model's count of optimizer steps (bumped by data parallelism's `on_new_weights`): a
    TE call's first after a new step is its first micro-batch, where TE quantises the weight
    and keeps it for the rest. The model's TE calls share it; core.train.parallelize makes it
    when the precision plan keeps FP8 weights for a step."""

    def __init__(self):
        self.version = 0

    def bump(self) -> None:
        self.version += 1


class TeCall:
    """Runs a TE module on [rows, features] inputs: inside the model's autocast, or its own where
    there is none (recomputation in the backward); rows padded to FP8's alignment (zero rows
    change neither an amax nor a product); `is_first_microbatch` from the model's `weights`
    (a WeightVersion; None: TE quantises the weights on every call), so a step's first
    micro-batch quantises the weights and TE keeps them for the others."""

    def __init__(self, te, module: nn.Module, recipe, weights: WeightVersion | None = None):
        self.module, self.recipe, self.weights = module, recipe, weights
        self.autocast = functools.partial(te.autocast, enabled=True, recipe=recipe)
        self.fp8_enabled = te.quantization.FP8GlobalStateManager.is_fp8_enabled
        self.seen = -1  # the weight version of the last call

    def _first_microbatch(self) -> bool | None:
        if self.recipe is None or self.weights is None:
            return None
        version = self.weights.version
        first, self.seen = self.seen != version, version
        return first

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [..., features] -> [..., out features]."""
        flat = x.reshape(-1, x.shape[-1])
        pad = -flat.shape[0] % FP8_ALIGN if self.recipe is not None else 0
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        first = self._first_microbatch()
        if self.recipe is not None and not self.fp8_enabled():
            with self.autocast():
                y = self.module(flat, is_first_microbatch=first)
        else:
            y = self.module(flat, is_first_microbatch=first)
        if pad:
            y = y[: flat.shape[0] - pad]
        return y.view(*x.shape[:-1], y.shape[-1])


class TeNormQKV:
    """attention_norm + wq, wk, wv as one te.LayerNormLinear; returns (q, k, v) [..., heads * head_dim]."""

    def __init__(self, te, norm: nn.Module, wq: nn.Linear, wk: nn.Linear, wv: nn.Linear, recipe, fuse_wgrad: bool,
                 weights: WeightVersion | None = None):
        projections = (wq, wk, wv)
        self.sizes = [m.out_features for m in projections]
        module = te.LayerNormLinear(wq.in_features, sum(self.sizes), eps=norm.eps, bias=False, normalization="RMSNorm",
                                    params_dtype=wq.weight.dtype, device="meta", fuse_wgrad_accumulation=fuse_wgrad)
        module.layer_norm_weight = norm.weight
        module.weight = None  # TE's own placeholder: its dtype would not follow data parallelism's cast
        # read per call: a parameter the model swapped in (a load by assignment) is the one used
        module._get_weight_tensors = lambda: [joined_weight([m.weight for m in projections], fuse_wgrad)]
        self.call = TeCall(te, module, recipe, weights)
        mark_joined([m.weight for m in projections])

    @eager_only
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.call(x).split(self.sizes, dim=-1)

    def __repr__(self) -> str:
        return f"TeNormQKV(te.LayerNormLinear, out={self.sizes})"


class TeNormMLP:
    """ffn_norm + the SwiGLU FFN w2(silu(w1 x) * w3 x) as one te.LayerNormMLP."""

    def __init__(self, te, norm: nn.Module, w1: nn.Linear, w3: nn.Linear, w2: nn.Linear, recipe, fuse_wgrad: bool,
                 weights: WeightVersion | None = None):
        module = te.LayerNormMLP(w1.in_features, w1.out_features, eps=norm.eps, bias=False, normalization="RMSNorm",
                                 activation="swiglu", params_dtype=w1.weight.dtype, device="meta",
                                 fuse_wgrad_accumulation=fuse_wgrad)
        module.layer_norm_weight, module.fc1_weight, module.fc2_weight = norm.weight, None, w2.weight
        module._get_weight_tensors = lambda: [joined_weight((w1.weight, w3.weight), fuse_wgrad), w2.weight]
        self.call = TeCall(te, module, recipe, weights)
        mark_joined((w1.weight, w3.weight))

    @eager_only
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)

    def __repr__(self) -> str:
        return "TeNormMLP(te.LayerNormMLP, swiglu)"
