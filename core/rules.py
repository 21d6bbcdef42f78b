"""Domain rules the trainer, the planner and the validation share, without torch.

How many micro-batches a step runs, what optimizer offload keeps in host memory, which
modules are recomputed and how the module kinds nest, which layers hold routed experts, whether torchao runs the dense FP8 GEMMs, the fused
loss's chunk size, and the pipeline's schedule and layer split. Each is a plain function of
the config (or of a few numbers), so `tessera-plan` reads them without loading torch;
`core.parallel`, `core.train` and `moe` import them from here. The module imports only the
schema, `core.config`.
"""

from __future__ import annotations

from core.config import Config, ModelConfig, MoEConfig, TrainConfig

# ---- steps and micro-batches ------------------------------------------------------------


def grad_accum_steps(config: Config) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step (`parallel.dp` as derived
    by `core.validation.validate`)."""
    t, p = config.train, config.parallel
    return t.global_batch_size // (t.micro_batch_size * p.dp)


# ---- optimizer offload (core/parallel/offload.py) --------------------------------------------

MOMENT_BYTES = {"fp32": 4, "bf16": 2}  # bytes per element of each AdamW moment (train.optimizer_moments_dtype)


def optimizer_state_bytes(moments_dtype: str = "fp32") -> int:
    """Bytes per element of a rank's optimizer shard that offload keeps on the host: the fp32
    master and the two moments (12 with fp32 moments, 8 with bf16)."""
    return 4 + 2 * MOMENT_BYTES[moments_dtype]


def offload_host_bytes(shard_numel: int, region_numel: int, moments_dtype: str = "fp32") -> int:
    """Host bytes `train.optimizer_offload` takes on a rank: masters and moments of its shard's
    `shard_numel` elements (`optimizer_state_bytes`), and the pinned fp32 buffer of its buckets'
    reduced regions (`region_numel`: ZeRO-1 buckets pad every rank to rank 0's chunk), which
    carries the gradients out and the new weights in."""
    return shard_numel * optimizer_state_bytes(moments_dtype) + region_numel * 4


# ---- recomputation and offload (core/parallel/recompute.py) ---------------------------------

# Each name is a kind of module in every block; the outer ones contain the inner ones (`block` all of them).
RECOMPUTE_MODULES = ("norms", "swiglu", "moe_experts", "attention_core", "mla_up", "attention", "mlp", "block")
_INSIDE = {"block": set(RECOMPUTE_MODULES) - {"block"}, "attention": {"attention_core", "mla_up", "norms"},
           "mla_up": {"attention_core"}, "mlp": {"swiglu", "moe_experts"}}
#: Recomputed eagerly with hooks on the saved tensors of the next module (compiled: checkpoints in the graph).
HOOKED_RECOMPUTE = ("norms", "swiglu")


def recompute_set(t: TrainConfig) -> set[str]:
    """The modules recomputed: train.recompute_modules plus what train.recompute names."""
    legacy = {"none": set(), "selective": {"attention_core"}, "full": {"block"}}[t.recompute]
    return set(t.recompute_modules) | legacy


#: Recomputed kinds whose checkpoint inputs train.offload_checkpoints keeps in host memory: a
#: whole block (its input), and eagerly the attention (the norm's output) and its core (q, k, v).
#: Compiled blocks keep the inner checkpoints inside their graphs, where no hook runs.
CHECKPOINT_OFFLOAD = ("block", "attention", "attention_core")


def offloaded_checkpoints(config: Config) -> set[str]:
    """The recomputed kinds whose checkpoint inputs go to host memory (none unless
    train.offload_checkpoints): the outermost recomputed kinds of `CHECKPOINT_OFFLOAD`
    (`block` only when compiled; `attention_core` not under MLA, whose v is a view of a wider
    projection and stays)."""
    t = config.train
    if not t.offload_checkpoints:
        return set()
    recomputed = recompute_set(t)
    if "block" in recomputed:
        return {"block"}
    if t.compile:
        return set()
    if "attention" in recomputed:
        return {"attention"}
    if "mla_up" in recomputed or config.model.attention == "mla":
        return set()
    return recomputed & {"attention_core"}


def nests(a: str, b: str) -> bool:
    """Whether one of the two module kinds contains the other (or they are the same)."""
    return a == b or b in _INSIDE.get(a, ()) or a in _INSIDE.get(b, ())


# ---- attention ----------------------------------------------------------------------------


def attention_width(m: ModelConfig) -> float:
    """The attention width core.metrics.flops_per_token counts (6 * layers * width * seq FLOPs per
    token): num_heads * head size, with multi-head latent attention's two head sizes averaged,
    since the scores q k^T run over the query/key head (nope + rope) and the product with v over
    the value head."""
    return m.num_heads * (m.attention_head_dim + m.value_head_dim) / 2


# ---- MoE layers ---------------------------------------------------------------------------


def moe_layer_rule(moe: MoEConfig, layer_id: int) -> bool:
    """Whether layer `layer_id` has routed experts: not in dense_layers, at or after
    first_k_dense, and every moe_every-th from there (Qwen3-MoE's `decoder_sparse_step` s is
    first_k_dense = s - 1 with moe_every = s, its `mlp_only_layers` are dense_layers)."""
    return (moe.num_experts > 0 and layer_id not in moe.dense_layers and layer_id >= moe.first_k_dense
            and (layer_id - moe.first_k_dense) % moe.moe_every == 0)


# ---- precision and the loss ---------------------------------------------------------------

TORCHAO_FP8_RECIPES = ("tensorwise", "rowwise")  # with the torch backend: torchao's Float8Linear


def torchao_fp8(config: Config) -> bool:
    """Whether the blocks' dense layers run torchao's FP8 (core/precision/torchao_fp8.py)."""
    t = config.train
    return config.model.dense_backend == "torch" and t.precision == "fp8" and t.fp8_recipe in TORCHAO_FP8_RECIPES


# train.fused_loss: logits per token chunk, 128 MiB in bf16 (core/train/loss.py; the planner models it).
# Each chunk adds its weight gradient into the fp32 main grad (a read and a write of [V, d] fp32),
# so smaller chunks cost time: 8192 tokens x 32000 vocab on an H100 took 5.0-5.4 ms unfused,
# 5.6 ms at 2048-token chunks (-0.6 GiB), 6.6-6.9 ms at 1024.
FUSED_CHUNK_ELEMENTS = 1 << 26

# ---- the pipeline's layout (core/parallel/schedules.py plans the order) -----------------------

SCHEDULES = ("1f1b", "interleaved")


def check_schedule(schedule: str, pp: int, virtual: int) -> None:
    """Raise ValueError unless (schedule, pp, virtual stages) can run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
    if pp < 1 or virtual < 1:
        raise ValueError(f"parallel.pp={pp} and parallel.pp_virtual_stages={virtual} must be >= 1")
    if schedule == "1f1b" and virtual != 1:
        raise ValueError(
            f"parallel.pp_virtual_stages={virtual} needs parallel.pp_schedule='interleaved' (1f1b runs one chunk per rank)"
        )
    if schedule == "interleaved":
        if virtual < 2:
            raise ValueError("parallel.pp_schedule='interleaved' needs parallel.pp_virtual_stages >= 2 (with 1 it is '1f1b')")
        if pp < 2:
            raise ValueError(f"parallel.pp_schedule='interleaved' needs parallel.pp >= 2, got pp={pp}")


def partition_layers(num_layers: int, num_stages: int, first: int = 0, last: int = 0) -> list[range]:
    """Contiguous layer ranges for each virtual stage, in stage order.

    `first`/`last` (> 0) fix the layer counts of stage 0 and stage V-1 (e.g. fewer layers
    where the embedding or the output head and loss already cost time or memory); the other
    stages split the rest as evenly as possible, earlier stages taking the remainder."""
    if num_stages < 1:
        raise ValueError(f"number of pipeline stages must be >= 1, got {num_stages}")
    if first < 0 or last < 0:
        raise ValueError(f"parallel.pp_first_stage_layers={first} and pp_last_stage_layers={last} must be >= 0 (0: even split)")
    if num_stages == 1:
        if (first and first != num_layers) or (last and last != num_layers):
            raise ValueError(
                f"with one pipeline stage it holds all {num_layers} layers; "
                f"pp_first_stage_layers={first} / pp_last_stage_layers={last} must be 0 or {num_layers}"
            )
        return [range(0, num_layers)]
    fixed = {0: first, num_stages - 1: last}
    free = [s for s in range(num_stages) if not fixed.get(s)]
    remaining = num_layers - first - last
    if free:
        base, extra = divmod(remaining, len(free)) if remaining >= 0 else (-1, 0)
        if base < 1:
            raise ValueError(
                f"model.num_layers={num_layers} cannot give each of the {num_stages} pipeline stages at least one layer "
                f"with pp_first_stage_layers={first} and pp_last_stage_layers={last}; "
                f"use at least {first + last + len(free)} layers or smaller fixed stages"
            )
        counts = {s: base + (1 if i < extra else 0) for i, s in enumerate(free)}
    elif remaining != 0:
        raise ValueError(
            f"pp_first_stage_layers={first} + pp_last_stage_layers={last} must equal model.num_layers={num_layers} "
            f"when there are only two pipeline stages"
        )
    else:
        counts = {}
    counts.update({s: n for s, n in fixed.items() if n})
    ranges, start = [], 0
    for s in range(num_stages):
        ranges.append(range(start, start + counts[s]))
        start += counts[s]
    return ranges


def group_score_experts(moe) -> int:
    """How many of a group's best experts make its score in group-limited routing (moe/router.py
    `limit_to_groups`): `model.moe.group_score_experts`, or top_k // topk_groups when 0; at most
    the experts of a group, at least one."""
    per_group = moe.num_experts // max(moe.n_groups, 1)
    wanted = moe.group_score_experts or moe.top_k // moe.topk_groups
    return min(max(1, wanted), per_group)
