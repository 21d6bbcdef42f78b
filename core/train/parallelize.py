"""Where the parallelisms compose: one function applies each step to the plain model in order.

    tensor (+sequence) -> experts -> context -> Transformer Engine linears -> fp8 GEMMs -> pipeline split -> recompute -> device/compile
    -> data (+ZeRO-1)

Each step is a function of its own module that rewrites the plain model in place; this
module only fixes their order and hands the Trainer what it needs. Which kernel runs each
GEMM comes from the run's `PrecisionPlan` (core.precision.plan), resolved once from the config;
what the plan makes the run own (the FP8 weight cache, TE's step counter) is made here, per
model. It sits above both `core` and `moe`: the only place besides the model assembly that
knows both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from core.precision import blockwise, te_backend, torchao_fp8
from core.config import Config
from core.layers import FeedForward, model_blocks
from core import rules
from core.validation import check_split_masters, cp_a2a_size
from core.precision.plan import PrecisionPlan
from core.precision.te_fused import WeightVersion
from core.precision.weight_cache import Fp8WeightCache
from core.mesh import ParallelMesh
from core.train.optim import build_optimizer, clip_grad_norm_
from core.parallel.context import apply_cp
from core.parallel.ulysses import A2AGroups, apply_a2a_cp
from core.parallel.data import MOMENT_DTYPES, DataParallel, apply_data_parallel
from core.parallel.pipeline import PipelineStage, build_pipeline_stage, tie_for_data_parallel
from core.parallel.checkpoint_offload import CheckpointOffload, HostPool
from core.parallel.recompute import apply_recompute, compile_inside_checkpoint
from core.planner.memory import checkpoint_host_buffers
from core.parallel.wgrad import fuse_embedding_grad, fuse_weight_grads
from core.parallel.tensor import ColumnParallelLinear, RowParallelLinear, apply_tp
from moe.comm import ExchangeTimer
from moe.experts import GroupedExperts
from moe.layer import moe_layers, update_expert_bias
from moe.parallel import apply_ep

log = logging.getLogger(__name__)

COMPILE_BACKEND_ENV = "TESSERA_COMPILE_BACKEND"


def compile_blocks(chunks: list[nn.Module], cuda_graphs: bool = False, fp8_casts: bool = False,
                   one_graph_per_break: bool = False) -> None:
    """torch.compile each transformer block, with static shapes.

    A micro-batch's token count is fixed by the packer, so static shapes cost one graph for
    training and one per other size met (held-out batches, dynamic-CP shares); dynamic-shape
    recompiles crashed inside inductor's generated code on an H100 (docs/fp8.md). What
    changes with every batch stays outside the graphs: the attention core (document
    boundaries) and the MoE dispatch and experts (row counts per expert).
    TESSERA_COMPILE_BACKEND picks another backend ("aot_eager" to bisect an inductor bug).

    cuda_graphs: inductor's "reduce-overhead" mode, which records each compiled region's
    kernels once and replays them with one launch, for steps whose host time exceeds the GPU's.
    Regions inductor cannot graph (CPU tensors) run as plain compiled code.

    fp8_casts (torchao's tensorwise FP8 linears compiled into the block): no mix-order
    reductions. That fusion puts the norm's backward and its weight-gradient column sum in one
    row loop, and with them the transposed FP8 copy of the norm's output that the
    weight-gradient GEMMs read, stored 8 KB apart per element: 0.59 ms per block and
    micro-batch on an H100 at 8192 tokens, 11% of the FP8 step (docs/fp8.md). Rowwise keeps
    the fusion: not measured there, and its 500-step loss test passed with it.

    one_graph_per_break (recomputed norms): dynamo's nested graph breaks, so the attention's
    graph break (its core runs eagerly) ends the block's graph there instead of splitting it
    before the attention module: the attention norm and the q/k/v projections that save its
    output share one graph, where the norm's checkpoint can drop that output. It is a global
    dynamo setting, on for the rest of the process."""
    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    options = {"backend": backend, "dynamic": False}
    inductor = {}
    if cuda_graphs:
        inductor["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets
    if fp8_casts:
        inductor["triton.mix_order_reduction"] = False
    if inductor and backend == "inductor":
        options["options"] = inductor
    if one_graph_per_break:
        torch._dynamo.config.nested_graph_breaks = True
    for chunk in chunks:
        for _, block in model_blocks(chunk):
            if not compile_inside_checkpoint(block, **options):
                block.compile(**options)


def checkpoint_buffers(config: Config, plan: PrecisionPlan, pp_rank: int) -> dict[int, int]:
    """train.offload_checkpoints' host buffers on pipeline rank `pp_rank`, {bytes: count}, in the
    precision the run resolved (train.precision 'auto' is fp32 on a CPU)."""
    resolved = dataclasses.replace(config, train=dataclasses.replace(config.train, precision=plan.precision))
    return checkpoint_host_buffers(resolved, pp_rank)


@dataclass
class GradControl:
    """The loop's handle on gradients: when to communicate, when to clip, when to clear."""

    dp: DataParallel
    mesh: ParallelMesh
    model: nn.Module
    pipeline: PipelineStage | None = None  # when pp > 1
    # The model's FP8 weights, quantised once per step and dropped when the weights change
    # (dp's on_new_weights); None where the precision plan keeps none.
    weight_cache: Fp8WeightCache | None = None

    uses_autocast: bool = False  # params are already in the compute dtype

    def sync_context(self, last: bool):
        """Micro-batches before the last accumulate without communication."""
        return contextlib.nullcontext() if last else self.dp.no_sync()

    def finish_and_clip(self, max_norm: float) -> torch.Tensor:
        """Wait for the reductions, then clip by the global norm over every parallel group (the
        factor is applied by the optimizer step that follows, inside its own pass)."""
        self.dp.finish_grad_sync()
        _after_grad_sync(self.model, self.mesh)
        return clip_grad_norm_(self.dp, max_norm, self.mesh, defer=True)

    def zero_grad(self) -> None:
        self.dp.zero_grad()


def _after_grad_sync(model: nn.Module, mesh: ParallelMesh) -> None:
    """Expert-bias updates read loads that are final only once the step's grads are in."""
    if moe_layers(model):
        update_expert_bias(model, mesh)


def parallelize(model: nn.Module, mesh: ParallelMesh, config: Config, device: torch.device, plan: PrecisionPlan,
                exchange_timer: ExchangeTimer | None = None):
    """Apply every configured parallelism and the precision `plan`; returns (model, optimizer,
    scheduler, grads). `exchange_timer`: the run's timer of the MoE token all-to-alls."""
    p, t = config.parallel, config.train
    log.info("precision plan: %s", plan.describe())
    if mesh.tp > 1:
        apply_tp(model, mesh, sequence_parallel=p.sequence_parallel)
    if config.model.moe.num_experts:
        apply_ep(model, mesh, etp=p.etp, sequence_parallel=p.sequence_parallel, exchange_timer=exchange_timer)
    # Dynamic CP: DynamicCP.build put in the attention that reads each entry's sub-group from its batch.
    if mesh.cp > 1 and not p.dynamic_cp:
        if p.cp_comm == "ring":
            apply_cp(model, mesh)
        else:
            apply_a2a_cp(model, A2AGroups(mesh, cp_a2a_size(config)))
    weight_cache = Fp8WeightCache() if plan.weight_cache else None
    # Transformer Engine's linears keep their own FP8 weights from a step's first micro-batch.
    te_weights = WeightVersion() if plan.weight_cache and plan.linears == "te" else None
    if plan.linears == "te":  # after TP/EP: it reads the local shards' shapes
        te_backend.apply_te(model, plan.linear_recipe, fuse_wgrad=p.gradient_accumulation_fusion,
                            norm_fusion=plan.te_norm_fusion, weights=te_weights)
    if plan.linears == "torchao":
        torchao_fp8.apply_torchao_fp8(model, plan.linear_recipe, emulate=device.type != "cuda")
    if plan.experts == "blockwise" or plan.linears == "blockwise":
        apply_fp8(model, expert_wgrad=plan.expert_wgrad, dense=plan.linears == "blockwise", cache=weight_cache)
    stage = None
    chunks = [model]
    if mesh.pp > 1:
        stage = build_pipeline_stage(model, mesh, config)
        tie_for_data_parallel(stage)
        chunks = stage.chunks
    if t.mlp_chunk_tokens:
        blocks = [block for chunk in chunks for _, block in model_blocks(chunk)]
        tiled = [block for block in blocks if isinstance(block.feed_forward, FeedForward)]
        for block in tiled:
            block.feed_forward.chunk_tokens = t.mlp_chunk_tokens
        log.info("tiled MLP: %d dense feed-forward layers run %d tokens at a time", len(tiled), t.mlp_chunk_tokens)
        routed = [layer for chunk in chunks for layer in moe_layers(chunk)]
        rows = t.mlp_chunk_tokens * config.model.moe.top_k
        for layer in routed:  # the routed experts over the rows of that many tokens, the shared ones as a dense MLP
            layer.experts.chunk_rows = rows
            if layer.shared_experts is not None:
                layer.shared_experts.chunk_tokens = t.mlp_chunk_tokens
        if routed:
            log.info("tiled experts: %d MoE layers run their routed experts %d rows at a time", len(routed), rows)
    kinds = rules.offloaded_checkpoints(config)
    inputs_offload = None
    if kinds:  # the host buffers made once, from the planner's count of what this rank keeps in flight
        pool = HostPool(checkpoint_buffers(config, plan, mesh.coordinate("pp")), pin=device.type == "cuda")
        inputs_offload = CheckpointOffload(pool)
        log.info("checkpoint offload: the inputs of recomputed %s (%s) to host memory, %d buffers of %.1f MiB in all",
                 "/".join(sorted(kinds)), f"the first {t.offload_checkpoints_layers} blocks of each chunk"
                 if t.offload_checkpoints_layers else "every block", pool.made, pool.bytes / 2 ** 20)
    for index, chunk in enumerate(chunks):
        apply_recompute(chunk, t.recompute, t.recompute_modules, t.offload_modules, compiled=t.compile,
                        num_layers=t.recompute_num_layers, checkpoint_offload=inputs_offload, offload_kinds=kinds,
                        chunk=index, offload_layers=t.offload_checkpoints_layers)
    model.to(device)
    if t.compile:
        compile_blocks(chunks, cuda_graphs=t.cuda_graphs,
                       fp8_casts=plan.linears == "torchao" and plan.linear_recipe == "tensorwise",
                       one_graph_per_break="norms" in rules.recompute_set(t))
    if plan.precision == "bf16" and p.gradient_accumulation_fusion:
        fuse_weight_grads(chunks)
    if p.gradient_accumulation_fusion:
        fuse_embedding_grad(chunks)
    check_split_masters(config, plan.precision)  # again here: what train.precision='auto' became on this device
    dp = apply_data_parallel(model, mesh, bucket_mb=p.bucket_mb, distributed_optimizer=p.distributed_optimizer,
                             param_dtype=plan.param_dtype, gradient_accumulation_fusion=p.gradient_accumulation_fusion,
                             split_masters=p.split_master_weights, offload=t.optimizer_offload,
                             host_limit_gb=t.optimizer_offload_host_gb,
                             moments_dtype=MOMENT_DTYPES[t.optimizer_moments_dtype])
    # After data parallelism: its cast gives the parameters the storage the FP8 layers read.
    if weight_cache is not None:
        weight_cache.track(p for p in model.parameters() if p.requires_grad)
        dp.on_new_weights.append(weight_cache.clear)
    if te_weights is not None:
        dp.on_new_weights.append(te_weights.bump)
    optimizer, scheduler = build_optimizer(dp, t)
    return model, optimizer, scheduler, GradControl(dp, mesh, model, pipeline=stage, weight_cache=weight_cache)


def apply_fp8(model: nn.Module, expert_wgrad: str = "fp8", dense: bool = True,
              cache: Fp8WeightCache | None = None) -> dict[str, str]:
    """Switch the GEMMs of `model.layers` to FP8 in place; returns {module name: "fp8" | "bf16"}.
    `expert_wgrad`: the experts' weight-gradient GEMM, "fp8" or "bf16" (train.fp8_expert_wgrad).
    `dense=False`: the experts only (the linear layers run torchao's or Transformer Engine's
    recipe). `cache`: the model's weight cache, which the FP8 layers then quantise through.

    Touches the blocks' linear layers (`nn.Linear` -> `Fp8Linear`; tensor-parallel layers get
    an `Fp8Matmul` as `matmul`) and `GroupedExperts.mm`; everything outside the blocks (embedding,
    output head, final norm) and the non-GEMM parts inside them (norms, router, attention core)
    keep their precision. A layer whose local feature sizes are not multiples of 128 keeps its
    bf16 GEMM; those are logged in one line. Apply after tensor/expert parallelism (it reads
    the local shards' shapes) and before the pipeline split, recompute and compile."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"apply_fp8 needs a core.train.model.GPT (a `layers` ModuleDict), got {type(model).__name__}")
    grouped = blockwise.Fp8GroupedMM(expert_wgrad, cache)  # checks expert_wgrad
    matmul = blockwise.Fp8Matmul(cache)
    runs: dict[str, str] = {}
    kept: list[str] = []
    for block_name, block in model_blocks(model):
        for name, module in list(block.named_modules()):
            full = f"{block_name}.{name}"
            if (isinstance(module, blockwise.Fp8Linear)
                    or isinstance(getattr(module, "matmul", None), blockwise.Fp8Matmul)
                    or isinstance(getattr(module, "mm", None), blockwise.Fp8GroupedMM)):
                raise ValueError(f"{full} already runs in FP8: apply_fp8 was applied twice")
            if isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) and not dense:
                continue
            if isinstance(module, nn.Linear):
                ok = blockwise.fits_blocks(module.in_features, module.out_features)
                if ok:
                    parent, _, child = name.rpartition(".")
                    setattr(block.get_submodule(parent), child, blockwise.Fp8Linear.from_linear(module, cache))
                shape = [module.out_features, module.in_features]
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                shape = list(module.weight.shape)
                ok = blockwise.fits_blocks(*shape)
                if ok:
                    module.matmul = matmul
            elif isinstance(module, GroupedExperts):
                shape = [module.num_experts, module.dim, module.hidden]
                ok = blockwise.fits_blocks(module.dim, module.hidden)
                if ok:
                    module.mm = grouped
            else:
                continue
            runs[full] = "fp8" if ok else "bf16"
            if not ok:
                kept.append(f"{full} {shape}")
    if kept:
        log.warning("fp8: %d of %d block GEMM layers keep bf16 (local feature sizes not multiples of %d): %s",
                    len(kept), len(runs), blockwise.BLOCK, ", ".join(kept))
    experts = any(isinstance(m, GroupedExperts) for m in layers.modules())
    log.info("fp8: %d block GEMM layers in FP8%s", len(runs) - len(kept),
             f" (expert wgrad {expert_wgrad})" if experts else "")
    return runs
