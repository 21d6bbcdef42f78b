"""Where the parallelisms compose: one function applies each step to the plain model in order.

    tensor (+sequence) -> experts -> context -> fp8 GEMMs -> pipeline split -> recompute -> device/compile
    -> data (+ZeRO-1)

Each step is a function of its own module that rewrites the plain model in place; this
file only fixes their order and hands the training loop what it needs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from core.config import Config
from core.mesh import ParallelMesh
from core.parallel.recompute import apply_recompute


COMPILE_BACKEND_ENV = "TESSERA_COMPILE_BACKEND"


def compile_blocks(chunks: list[nn.Module]) -> None:
    """torch.compile each transformer block, with static shapes.

    A micro-batch's token count is fixed by the packer, so static shapes cost one graph for
    training and one per other size met (held-out batches, dynamic-CP shares); dynamic-shape
    recompiles crashed inside inductor's generated code on an H100 (docs/fp8.md). What
    changes with every batch stays outside the graphs: the attention core (document
    boundaries) and the MoE dispatch and experts (row counts per expert).
    TESSERA_COMPILE_BACKEND picks another backend ("aot_eager" to bisect an inductor bug)."""
    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    for chunk in chunks:
        for block in chunk.layers.values():
            block.compile(backend=backend, dynamic=False)


@dataclass
class GradControl:
    """The loop's handle on gradients: when to communicate, when to clip, when to clear."""

    dp: "object"  # core.parallel.data.DataParallel
    mesh: ParallelMesh
    model: nn.Module
    pipeline: "object | None" = None  # core.parallel.pipeline.PipelineStage when pp > 1

    uses_autocast: bool = False  # params are already in the compute dtype

    def sync_context(self, last: bool):
        """Micro-batches before the last accumulate without communication."""
        return contextlib.nullcontext() if last else self.dp.no_sync()

    def finish_and_clip(self, max_norm: float) -> torch.Tensor:
        """Wait for the reductions, then clip by the global norm over every parallel group (the
        factor is applied by the optimizer step that follows, inside its own pass)."""
        from core.optim import clip_grad_norm_

        self.dp.finish_grad_sync()
        _after_grad_sync(self.model, self.mesh)
        return clip_grad_norm_(self.dp, max_norm, self.mesh, defer=True)

    def zero_grad(self) -> None:
        self.dp.zero_grad()


def _after_grad_sync(model: nn.Module, mesh: ParallelMesh) -> None:
    """Expert-bias updates read loads that are final only once the step's grads are in."""
    try:
        from moe.layer import moe_layers, update_expert_bias
    except ImportError:
        return
    if moe_layers(model):
        update_expert_bias(model, mesh)


def parallelize(model: nn.Module, mesh: ParallelMesh, config: Config, device: torch.device, precision: str):
    """Apply every configured parallelism; returns (model, optimizer, scheduler, grads)."""
    from core.optim import build_optimizer
    from core.parallel.data import apply_data_parallel

    p, t = config.parallel, config.train
    if mesh.tp > 1:
        from core.parallel.tensor import apply_tp

        apply_tp(model, mesh, sequence_parallel=p.sequence_parallel)
    if config.model.moe.num_experts:
        from moe.parallel import apply_ep

        apply_ep(model, mesh, etp=p.etp, sequence_parallel=p.sequence_parallel)
    if mesh.cp > 1:
        from core.parallel.context import apply_cp

        apply_cp(model, mesh)
    if precision == "fp8":  # after TP/EP: it reads the local shards' shapes
        from core.fp8 import apply_fp8

        apply_fp8(model)
    stage = None
    chunks = [model]
    if mesh.pp > 1:
        from core.parallel.pipeline import build_pipeline_stage, tie_for_data_parallel

        stage = build_pipeline_stage(model, mesh, config)
        tie_for_data_parallel(stage)
        chunks = stage.chunks
    for chunk in chunks:
        apply_recompute(chunk, t.recompute)
    model.to(device)
    if t.compile:
        compile_blocks(chunks)
    param_dtype = torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32
    dp = apply_data_parallel(model, mesh, bucket_mb=p.bucket_mb, distributed_optimizer=p.distributed_optimizer,
                             param_dtype=param_dtype, gradient_accumulation_fusion=p.gradient_accumulation_fusion)
    if precision == "fp8":
        _cache_fp8_weights(model, dp, config)
    optimizer, scheduler = build_optimizer(dp, t)
    return model, optimizer, scheduler, GradControl(dp, mesh, model, pipeline=stage)


def _cache_fp8_weights(model: nn.Module, dp, config: Config) -> None:
    """Quantise each FP8 weight once per step when a step runs several micro-batches (with one,
    the forward and dgrad layouts are never reused and the cache would only cost memory)."""
    from core.config import grad_accum_steps
    from core.fp8_cache import WEIGHT_CACHE

    if config.train.fp8_weight_cache and grad_accum_steps(config) > 1:
        WEIGHT_CACHE.track(p for p in model.parameters() if p.requires_grad)
        dp.on_new_weights.append(WEIGHT_CACHE.clear)
    else:
        WEIGHT_CACHE.track([])
