"""FP8 dense layers through torchao's float8 training: `train.fp8_recipe` "tensorwise" or
"rowwise" with `model.dense_backend = "torch"`.

Each block's `nn.Linear` becomes torchao's `Float8Linear` (the same parameters under the same
names, so checkpoints move between recipes and backends unchanged). Its casts are plain tensor
code, which torch.compile fuses into the block's graph with the norms and SwiGLU around them:
no per-call host cost, where the FP8 linears of Tessera's own kernels and of Transformer Engine
each spend 5-7x a bf16 linear's host time (BENCHMARKS.md). Scales: "tensorwise" one per tensor,
computed from the current values; "rowwise" one per row of each operand.

What stays Tessera's: the routed experts (its grouped kernels, blockwise FP8), the output head
(bf16, as torchao's recipes advise), the fp32 main grads (the weight gradients arrive in `.grad`
like any linear's). On CPU the GPU's FP8 GEMMs are emulated exactly, for tests.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

from torch import nn

from core.layers import model_blocks
from core.rules import TORCHAO_FP8_RECIPES

log = logging.getLogger(__name__)

ALIGN = 16  # FP8 GEMMs take both dims of an operand in multiples of 16


def unavailable_reason() -> str | None:
    """Why torchao's float8 training cannot run here, or None."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'tessera[fp8]', or pip install torchao)"
    return None


def apply_torchao_fp8(model: nn.Module, recipe: str, emulate: bool) -> dict[str, str]:
    """Swap the `nn.Linear` layers of `model.layers` for torchao's Float8Linear in place;
    returns {module name: "fp8" | "bf16"} (a layer whose sizes are not multiples of 16 stays
    bf16). Apply before recompute, compile and data parallelism, on a model without tensor
    parallelism (its sharded linears are Tessera's own modules). `emulate`: the CPU's exact
    emulation of the FP8 GEMMs."""
    if recipe not in TORCHAO_FP8_RECIPES:
        raise ValueError(f"torchao fp8 recipe {recipe!r} must be one of {', '.join(TORCHAO_FP8_RECIPES)}")
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"train.fp8_recipe={recipe!r}: {reason}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"apply_torchao_fp8 needs a core.train.model.GPT (a `layers` ModuleDict), got {type(model).__name__}")
    runs: dict[str, str] = {}

    def convert(module: nn.Module, name: str) -> bool:
        ok = module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0
        runs[name] = "fp8" if ok else "bf16"
        return ok

    for block_name, block in model_blocks(model):
        convert_to_float8_training(block, config=config,
                                   module_filter_fn=lambda mod, fqn, prefix=f"{block_name}.":
                                   isinstance(mod, nn.Linear) and convert(mod, prefix + fqn))
    kept = [name for name, how in runs.items() if how == "bf16"]
    if kept:
        log.warning("fp8: %d of %d block linear layers stay bf16 (FP8 needs feature sizes in multiples of %d): %s",
                    len(kept), len(runs), ALIGN, ", ".join(kept))
    log.info("fp8: %d block linear layers on torchao's Float8Linear (%s scaling)", len(runs) - len(kept), recipe)
    return runs
