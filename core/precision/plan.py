"""Which kernel runs each GEMM of a run, decided once from the config: `PrecisionPlan`.

`resolve_precision_plan(config, device)` reads `train.precision`, `train.fp8_recipe`,
`train.fp8_expert_wgrad`, `train.fp8_weight_cache` and `model.dense_backend` /
`model.te_norm_fusion` once, at start; the parallelize steps read the plan, not the config:

| kind of layer       | backends                                                             |
|---------------------|----------------------------------------------------------------------|
| block linear layers | "torch" (F.linear in the parameters' dtype), "blockwise" (Tessera's  |
|                     | FP8, core.precision.blockwise), "torchao" (core.precision.torchao_fp8)|
|                     | or "te" (Transformer Engine, core.precision.te_backend)              |
| routed experts      | "torch" (core.kernels' bf16 grouped GEMM) or "blockwise"             |
| output head         | "torch", as the embedding, norms, router and attention core: never  |
|                     | FP8 (docs/fp8.md says why)                                           |

What a run builds from the plan and owns (the weight cache, TE's step counter) lives in the
run's objects (core.train.parallelize), not here: the plan is a value, the same for every
rank of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from core.config import Config
from core.rules import grad_accum_steps, torchao_fp8

LinearBackend = Literal["torch", "blockwise", "torchao", "te"]
ExpertBackend = Literal["torch", "blockwise"]


@dataclass(frozen=True)
class PrecisionPlan:
    """The precision of every kind of layer in one run (module docstring)."""

    precision: Literal["fp32", "bf16", "fp8"]  # train.precision with "auto" resolved for the device
    linears: LinearBackend  # the transformer blocks' linear layers
    linear_recipe: str | None  # the FP8 scaling of `linears` (train.fp8_recipe); None: no FP8
    experts: ExpertBackend  # the routed experts' grouped GEMMs
    expert_wgrad: Literal["fp8", "bf16"]  # the blockwise experts' weight-gradient GEMM
    weight_cache: bool  # FP8 weights quantised once per optimizer step and kept for its micro-batches
    te_norm_fusion: bool  # with linears "te": the norms inside TE's fused modules where the block allows
    head: Literal["torch"] = "torch"  # output head (and embedding): the parameters' dtype, as torchao's recipes advise

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the parameters the model reads (fp32 masters stay in the optimizer)."""
        return torch.bfloat16 if self.precision in ("bf16", "fp8") else torch.float32

    def describe(self) -> str:
        """One line for the log: which backend runs what."""
        linears = self.linears + (f" ({self.linear_recipe})" if self.linear_recipe else "")
        experts = self.experts + (f" (wgrad {self.expert_wgrad})" if self.experts == "blockwise" else "")
        return (f"{self.precision}: block linears {linears}, experts {experts}, output head {self.head}, "
                f"fp8 weight cache {'on' if self.weight_cache else 'off'}")


def resolve_precision_plan(config: Config, device: torch.device) -> PrecisionPlan:
    """The plan of a validated config (core.validation) on `device`, whose type decides
    train.precision = "auto": bf16 on a GPU, fp32 elsewhere."""
    t, backend = config.train, config.model.dense_backend
    precision = t.precision if t.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    fp8 = precision == "fp8"
    if backend == "te":
        linears, recipe = "te", t.fp8_recipe if fp8 else None
    elif torchao_fp8(config):
        linears, recipe = "torchao", t.fp8_recipe
    elif fp8:
        linears, recipe = "blockwise", "blockwise"
    else:
        linears, recipe = "torch", None
    # With one micro-batch per step the forward and dgrad layouts are never reused: a cache
    # would only cost memory.
    weight_cache = fp8 and t.fp8_weight_cache and grad_accum_steps(config) > 1
    return PrecisionPlan(precision=precision, linears=linears, linear_recipe=recipe,
                         experts="blockwise" if fp8 else "torch", expert_wgrad=t.fp8_expert_wgrad,
                         weight_cache=weight_cache, te_norm_fusion=config.model.te_norm_fusion)

