"""What a rank holds whatever it computes: its parameters, gradients and optimizer state, exactly.

This rank's parameters are the shards `apply_tp`, `apply_ep` and the pipeline split leave (in
the parameter dtype); the fp32 main grads are one flat buffer per bucket, every parameter
whole, plus the reduce-scatter target of each ZeRO-1 bucket (rank 0's chunk, the longest);
AdamW's moments (fp32, or bf16 under `train.optimizer_moments_dtype`) and fp32 masters cover
this rank's ZeRO-1 chunks, cut like `torch.chunk` along the dim tensor and expert parallelism
leave whole (`core.parallel.data.zero_shard_dim`). Under
`train.optimizer_offload` the masters and moments leave the device for host memory, joined
there by each bucket's pinned buffer, which carries gradients out and weights in (`host`,
`core.rules.offload_host_bytes`); the params and main grads stay.
`tests/test_planner_memory.py` compares these numbers with the tensors `core.train.parallelize`
allocates on gloo ranks, for every layout of the tiny configs.

All sizes in bytes. Ranks are numbered as `core.mesh` does: tp fastest, then cp, dp, pp. The
planner asks for the same layout's facts many times: they are computed once per layout (`cached`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.config import Config
from core.rules import MOMENT_BYTES, moe_layer_rule, offload_host_bytes, offloaded_checkpoints, partition_layers

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2, "auto": 2}  # auto: bf16 on the GPU the plan is for


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a rank holds it: local shape, the dim TP split (None: whole), expert or not."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    expert: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def zero_dim(self) -> int | None:
        """The dim ZeRO-1 chunks along (core.parallel.data.zero_shard_dim)."""
        taken = {self.tp_dim} | ({0} if self.expert else set())
        return next((d for d in range(len(self.shape)) if d not in taken), None)


def coordinates(config: Config, rank: int) -> dict[str, int]:
    """pp, dp, cp, tp coordinates of a global rank, and its dp_cp / edp group ranks."""
    p = config.parallel
    tp = rank % p.tp
    cp = rank // p.tp % p.cp
    dp = rank // (p.tp * p.cp) % p.dp
    pp = rank // (p.tp * p.cp * p.dp)
    i = dp * p.cp + cp
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "dp_cp": i, "edp": i // p.ep, "ep": i % p.ep}


def _chunk_layers(config: Config, pp_rank: int) -> list[range]:
    """The global layer indices of each model chunk (virtual stage) pipeline rank `pp_rank` holds;
    the last stage's ends with its multi-token prediction blocks, num_layers.. (the order of
    `core.layers.model_blocks`, which recompute's first-N counts in)."""
    p, m = config.parallel, config.model
    stages = p.pp * p.pp_virtual_stages
    ranges = [list(r) for r in partition_layers(m.num_layers, stages, p.pp_first_stage_layers, p.pp_last_stage_layers)]
    ranges[-1] += range(m.num_layers, m.num_layers + m.mtp_layers)
    return [ranges[c * p.pp + pp_rank] for c in range(p.pp_virtual_stages)]


def stage_layers(config: Config, pp_rank: int) -> list[int]:
    """The global layer indices pipeline rank `pp_rank` holds (all its virtual stages)."""
    return [i for chunk in _chunk_layers(config, pp_rank) for i in chunk]


def recomputed_layers(config: Config, pp_rank: int) -> set[int]:
    """Of `stage_layers`, those whose blocks recompute (`train.recompute_num_layers`: the first
    N of each chunk; all where it is 0)."""
    n = config.train.recompute_num_layers
    return {i for chunk in _chunk_layers(config, pp_rank) for i in (chunk[:n] if n else chunk)}


def offloaded_input_layers(config: Config, pp_rank: int) -> set[int]:
    """Of `recomputed_layers`, those whose checkpoint inputs go to host memory under
    train.offload_checkpoints (`train.offload_checkpoints_layers`: the first N recomputed blocks
    of each chunk in forward order, whose inputs wait longest for their backward; all where it is
    0); none without the offload."""
    if not offloaded_checkpoints(config):
        return set()
    n, recomputing = config.train.offload_checkpoints_layers, recomputed_layers(config, pp_rank)
    out: set[int] = set()
    for chunk in _chunk_layers(config, pp_rank):
        mine = [i for i in chunk if i in recomputing]
        out.update(mine[:n] if n else mine)
    return out


def _linear(name: str, out_f: int, in_f: int, tp: int, split: str | None, bias: bool) -> list[ParamSpec]:
    """nn.Linear weight [out, in] (+ bias) after apply_tp: column splits out, row splits in."""
    if split == "column" and tp > 1:
        specs = [ParamSpec(name + ".weight", (out_f // tp, in_f), 0)]
    elif split == "row" and tp > 1:
        specs = [ParamSpec(name + ".weight", (out_f, in_f // tp), 1)]
    else:
        specs = [ParamSpec(name + ".weight", (out_f, in_f), None)]
    if bias:  # column-parallel biases stay whole (each rank adds its slice), row ones too
        specs.append(ParamSpec(name + ".bias", (out_f,), None))
    return specs


def _mla_params(a: str, m, tp: int) -> list[ParamSpec]:
    """Multi-head latent attention after apply_tp: the up-projections and wo split by heads, the
    down-projections and latent norms replicated (core/parallel/tensor.py)."""
    heads, hd, bias = m.num_heads, m.attention_head_dim, m.attention_bias
    if m.q_lora_rank:
        specs = _linear(a + "wq_a", m.q_lora_rank, m.dim, 1, None, bias)
        specs += [ParamSpec(a + "q_norm.weight", (m.q_lora_rank,), None)]
        specs += _linear(a + "wq_b", heads * hd, m.q_lora_rank, tp, "column", False)
    else:
        specs = _linear(a + "wq", heads * hd, m.dim, tp, "column", False)
    specs += _linear(a + "wkv_a", m.kv_lora_rank + m.qk_rope_head_dim, m.dim, 1, None, bias)
    specs += [ParamSpec(a + "kv_norm.weight", (m.kv_lora_rank,), None)]
    specs += _linear(a + "wkv_b", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, tp, "column", False)
    return specs + _linear(a + "wo", m.dim, heads * m.v_head_dim, tp, "row", bias)


def layout_key(config: Config) -> tuple:
    """What the parameter layout depends on (the planner asks for the same layouts many times)."""
    p = config.parallel
    return (repr(config.model), p.tp, p.ep, p.etp, p.pp, p.pp_virtual_stages, p.pp_first_stage_layers,
            p.pp_last_stage_layers, p.dp, p.cp, p.distributed_optimizer, p.split_master_weights, config.train.precision,
            config.train.optimizer_offload, config.train.optimizer_moments_dtype)


_CACHE: dict[tuple, object] = {}  # a pure memo keyed by the layout's values (layout_key): no run's state


def cached(key: tuple, make):
    if key not in _CACHE:
        if len(_CACHE) > 20000:
            _CACHE.clear()
        _CACHE[key] = make()
    return _CACHE[key]


def local_params(config: Config, pp_rank: int = 0) -> list[ParamSpec]:
    """This pipeline rank's parameters, as the parallelize steps leave them (any tp/ep/dp rank)."""
    return cached(("params", pp_rank) + layout_key(config), lambda: _local_params(config, pp_rank))


def _local_params(config: Config, pp_rank: int) -> list[ParamSpec]:
    m, p = config.model, config.parallel
    tp, ep, etp = p.tp, p.ep, p.etp
    hd, d = m.attention_head_dim, m.dim
    layers = stage_layers(config, pp_rank)
    first = pp_rank == 0
    last = pp_rank == p.pp - 1
    specs: list[ParamSpec] = []
    if first or (last and m.mtp_layers):  # the last stage's MTP modules embed too (a tied copy)
        specs.append(ParamSpec("tok_embeddings.weight", (m.vocab_size // tp, d), 0 if tp > 1 else None))
    for i in layers:
        pre = f"layers.{i}." if i < m.num_layers else f"mtp.{i - m.num_layers}.block."
        if i >= m.num_layers:
            mtp = f"mtp.{i - m.num_layers}."
            specs += [ParamSpec(mtp + name, (d,), None) for name in ("enorm.weight", "hnorm.weight", "norm.weight")]
            specs.append(ParamSpec(mtp + "eh_proj.weight", (d, 2 * d), None))
        specs.append(ParamSpec(pre + "attention_norm.weight", (d,), None))
        a = pre + "attention."
        if m.attention == "mla":
            specs += _mla_params(a, m, tp)
        else:
            specs += _linear(a + "wq", m.num_heads * hd, d, tp, "column", m.attention_bias)
            specs += _linear(a + "wk", m.num_kv_heads * hd, d, tp, "column", m.attention_bias)
            specs += _linear(a + "wv", m.num_kv_heads * hd, d, tp, "column", m.attention_bias)
            specs += _linear(a + "wo", d, m.num_heads * hd, tp, "row", m.attention_bias)
        if m.qk_norm:
            specs += [ParamSpec(a + "q_norm.weight", (hd,), None), ParamSpec(a + "k_norm.weight", (hd,), None)]
        specs.append(ParamSpec(pre + "ffn_norm.weight", (d,), None))
        f = pre + "feed_forward."
        if moe_layer_rule(m.moe, i):
            moe = m.moe
            e, hidden = moe.num_experts // ep, (moe.ffn_dim or m.ffn_dim) // etp
            specs.append(ParamSpec(f + "router.weight", (moe.num_experts, d), None))
            w13_dim, w2_dim = (3, 1) if etp > 1 else (None, None)  # expert TP splits the hidden size
            specs += [ParamSpec(f + "experts.w13", (e, d, 2, hidden), w13_dim, True),
                      ParamSpec(f + "experts.w2", (e, hidden, d), w2_dim, True)]
            if moe.num_shared_experts:
                shared = (moe.shared_ffn_dim or moe.num_shared_experts * (moe.ffn_dim or m.ffn_dim))
                s = f + "shared_experts."
                specs += _linear(s + "w1", shared, d, etp, "column", False) + \
                    _linear(s + "w3", shared, d, etp, "column", False) + _linear(s + "w2", d, shared, etp, "row", False)
        else:
            specs += _linear(f + "w1", m.ffn_dim, d, tp, "column", False) + \
                _linear(f + "w3", m.ffn_dim, d, tp, "column", False) + _linear(f + "w2", d, m.ffn_dim, tp, "row", False)
    if last:
        specs.append(ParamSpec("norm.weight", (d,), None))
        if not (m.tie_embeddings and first):  # tied in one stage: one parameter (named once)
            specs.append(ParamSpec("output.weight", (m.vocab_size // tp, d), 0 if tp > 1 else None))
    return specs


def _chunk_numel(spec: ParamSpec, parts: int, rank: int) -> int:
    """Elements of `rank`'s ZeRO-1 chunk (core.parallel.data.chunk_bounds' cut, for one rank)."""
    if parts == 1:
        return spec.numel
    size = spec.shape[spec.zero_dim]
    step = -(-size // parts)
    start = min(rank * step, size)
    return spec.numel // size * (min(size, start + step) - start)


@dataclass
class StateBytes:
    """A rank's persistent memory (bytes)."""

    params: int
    grads: int  # fp32 main-grad buffers
    grad_shards: int  # ZeRO-1 reduce-scatter targets
    masters: int
    moments: int
    param_numel: int
    chunk_numel: int  # elements whose optimizer state this rank holds
    packed: int  # fp32 packed copies of the sharded buckets during the gradient reduction
    gather: int  # parameter-dtype receive buffers of the all-gather after the step
    send: int = 0  # the all-gather's send buffers, which the one-pass AdamW keeps (GPU, ZeRO-1)
    host: int = 0  # host memory of train.optimizer_offload (masters, moments, gradient and weight buffers)

    @property
    def optimizer(self) -> int:
        return self.masters + self.moments

    @property
    def total(self) -> int:
        return self.params + self.grads + self.grad_shards + self.optimizer + self.send


def state_bytes(config: Config, rank: int = 0) -> StateBytes:
    """Parameters, gradients and optimizer state of global rank `rank`, exactly as the trainer
    allocates them (config validated: parallel.dp set)."""
    return cached(("state", rank) + layout_key(config), lambda: _state_bytes(config, rank))


def _state_bytes(config: Config, rank: int) -> StateBytes:
    p = config.parallel
    c = coordinates(config, rank)
    width = PARAM_BYTES[config.train.precision]
    params = grads = shards = masters = moments = numel_all = chunk_all = packed = gather = send = regions = 0
    for spec in local_params(config, c["pp"]):
        size = p.dp * p.cp // p.ep if spec.expert else p.dp * p.cp
        group_rank = c["edp"] if spec.expert else c["dp_cp"]
        sharded = p.distributed_optimizer and size > 1
        chunk = _chunk_numel(spec, size, group_rank) if sharded else spec.numel
        numel_all += spec.numel
        chunk_all += chunk
        params += spec.numel * width
        grads += spec.numel * 4
        regions += _chunk_numel(spec, size, 0) if sharded else spec.numel
        if sharded:
            region = _chunk_numel(spec, size, 0)  # rank 0's chunk: the longest
            shards += region * 4
            packed += size * region * 4
            gather += size * region * width
            send += region * width
        moments += chunk * 2 * MOMENT_BYTES[config.train.optimizer_moments_dtype]
        if width != 4:  # split masters keep only the low halves beside the bf16 weights
            masters += chunk * (2 if p.split_master_weights else 4)
    if config.train.optimizer_offload:
        return StateBytes(params, grads, shards, 0, 0, numel_all, chunk_all, packed, gather, send,
                          offload_host_bytes(chunk_all, regions, config.train.optimizer_moments_dtype))
    return StateBytes(params, grads, shards, masters, moments, numel_all, chunk_all, packed, gather, send)
