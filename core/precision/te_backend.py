"""Transformer Engine as the GEMM backend of the blocks' linear layers (`model.dense_backend = "te"`).

`apply_te(model, fp8_recipe, fuse_wgrad, norm_fusion)` joins each block's attention norm with
q/k/v (`te.LayerNormLinear`) and a dense block's FFN norm with its FFN (`te.LayerNormMLP`) where
the block allows (core.precision.te_fused; `model.te_norm_fusion`), swaps the block's other `nn.Linear` for
a `TeLinear` and gives the tensor-parallel Column/RowParallelLinear a `TeMatmul`; their GEMMs
(forward, dgrad, wgrad) then run through Transformer Engine, in bf16 or with one of TE's FP8
recipes. What stays Tessera's:

- the parameters: TE's module is handed the very `nn.Parameter` the model registers under the
  same name and shape, and is kept outside the module tree, so state dicts, checkpoints, ZeRO
  and the optimizer see what the "torch" backend has; checkpoints move between the backends
  unchanged. Not saved: the delayed recipe's amax history (a resumed run rebuilds it);
- tensor and sequence parallelism: Tessera's collectives around the local GEMM;
- the routed experts (Tessera's grouped kernels; blockwise FP8 whatever the dense recipe) and
  everything that is not a block's linear layer.

In FP8 the model's whole forward runs in one TE autocast (`forward_in_autocast`); a call outside
any (recomputation in the backward) enters its own, so it quantises like the forward. A step's
first micro-batch quantises each weight and TE keeps it for the others (the model's
`te_fused.WeightVersion`, with `train.fp8_weight_cache`). The calls stay out of torch.compile graphs; the blocks' graphs keep
the norms, rotary and SwiGLU around them.

FP8 recipes (`train.fp8_recipe`): "tensorwise" is TE's current scaling, "delayed" its delayed
scaling (amax history per tensor, not reduced across ranks: each rank's scales are its own,
which costs no collective per layer), "blockwise" its 1x128 / 128x128 block scaling, the
scheme of Tessera's own kernels.

Gradient-accumulation fusion: TE's wgrad GEMM adds into the parameter's fp32 `main_grad`
(Megatron's protocol: `main_grad`, `grad_added_to_main_grad`), which core.parallel.data serves
for parameters tagged by `mark_accumulates_main_grad`.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib
import importlib.util
import logging
import os

import torch
from torch import nn

from core.eager import eager_only
from core.layers import Attention, FeedForward, RMSNorm, model_blocks
from core.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from core.precision.te_fused import FP8_ALIGN, NormInNextLayer, TeCall, TeNormMLP, TeNormQKV, WeightVersion

log = logging.getLogger(__name__)

TE_FP8_RECIPES = ("blockwise", "tensorwise", "delayed")  # train.fp8_recipe with model.dense_backend = "te"


def prefer_torch_cudnn() -> None:
    """Point Transformer Engine at the cuDNN torch loads. TE looks in CUDNN_HOME, CUDNN_PATH,
    CUDA_HOME, /usr/local/cuda and the system loader before torch's pip copy (nvidia.cudnn);
    two different cuDNNs in one process fail at import (undefined symbols between their
    libraries, seen with a system cuDNN beside torch's). A path the user set is kept."""
    if os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except ModuleNotFoundError:  # no `nvidia` namespace package: torch uses a system cuDNN too
        return
    if spec is None or not spec.submodule_search_locations:
        return
    folder = next(iter(spec.submodule_search_locations))
    os.environ["CUDNN_PATH"] = folder
    # cuDNN's front library opens its sub-libraries (cnn, ops, ...) by name when first needed,
    # which finds the system's where torch has not loaded its own yet: load them all now.
    for lib in sorted(glob.glob(os.path.join(folder, "lib", "libcudnn*.so*"))):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


@functools.cache
def _import_te():
    """(transformer_engine.pytorch, transformer_engine.common.recipe) or the reason they fail."""
    try:
        prefer_torch_cudnn()
        return importlib.import_module("transformer_engine.pytorch"), importlib.import_module(
            "transformer_engine.common.recipe")
    except Exception as err:  # noqa: BLE001 (a broken install raises anything: OSError, RuntimeError, ...)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}"[:300]


def unavailable_reason() -> str | None:
    """None when Transformer Engine's PyTorch API imports and a CUDA GPU is visible, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (Transformer Engine runs on NVIDIA GPUs only)"
    loaded = _import_te()
    if isinstance(loaded, str):
        return f"transformer_engine.pytorch does not import ({loaded})"
    return None


def _te():
    loaded = _import_te()
    if isinstance(loaded, str):
        raise RuntimeError(f"model.dense_backend='te': transformer_engine.pytorch does not import ({loaded})")
    return loaded


def build_recipe(name: str | None):
    """TE's recipe object for train.fp8_recipe `name`; None: bf16 GEMMs."""
    if name is None:
        return None
    _, recipes = _te()
    if name == "tensorwise":
        return recipes.Float8CurrentScaling()
    if name == "delayed":
        return recipes.DelayedScaling(reduce_amax=False)
    if name == "blockwise":
        return recipes.Float8BlockScaling()
    raise ValueError(f"fp8 recipe {name!r} must be one of {', '.join(TE_FP8_RECIPES)}")


def mark_accumulates_main_grad(param: nn.Parameter) -> None:
    """The backward of this parameter's GEMM adds its gradient into `param.main_grad` itself."""
    param.accumulates_main_grad = True


class TeMatmul:
    """`F.linear`-like callable (x, weight, bias=None) whose GEMMs run in one `te.Linear`.

    The TE module is created around `weight` (it holds that parameter, nothing of its own) and
    is not a submodule of anything: the model's state stays the "torch" backend's. In FP8 the
    call runs inside the model's autocast (`forward_in_autocast`), or enters its own where there
    is none (recomputation in the backward, a model without the hooks). `weights`: the model's
    step counter, where TE keeps each FP8 weight for a step's micro-batches."""

    def __init__(self, weight: nn.Parameter, recipe, fuse_wgrad: bool, weights: WeightVersion | None = None):
        te, _ = _te()
        out_features, in_features = weight.shape
        self.module = te.Linear(in_features, out_features, bias=False, params_dtype=weight.dtype, device="meta",
                                fuse_wgrad_accumulation=fuse_wgrad)
        self.module.weight = weight
        self.call = TeCall(te, self.module, recipe, weights)
        if fuse_wgrad:
            mark_accumulates_main_grad(weight)

    @eager_only
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.module.weight is not weight:  # e.g. a checkpoint load that assigned new parameters
            self.module.weight = weight
        y = self.call(x)
        return y + bias if bias is not None else y

    def __repr__(self) -> str:
        recipe = self.call.recipe
        return f"TeMatmul(recipe={type(recipe).__name__ if recipe is not None else 'bf16'})"


class TeLinear(nn.Module):
    """`nn.Linear`'s parameters under the same names, with the GEMMs in Transformer Engine."""

    def __init__(self, linear: nn.Linear, recipe, fuse_wgrad: bool, weights: WeightVersion | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.gemm = TeMatmul(linear.weight, recipe, fuse_wgrad, weights)  # a plain attribute, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.gemm!r}"


def forward_in_autocast(model: nn.Module, recipe) -> None:
    """Run `model`'s whole forward inside one TE autocast (hooks on the model): one amax
    update per forward for the delayed recipe, not one per layer, and no context per call."""
    te, _ = _te()
    state: list = []

    def enter(module, args):
        state.append(te.autocast(enabled=True, recipe=recipe))
        state[-1].__enter__()

    def leave(module, args, output):
        if state:
            state.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def _fits(recipe, *dims: int) -> bool:
    return recipe is None or all(d % FP8_ALIGN == 0 for d in dims)


def _plain_linear(module) -> bool:
    return type(module) is nn.Linear and module.bias is None


def _fuse_norms(block: nn.Module, te, recipe, fuse_wgrad: bool, weights: WeightVersion | None) -> list[str]:
    """Join the block's attention norm with q/k/v and, in a dense block, the FFN norm with the
    FFN, where the layers are plain bias-free linears (tp = 1); returns the joined linears' names."""
    joined = []
    attn = getattr(block, "attention", None)
    projections = [getattr(attn, n, None) for n in ("wq", "wk", "wv")]
    if isinstance(attn, Attention) and isinstance(block.attention_norm, RMSNorm) \
            and all(_plain_linear(m) for m in projections) \
            and _fits(recipe, projections[0].in_features, *(m.out_features for m in projections)):
        attn.qkv_projection = TeNormQKV(te, block.attention_norm, *projections, recipe, fuse_wgrad, weights)
        block.attention_norm = NormInNextLayer(block.attention_norm)
        joined += ["attention.wq", "attention.wk", "attention.wv"]
    ffn = getattr(block, "feed_forward", None)
    if type(ffn) is FeedForward and isinstance(block.ffn_norm, RMSNorm) \
            and all(_plain_linear(m) for m in (ffn.w1, ffn.w3, ffn.w2)) \
            and _fits(recipe, ffn.w1.in_features, ffn.w1.out_features):
        ffn.fused = TeNormMLP(te, block.ffn_norm, ffn.w1, ffn.w3, ffn.w2, recipe, fuse_wgrad, weights)
        block.ffn_norm = NormInNextLayer(block.ffn_norm)
        joined += ["feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]
    if fuse_wgrad:
        for name in joined:
            mark_accumulates_main_grad(block.get_submodule(name).weight)
    return joined


def apply_te(model: nn.Module, fp8_recipe: str | None, fuse_wgrad: bool, norm_fusion: bool = True,
             weights: WeightVersion | None = None) -> dict[str, str]:
    """Switch the linear layers of `model.layers` to Transformer Engine in place; returns
    {module name: "te-fused" | "te" | "torch"}. `fp8_recipe` None: bf16 GEMMs. `norm_fusion`:
    norms with their following projections in TE's fused modules (core.precision.te_fused) where the
    block allows; "te-fused" names the linears inside them. `weights`: the model's optimizer-step
    counter, for TE to keep each FP8 weight through a step's micro-batches (None: quantised on
    every call). Apply after tensor and expert
    parallelism (the local shards' shapes) and before the pipeline split, recompute, compile
    and data parallelism (which serves `main_grad` when `fuse_wgrad`)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"model.dense_backend='te': {reason}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"apply_te needs a core.train.model.GPT (a `layers` ModuleDict), got {type(model).__name__}")
    te, _ = _te()
    recipe = build_recipe(fp8_recipe)
    runs: dict[str, str] = {}
    for block_name, block in model_blocks(model):
        joined = _fuse_norms(block, te, recipe, fuse_wgrad, weights) if norm_fusion else []
        runs.update({f"{block_name}.{name}": "te-fused" for name in joined})
        for name, module in list(block.named_modules()):
            full = f"{block_name}.{name}"
            if name in joined:
                continue
            if isinstance(module, nn.Linear):
                ok = _fits(recipe, module.in_features, module.out_features)
                if ok:
                    parent, _, child = name.rpartition(".")
                    setattr(block.get_submodule(parent), child, TeLinear(module, recipe, fuse_wgrad, weights))
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                ok = _fits(recipe, *module.weight.shape)
                if ok:
                    module.matmul = TeMatmul(module.weight, recipe, fuse_wgrad, weights)
            else:
                continue
            runs[full] = "te" if ok else "torch"
    if recipe is not None:
        forward_in_autocast(model, recipe)
    kept = [name for name, how in runs.items() if how == "torch"]
    if kept:
        log.warning("te: %d of %d block linear layers keep torch GEMMs (FP8 needs feature sizes in multiples of %d): %s",
                    len(kept), len(runs), FP8_ALIGN, ", ".join(kept))
    log.info("te: %d block linear layers on Transformer Engine (%s), %d of them in fused norm modules",
             len(runs) - len(kept), fp8_recipe or "bf16", sum(how == "te-fused" for how in runs.values()))
    return runs
