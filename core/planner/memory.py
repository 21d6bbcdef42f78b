"""Memory per rank of a config and layout, predicted without building anything.

Three parts, each as the trainer lays it out:

- **State** (`state_bytes`), exact: this rank's parameters (the shards `apply_tp`, `apply_ep`
  and the pipeline split leave, in the parameter dtype), fp32 main grads (one flat buffer per
  bucket, every parameter whole) plus the reduce-scatter target of each ZeRO-1 bucket (rank 0's
  chunk length), and AdamW's fp32 moments and masters over this rank's ZeRO-1 chunks (cut like
  `torch.chunk` along `zero_shard_dim`). `tests/test_planner_memory.py` compares these numbers
  with the tensors that `core.parallelize` allocates on gloo ranks, for every layout of the tiny
  configs.
- **Activations** (`activation_bytes`): what autograd keeps between the forward and the backward
  of one micro-batch, module by module, for every recompute and offload choice (the saved
  tensors of the eager modules: RMSNorm's fp32 copy, rotary's fp32 halves, FlashAttention's q, k,
  v, out and log-sum-exp, the SwiGLU product's inputs, the grouped GEMMs' rows, the loss's fp32
  exponentials), then the pipeline schedule's micro-batches in flight.
- **Transients and slack**: the gradient buckets' packed copies during the reduction, the
  all-gather buffers after the optimizer step, the loss's gradient, the FP8 weight cache, and
  the caching allocator's fragmentation (calibrated).

All sizes in bytes. Ranks are numbered as `core.mesh` does: tp fastest, then cp, dp, pp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.config import Config, grad_accum_steps, moe_layer_rule, recompute_set
from core.parallel.schedules import partition_layers

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


def stage_layers(config: Config, pp_rank: int) -> list[int]:
    """The global layer indices pipeline rank `pp_rank` holds (all its virtual stages)."""
    p, m = config.parallel, config.model
    ranges = partition_layers(m.num_layers, p.pp * p.pp_virtual_stages, p.pp_first_stage_layers, p.pp_last_stage_layers)
    return [i for c in range(p.pp_virtual_stages) for i in ranges[c * p.pp + pp_rank]]


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


def layout_key(config: Config) -> tuple:
    """What the parameter layout depends on (the planner asks for the same layouts many times)."""
    p = config.parallel
    return (repr(config.model), p.tp, p.ep, p.etp, p.pp, p.pp_virtual_stages, p.pp_first_stage_layers,
            p.pp_last_stage_layers, p.dp, p.cp, p.distributed_optimizer, config.train.precision)


_CACHE: dict[tuple, object] = {}


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
    if first:
        specs.append(ParamSpec("tok_embeddings.weight", (m.vocab_size // tp, d), 0 if tp > 1 else None))
    for i in layers:
        pre = f"layers.{i}."
        specs.append(ParamSpec(pre + "attention_norm.weight", (d,), None))
        a = pre + "attention."
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
            w13_dim, w2_dim = (2, 1) if etp > 1 else (None, None)
            specs += [ParamSpec(f + "experts.w1", (e, d, hidden), w13_dim, True),
                      ParamSpec(f + "experts.w3", (e, d, hidden), w13_dim, True),
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
    gather: int  # parameter-dtype buffers of the all-gather after the step

    @property
    def optimizer(self) -> int:
        return self.masters + self.moments

    @property
    def total(self) -> int:
        return self.params + self.grads + self.grad_shards + self.optimizer


def state_bytes(config: Config, rank: int = 0) -> StateBytes:
    """Parameters, gradients and optimizer state of global rank `rank`, exactly as the trainer
    allocates them (config validated: parallel.dp set)."""
    return cached(("state", rank) + layout_key(config), lambda: _state_bytes(config, rank))


def _state_bytes(config: Config, rank: int) -> StateBytes:
    p = config.parallel
    c = coordinates(config, rank)
    width = PARAM_BYTES[config.train.precision]
    params = grads = shards = masters = moments = numel_all = chunk_all = packed = gather = 0
    for spec in local_params(config, c["pp"]):
        size = p.dp * p.cp // p.ep if spec.expert else p.dp * p.cp
        group_rank = c["edp"] if spec.expert else c["dp_cp"]
        sharded = p.distributed_optimizer and size > 1
        chunk = _chunk_numel(spec, size, group_rank) if sharded else spec.numel
        numel_all += spec.numel
        chunk_all += chunk
        params += spec.numel * width
        grads += spec.numel * 4
        if sharded:
            region = _chunk_numel(spec, size, 0)  # rank 0's chunk: the longest
            shards += region * 4
            packed += size * region * 4
            gather += (size + 1) * region * width
        moments += chunk * 8
        if width != 4:
            masters += chunk * 4
    return StateBytes(params, grads, shards, masters, moments, numel_all, chunk_all, packed, gather)


# ---- activations ---------------------------------------------------------------------------

@dataclass
class Shapes:
    """The per-rank sizes one micro-batch's activations are made of."""

    tokens: int  # T: this rank's tokens of the micro-batch (after CP)
    seq_tokens: int  # T_s: tokens of the residual stream (T / tp under sequence parallelism)
    q: int  # this rank's query features (heads x head_dim / tp)
    kv: int
    q_heads: int
    ffn: int  # dense hidden / tp
    routed_tokens: int  # tokens the MoE router sees on this rank
    expert_rows: int  # rows this rank's experts process (routed tokens x top_k, balanced)
    expert_hidden: int
    shared_hidden: int
    experts: int
    vocab: int  # vocab / tp


def shapes(config: Config) -> Shapes:
    m, p, t = config.model, config.parallel, config.train
    tokens = t.micro_batch_size * t.seq_len // p.cp
    sp = p.sequence_parallel and p.tp > 1
    seq_tokens = tokens // p.tp if sp else tokens
    hd = m.attention_head_dim
    moe = m.moe
    routed = tokens if (p.etp > 1 and p.tp > 1) else tokens // p.tp
    hidden = (moe.ffn_dim or m.ffn_dim)
    shared = (moe.shared_ffn_dim or moe.num_shared_experts * hidden) if moe.num_experts else 0
    return Shapes(tokens, seq_tokens, m.num_heads * hd // p.tp, m.num_kv_heads * hd // p.tp, m.num_heads // p.tp,
                  m.ffn_dim // p.tp, routed, routed * moe.top_k if moe.num_experts else 0,
                  hidden // p.etp if moe.num_experts else 0, shared // p.etp, moe.num_experts, m.vocab_size // p.tp)


@dataclass
class LayerActivations:
    """Bytes one block keeps for the backward, by module kind, for one micro-batch."""

    parts: dict[str, int] = field(default_factory=dict)  # module kind -> bytes on the device
    offloaded: int = 0  # bytes sent to host memory

    @property
    def device(self) -> int:
        return sum(self.parts.values())


def norm_saved(tokens: int, width: int, b: int) -> int:
    """What RMSNorm's eager forward keeps: x.float() twice (pow and mul each save their own copy;
    with fp32 x both are x), the rsqrt, and the normalised tensor before the gain (its output is
    counted where the next module saves it)."""
    if b == 4:
        return tokens * width * 8 + 4 * tokens
    return tokens * width * (8 + b) + 4 * tokens


def block_activations(config: Config, layer_id: int, recompute: set[str] | None = None,
                      offload: set[str] | None = None) -> LayerActivations:
    """What one block keeps for the backward of one micro-batch under the recompute and offload
    choices (FlashAttention/cuDNN saving q, k, v, out and the log-sum-exp). Eager blocks: the
    dense parts match autograd's saved tensors exactly (tests/test_planner_memory.py counts
    them on the CPU). Compiled blocks (train.compile): inductor keeps each norm's input and
    rsqrt instead of its fp32 copies and the SwiGLU's a, b and product (measured the same way
    through inductor on the CPU); the routed experts stay outside the graphs. MoE parts assume
    balanced routing."""
    m, p, t = config.model, config.parallel, config.train
    recompute = recompute_set(t) if recompute is None else recompute
    offload = set(t.offload_modules) if offload is None else offload
    s = shapes(config)
    b = PARAM_BYTES[t.precision]
    T, Ts, d = s.tokens, s.seq_tokens, m.dim
    sp = p.sequence_parallel and p.tp > 1
    compiled = t.compile
    if "block" in recompute:
        return LayerActivations({"block": Ts * d * b})
    moe_layer = moe_layer_rule(m.moe, layer_id)
    inside_glu = 3 if compiled else 4  # SwiGLU in a compiled block: a, b and the product
    parts: dict[str, int] = {}
    # Norms: the inputs under recompute (the residual stream, kept by the checkpoint), else
    # their internals. The norm's output is the next module's saved input (below), or under
    # sequence parallelism the input of an all-gather that saves nothing.
    if "norms" in recompute:
        parts["norms"] = 2 * Ts * d * b
    else:
        parts["norms"] = 2 * (Ts * d * b + 4 * Ts if compiled else norm_saved(Ts, d, b))
    # Attention: wq/wk/wv's input (the gathered stream under SP, else the norm's output, which
    # recomputed norms drop), qk-norms, then the core's q, k, v, out (= wo's input) and lse.
    # Rotary keeps nothing per layer: its products save only the cos/sin tables.
    attn_in = T * d * b
    qk = 0
    if m.qk_norm:
        heads = s.q // m.attention_head_dim + s.kv // m.attention_head_dim
        qk = T * (s.q + s.kv) * b + (4 * T * heads if compiled else 0) if "norms" in recompute or compiled \
            else norm_saved(T * heads, m.attention_head_dim, b)
    lse = 4 * T * s.q_heads
    qkv = T * (s.q + 2 * s.kv) * b
    out = T * s.q * b
    if "attention" in recompute:
        parts["attention"] = attn_in
    else:
        dropped_in = "norms" in recompute and not sp
        parts["attention"] = (0 if dropped_in else attn_in) + qk + qkv + out + (0 if "attention_core" in recompute else lse)
    # Feed-forward.
    if moe_layer:
        moe = m.moe
        R, Tr = s.expert_rows, s.routed_tokens
        glu = 2 if "swiglu" in recompute else 4  # SwiGLU keeps a, b (+ silu(a) and the product)
        if "mlp" in recompute:
            parts["mlp"] = Ts * d * b
        else:
            norm_out = 0 if "norms" in recompute else Tr * d * b  # shared experts' input
            router = Tr * d * 4 + Tr * s.experts * 4 * 3 + Tr * moe.top_k * 16  # fp32 x, logits, scores, top-k
            dispatch = R * d * b + R * 16  # permuted rows + orders
            combine = R * d * b + Tr * moe.top_k * 4
            shared = Tr * s.shared_hidden * b * (glu if "swiglu" in recompute else inside_glu) if s.shared_hidden else 0
            parts["mlp"] = norm_out + router + dispatch + combine + shared
            parts["moe_experts"] = 0 if "moe_experts" in recompute else R * s.expert_hidden * b * glu
    else:
        H = s.ffn
        if "mlp" in recompute:
            parts["mlp"] = T * d * b  # the gathered input (SP: gathered before the module runs)
        else:
            mlp_in = 0 if ("norms" in recompute and not sp) else T * d * b
            parts["mlp"] = mlp_in + T * H * b * (2 if "swiglu" in recompute else inside_glu)
    offloaded = 0
    for kind in offload:
        # What the module saves inside its own forward moves; what a module outside saves of its
        # output (wo of the core's out, w2 of the SwiGLU product, the consumers of the norms)
        # stays on the device.
        if kind == "block":
            share = {k: v for k, v in parts.items()}
        elif kind == "attention":
            share = {"attention": parts["attention"]}
        elif kind == "mlp":
            share = {k: parts[k] for k in ("mlp", "moe_experts") if k in parts}
        elif kind == "attention_core":
            share = {"attention": min(parts["attention"], qkv + lse)}
        elif kind == "norms":
            share = {"norms": parts["norms"]}
        elif kind == "swiglu":
            rows, hidden = (s.expert_rows, s.expert_hidden) if moe_layer else (T, s.ffn)
            key = "moe_experts" if moe_layer else "mlp"
            share = {key: min(parts.get(key, 0), 3 * rows * hidden * b)}
        elif kind == "moe_experts" and moe_layer:
            share = {"moe_experts": parts["moe_experts"]}
        else:
            share = {}
        for key, value in share.items():
            parts[key] -= value
            offloaded += value
    return LayerActivations(parts, offloaded)


def rope_tables(config: Config) -> int:
    """cos and sin, fp32 [T, head_dim/2] each: built once per model chunk and saved by every rotary."""
    return 4 * shapes(config).tokens * config.model.attention_head_dim


def compiled_loss(config: Config) -> bool:
    """The loss runs compiled (train.compile without vocab-parallel logits, core/loss.py)."""
    return config.train.compile and config.parallel.tp == 1


def head_activations(config: Config) -> int:
    """The last stage's final norm, the head's input, and the loss's saved tensors: eager, the
    fp32 exponentials [T, V/tp] and per-token sums, targets and masks; compiled, the logits in
    their own dtype and a log-sum-exp per token."""
    s, m, t = shapes(config), config.model, config.train
    b = PARAM_BYTES[t.precision]
    loss = s.tokens * s.vocab * b + 16 * s.tokens if compiled_loss(config) else s.tokens * s.vocab * 4 + 18 * s.tokens
    return norm_saved(s.seq_tokens, m.dim, b) + s.tokens * m.dim * b + loss


def loss_transient(config: Config) -> int:
    """Alive at the loss besides the saved tensors: the logits (forward; eager, next to their
    fp32 shifted copy) or their gradient (backward), then the head's weight gradient in the
    parameter dtype before it is added into the fp32 main grad."""
    s, t, m = shapes(config), config.train, config.model
    b = PARAM_BYTES[t.precision]
    return s.tokens * s.vocab * b + s.vocab * m.dim * b


def in_flight(config: Config, pp_rank: int, num_micro: int) -> float:
    """Micro-batches whose activations this pipeline rank holds at its peak, in units of one
    micro-batch through all its layers (1F1B: pp - rank; interleaved: chunks of 1/v)."""
    p = config.parallel
    if p.pp == 1:
        return 1.0
    if p.pp_schedule == "1f1b":
        return float(min(p.pp - pp_rank, num_micro))
    v = p.pp_virtual_stages
    warmup = min((p.pp - pp_rank - 1) * 2 + (v - 1) * p.pp, num_micro * v)
    return min(warmup + 1, num_micro * v) / v


def fp8_cache_bytes(config: Config, pp_rank: int = 0) -> int:
    """The FP8 weight cache (kept only with several micro-batches per step, core/parallelize.py):
    forward and transposed e4m3 copies of each block GEMM weight with their 128x128 scales."""
    t = config.train
    if t.precision != "fp8" or not t.fp8_weight_cache or grad_accum_steps(config) == 1:
        return 0
    numel = sum(s.numel for s in local_params(config, pp_rank) if len(s.shape) >= 2 and s.name.startswith("layers.")
                and "router" not in s.name)
    return numel * 2 + numel // (128 * 128) * 8


@dataclass(frozen=True)
class Allocator:
    """What the caching allocator and the libraries add to the tensors (calibrated per GPU kind)."""

    fragmentation: float = 0.05  # max_memory_reserved / max_memory_allocated - 1 at the peak
    context_bytes: int = 640 << 20  # CUDA context, cuBLAS/cuDNN workspaces: outside the allocator
    nccl_bytes_per_group: int = 160 << 20  # each communicator's channels and buffers (NCCL's own)


def comm_groups(config: Config) -> int:
    """Communicators of size > 1 a rank uses (NCCL creates each on first use)."""
    p = config.parallel
    sizes = [p.tp, p.cp, p.dp * p.cp, p.pp]
    if config.model.moe.num_experts:
        sizes += [p.ep, p.dp * p.cp // p.ep]
    return sum(1 for n in sizes if n > 1)


@dataclass
class MemoryEstimate:
    """A rank's predicted peak (bytes) and its parts."""

    rank: int
    state: StateBytes
    activations: int  # saved for the backward at the peak (all micro-batches in flight)
    offloaded: int  # host bytes
    transient: int  # alive at the peak besides the saved tensors (loss, recompute, buffers)
    fp8_cache: int
    per_layer: dict[str, int]  # one micro-batch, this rank's layers, by module kind
    reduction: int  # ZeRO-1's packed gradients or the all-gather buffers, after the backward
    allocator: Allocator = field(default_factory=Allocator)
    groups: int = 0

    @property
    def peak_allocated(self) -> int:
        """What torch.cuda.max_memory_allocated reads: the state plus the larger of the backward's
        peak and the gradient reduction's buffers (which fill as the activations drain)."""
        return self.state.total + self.fp8_cache + max(self.activations + self.transient, self.reduction)

    @property
    def peak_reserved(self) -> int:
        """What torch.cuda.max_memory_reserved reads."""
        return int(self.peak_allocated * (1 + self.allocator.fragmentation))

    @property
    def device_total(self) -> int:
        """All the process holds on the GPU: reserved + context + communicators (what must fit)."""
        return self.peak_reserved + self.allocator.context_bytes + self.groups * self.allocator.nccl_bytes_per_group

    def breakdown(self) -> dict[str, float]:
        """GiB by part."""
        gib = 2 ** 30
        s = self.state
        return {"params": s.params / gib, "grads": (s.grads + s.grad_shards) / gib, "optimizer": s.optimizer / gib,
                "fp8_cache": self.fp8_cache / gib, "activations": self.activations / gib,
                "transient": self.transient / gib, "reduction": self.reduction / gib,
                "other": (self.device_total - self.peak_allocated) / gib, "host_offload": self.offloaded / gib}


def estimate_memory(config: Config, rank: int | None = None, allocator: Allocator | None = None) -> MemoryEstimate:
    """The peak of global rank `rank` (default: the larger of the first pipeline stage's rank 0,
    which holds the most micro-batches in flight, and the last stage's, which holds the loss)."""
    p = config.parallel
    allocator = allocator or Allocator()
    if rank is None:
        candidates = [0] if p.pp == 1 else [0, (p.pp - 1) * p.tp * p.cp * p.dp]
        return max((estimate_memory(config, r, allocator) for r in candidates), key=lambda e: e.device_total)
    c = coordinates(config, rank)
    state = state_bytes(config, rank)
    t, m = config.train, config.model
    b = PARAM_BYTES[t.precision]
    s = shapes(config)
    layers = stage_layers(config, c["pp"])
    recompute, offload = recompute_set(t), set(t.offload_modules)
    per_micro, offloaded, per_layer, rebuilt, brought_back = 0, 0, {}, 0, 0
    kinds: dict[bool, tuple[LayerActivations, int]] = {}  # blocks differ only by dense / MoE
    for i in layers:
        kind = moe_layer_rule(m.moe, i)
        if kind not in kinds:
            act = block_activations(config, i, recompute, offload)
            kinds[kind] = act, block_activations(config, i, set(), set()).device if recompute else act.device
        act, plain = kinds[kind]
        per_micro += act.device
        offloaded += act.offloaded
        brought_back = max(brought_back, act.offloaded)
        rebuilt = max(rebuilt, plain - act.device)  # the backward rebuilds one block's saved tensors at a time
        for k, v in act.parts.items():
            per_layer[k] = per_layer.get(k, 0) + v
    chunks = p.pp_virtual_stages
    per_micro += chunks * rope_tables(config)
    if p.pp > 1:  # each chunk keeps its received input and its output until the backward
        per_micro += chunks * 2 * s.seq_tokens * m.dim * b
    last = c["pp"] == p.pp - 1
    flight = in_flight(config, c["pp"], grad_accum_steps(config))
    activations = int(flight * per_micro) + (head_activations(config) if last else 0)
    # Besides the saved tensors, the largest need of the forward and backward: the loss, a
    # recomputed block, offloaded tensors brought back (one module ahead), the ring's KV blocks.
    ring = 2 * 2 * s.tokens * s.kv * b if p.cp > 1 else 0
    transient = max(loss_transient(config) if last else 0, rebuilt, 2 * brought_back) + ring
    cache = fp8_cache_bytes(config, c["pp"])
    return MemoryEstimate(rank, state, activations, int(flight * offloaded), transient, cache, per_layer,
                          max(state.packed, state.gather), allocator, comm_groups(config))
