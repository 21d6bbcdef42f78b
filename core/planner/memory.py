"""Peak memory per rank of a config and layout, predicted without building anything.

- **State** (`core.planner.state`): parameters, gradients, optimizer state, exact; under ZeRO-1
  also the all-gather's send buffers, which the one-pass AdamW keeps between steps on a GPU.
  With `train.optimizer_offload` the optimizer state is host memory (`host_optimizer` in the
  breakdown), not device memory.
- **Activations** (`block_activations`, `head_activations`): what autograd keeps between the
  forward and the backward of one micro-batch, module by module, for every recompute and offload
  choice (eager RMSNorm's two fp32 copies, FlashAttention's q, k, v, out and log-sum-exp, the
  projections' inputs, SwiGLU's four tensors, the MoE layer's router, rows and orders, the
  loss's fp32 exponentials; what compiled blocks keep instead), then the pipeline schedule's
  micro-batches in flight (`in_flight`).
- **Transients**: the loss, a recomputed block, offloaded tensors brought back, the ring's KV
  blocks; the gradient reduction's packed copies and the all-gather's receive buffers after the step,
  which fill as the activations drain; the FP8 weight cache.
- **Around the tensors** (`Allocator`, calibrated): the caching allocator's fragmentation, the
  CUDA context, the NCCL communicators.

All sizes in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.config import Config
from core.rules import FUSED_CHUNK_ELEMENTS, grad_accum_steps, moe_layer_rule, offloaded_checkpoints, recompute_set
from core.validation import cp_a2a_size
from core.planner.state import (PARAM_BYTES, StateBytes, coordinates, local_params, offloaded_input_layers,
                                recomputed_layers, stage_layers, state_bytes)


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
    a2a: int = 1  # all-to-all CP's group (parallel.cp_comm "a2a": cp, "a2a+ring": cp_a2a; the ring: 1)
    kv_core: int = 0  # k (or v) features per local token the attention core holds: kv, or after the
    # all-to-all kv with its heads repeated to a multiple of the group (core/parallel/ulysses.py)


def a2a_kv_features(config: Config) -> int:
    """This rank's k (or v) features per token as its attention core sees them, per local token:
    under all-to-all CP, grouped-query heads that the group does not divide are repeated up to
    lcm(heads, group) (MLA: one key/value head per query head, nothing repeated)."""
    m, p = config.model, config.parallel
    k = cp_a2a_size(config) if p.cp > 1 else 1
    if m.attention == "mla":
        return m.num_heads // p.tp * m.attention_head_dim
    heads = m.num_kv_heads // p.tp
    return (math.lcm(heads, k) if heads % k else heads) * m.attention_head_dim


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
                  hidden // p.etp if moe.num_experts else 0, shared // p.etp, moe.num_experts, m.vocab_size // p.tp,
                  cp_a2a_size(config) if p.cp > 1 else 1, a2a_kv_features(config))


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
                      offload: set[str] | None = None, inputs_offloaded: bool = True) -> LayerActivations:
    """What one block keeps for the backward of one micro-batch under the recompute and offload
    choices (FlashAttention/cuDNN saving q, k, v, out and the log-sum-exp). Eager blocks: the
    dense parts match autograd's saved tensors exactly (tests/test_planner_memory.py counts
    them on the CPU). Compiled blocks (train.compile): inductor keeps each norm's input and
    rsqrt instead of its fp32 copies and the SwiGLU's a, b and product (measured the same way
    through inductor on the CPU); the routed experts stay outside the graphs. MoE parts assume
    balanced routing. `inputs_offloaded=False`: a block past train.offload_checkpoints_layers,
    whose checkpoint inputs stay on the device."""
    m, p, t = config.model, config.parallel, config.train
    recompute = recompute_set(t) if recompute is None else recompute
    offload = set(t.offload_modules) if offload is None else offload
    inputs_out = offloaded_checkpoints(config) & recompute if inputs_offloaded else set()  # inputs in host memory
    s = shapes(config)
    b = PARAM_BYTES[t.precision]
    T, Ts, d = s.tokens, s.seq_tokens, m.dim
    sp = p.sequence_parallel and p.tp > 1
    compiled = t.compile
    if "block" in recompute:
        if "block" in inputs_out:
            return LayerActivations({"block": 0}, Ts * d * b)
        return LayerActivations({"block": Ts * d * b})
    moe_layer = moe_layer_rule(m.moe, layer_id)
    inside_glu = 3 if compiled else 4  # SwiGLU in a compiled block: a, b and the product
    parts: dict[str, int] = {}
    # Norms: the inputs under recompute (the residual stream, kept by the checkpoint), else
    # their internals. The norm's output is the next module's saved input (below), or under
    # sequence parallelism the input of an all-gather that saves nothing.
    # Under `mlp` the feed-forward's norm sits inside its checkpoint (its input is the mlp's).
    norms = 1 if "mlp" in recompute else 2
    if "norms" in recompute:
        parts["norms"] = norms * Ts * d * b
    else:
        parts["norms"] = norms * (Ts * d * b + 4 * Ts if compiled else norm_saved(Ts, d, b))
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
    # All-to-all CP: the core keeps what the all-to-all brought (k and v with repeated heads) and
    # its own output, which the all-to-all back copies into wo's input: one [T, q] more.
    core = qkv if s.a2a == 1 or "attention_core" in recompute else T * (s.q + 2 * s.kv_core) * b + out
    if "attention" in recompute:
        parts["attention"] = attn_in
    elif m.attention == "mla":
        dropped_in = "norms" in recompute and not sp
        qkv, parts["attention"] = _mla_saved(config, T, b, recompute, compiled)
        parts["attention"] += 0 if dropped_in else attn_in
    else:
        dropped_in = "norms" in recompute and not sp
        parts["attention"] = (0 if dropped_in else attn_in) + qk + core + out + (0 if "attention_core" in recompute else lse)
    # Feed-forward.
    if moe_layer:
        moe = m.moe
        R, Tr = s.expert_rows, s.routed_tokens
        glu = 2 if "swiglu" in recompute else 4  # SwiGLU keeps a, b (+ silu(a) and the product)
        # Tiled (train.mlp_chunk_tokens): the experts keep their input rows alone (counted with
        # the dispatch), the shared experts their input (the norm's output).
        tiled = t.mlp_chunk_tokens and T > t.mlp_chunk_tokens
        if "mlp" in recompute:
            parts["mlp"] = Ts * d * b
        else:
            norm_out = 0 if "norms" in recompute else Tr * d * b  # shared experts' input
            router = Tr * d * 4 + Tr * s.experts * 4 * 3 + Tr * moe.top_k * 16  # fp32 x, logits, scores, top-k
            dispatch = R * d * b + R * 16  # permuted rows + orders
            # The routing weights go into the experts' SwiGLU (which then keeps gate, up and the
            # weights, and w2 the product); the combine only sums and keeps no rows.
            combine = Tr * moe.top_k * 4
            experts_glu = 3 if "swiglu" not in recompute else glu
            shared = Tr * s.shared_hidden * b * (glu if "swiglu" in recompute else inside_glu) \
                if s.shared_hidden and not tiled else 0
            parts["mlp"] = norm_out + router + dispatch + combine + shared
            parts["moe_experts"] = 0 if "moe_experts" in recompute or tiled else R * s.expert_hidden * b * experts_glu
    else:
        H = s.ffn
        if "mlp" in recompute:
            parts["mlp"] = Ts * d * b  # the norm's input (SP: gathered inside the checkpoint)
        else:
            mlp_in = 0 if ("norms" in recompute and not sp) else T * d * b
            # Tiled (train.mlp_chunk_tokens): its input alone; each chunk's intermediates live in one pass.
            tiled = t.mlp_chunk_tokens and T > t.mlp_chunk_tokens
            parts["mlp"] = mlp_in + (0 if tiled else T * H * b * (2 if "swiglu" in recompute else inside_glu))
    offloaded = 0
    # The checkpoint inputs of a recomputed attention (its norm's output) or core (q, k, v).
    moved = attn_in if "attention" in inputs_out else qkv if "attention_core" in inputs_out else 0
    parts["attention"] -= moved
    offloaded += moved
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


def checkpoint_host_buffers(config: Config, pp_rank: int = 0) -> dict[int, int]:
    """The host buffers train.offload_checkpoints keeps for pipeline rank `pp_rank`, {bytes: count}:
    each offloaded checkpoint input of one micro-batch (a block's [tokens, dim]; the attention's
    input; q, k and v) per offloading block (`offloaded_input_layers`), times the micro-batches in
    flight there."""
    kinds = offloaded_checkpoints(config)
    if not kinds:
        return {}
    t, m = config.train, config.model
    s, b = shapes(config), PARAM_BYTES[t.precision]
    if "block" in kinds:
        sizes = [s.seq_tokens * m.dim * b]
    elif "attention" in kinds:
        sizes = [s.tokens * m.dim * b]
    else:
        sizes = [s.tokens * s.q * b, s.tokens * s.kv * b, s.tokens * s.kv * b]
    blocks = len(offloaded_input_layers(config, pp_rank))
    count = math.ceil(in_flight(config, pp_rank, grad_accum_steps(config)) * blocks)
    out: dict[int, int] = {}
    for nbytes in sizes:
        out[nbytes] = out.get(nbytes, 0) + count
    return out


def _mla_saved(config: Config, T: int, b: int, recompute: set[str], compiled: bool) -> tuple[int, int]:
    """Multi-head latent attention without its input: (the core's q, k and v; everything the
    sub-layer keeps). The latent norms keep their internals and
    the up-projections their normalised inputs; the core keeps q, k, v (query/key heads of nope +
    rope features, value heads of v_head_dim, a view of wkv_b's whole output), its output (wo's
    input) and the log-sum-exp.
    Under `mla_up` one checkpoint from the latents to the core's output keeps only the latents
    (the query latent, or the shared input when there is none, and the key/value latent with the
    rotary key) and the output."""
    m, p = config.model, config.parallel
    heads = m.num_heads // p.tp
    out = T * heads * m.v_head_dim * b
    if "mla_up" in recompute:
        return 0, T * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * b + out
    latents = 0
    # The norm's internals (recomputed: its input, a view of the down-projection's whole output,
    # rotary key included), and its output, the up-projection's input.
    for width, whole in ((m.q_lora_rank, m.q_lora_rank), (m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim)):
        if width:
            kept = (T * width * b + 4 * T if compiled else T * whole * b if "norms" in recompute
                    else norm_saved(T, width, b))
            latents += kept + T * width * b
    # v is a view of wkv_b's output [T, heads, nope + v], whose whole storage it keeps alive;
    # under all-to-all CP the core keeps the copies the all-to-all made instead, and its own output.
    qkv = T * heads * (2 * m.attention_head_dim + m.qk_nope_head_dim + m.v_head_dim) * b
    lse = 0 if "attention_core" in recompute else 4 * T * heads
    a2a = p.cp > 1 and cp_a2a_size(config) > 1 and "attention_core" not in recompute
    core = T * heads * (2 * m.attention_head_dim + m.v_head_dim) * b + out if a2a else qkv
    return qkv, latents + core + lse + out


def rope_tables(config: Config) -> int:
    """cos and sin, fp32 [T, rotary features/2] each: built once per model chunk and saved by every rotary."""
    return 4 * shapes(config).tokens * config.model.rope_head_dim


def compiled_loss(config: Config) -> bool:
    """The loss runs compiled (train.compile without vocab-parallel logits, core/train/loss.py)."""
    return config.train.compile and config.parallel.tp == 1


def head_activations(config: Config) -> int:
    """The last stage's final norm, the head's input, and the loss's saved tensors: eager, the
    fp32 exponentials [T, V/tp] and per-token sums, targets and masks; compiled, the logits in
    their own dtype and a log-sum-exp per token. `train.fused_loss` runs the final norm inside
    its chunks (core/train/loss.py) and keeps only the gradient of the norm's input [T, dim], in
    the hidden state's dtype (all T tokens: under sequence parallelism the head's input is
    gathered before the norm), and the gain's fp32 gradient [dim], in place of the norm's fp32
    copies, the head's input and the loss's tensors."""
    s, m, t = shapes(config), config.model, config.train
    b = PARAM_BYTES[t.precision]
    if t.fused_loss:
        head = s.tokens * m.dim * b + 4 * m.dim
    else:
        if compiled_loss(config):
            loss = s.tokens * s.vocab * b + 16 * s.tokens
        else:
            loss = s.tokens * s.vocab * 4 + 18 * s.tokens
        head = norm_saved(s.seq_tokens, m.dim, b) + s.tokens * m.dim * b + loss
    # Multi-token prediction: the head and loss once more per depth, and each depth's two input
    # norms and the [T, 2*dim] input of its projection (its block is among the stage's layers).
    mtp = m.mtp_layers * (2 * norm_saved(s.seq_tokens, m.dim, b) + 2 * s.seq_tokens * m.dim * b)
    return (1 + m.mtp_layers) * head + mtp


def loss_transient(config: Config) -> int:
    """Alive at the loss besides the saved tensors: the logits (forward; eager, next to their
    fp32 shifted copy) or their gradient (backward), then the head's weight gradient in the
    parameter dtype before it is added into the fp32 main grad. `train.fused_loss`: one chunk
    of logits and their gradient (compiled: both in the parameter dtype; eager, about: with the
    fp32 copy and three fp32 intermediates of the softmax), and of the folded norm's rows, about
    six fp32 and two parameter-dtype copies; no weight gradient (it goes into the main grad in
    the GEMM). (Its backward rescales the kept gradient 2^26 elements at a time: less than the
    forward's chunk.)"""
    s, t, m = shapes(config), config.train, config.model
    b = PARAM_BYTES[t.precision]
    if t.fused_loss:
        chunk = max(1, min(s.tokens, FUSED_CHUNK_ELEMENTS // s.vocab))
        norm = chunk * m.dim * (6 * 4 + 2 * b)
        return chunk * s.vocab * (2 * b if compiled_loss(config) else 2 * b + 4 * 4) + norm
    return s.tokens * s.vocab * b + s.vocab * m.dim * b


def tiled_mlp_transient(config: Config) -> int:
    """`train.mlp_chunk_tokens`: one chunk's intermediates (a dense SwiGLU's, or the routed experts'
    over the chunk's rows), at their most in the backward, about:
    a, b, sigmoid, silu, the gradient of the product and two temporaries in fp32, four [chunk,
    hidden] tensors in the parameter dtype (core/layers.py `_TiledSwiGLU`)."""
    t, s = config.train, shapes(config)
    if not t.mlp_chunk_tokens or s.tokens <= t.mlp_chunk_tokens:
        return 0
    per_hidden = 7 * 4 + 4 * PARAM_BYTES[t.precision]
    dense = t.mlp_chunk_tokens * max(s.ffn or 0, s.shared_hidden or 0) * per_hidden
    # The routed experts' chunk: the rows of that many tokens (top_k each), the same intermediates.
    experts = t.mlp_chunk_tokens * config.model.moe.top_k * s.expert_hidden * per_hidden if s.expert_hidden else 0
    return max(dense, experts)


def attention_backward_scratch(config: Config) -> int:
    """What the attention kernels' backward takes beyond its inputs and gradients: 8 bytes per
    query element (token x head x head dim) on an H200, FlashAttention varlen and cuDNN alike
    (`python -m bench.attention_kernels --mode memory`: 8.03 at 128K-512K tokens, 16 heads, 4
    key/value heads), which is an fp32 query-gradient accumulator and the key/value gradients at
    the query heads' count. It lives while a block's backward, recomputed or not, holds the
    block's saved tensors."""
    s = shapes(config)
    return s.tokens * s.q * 8


EAGER_NORM_BACKWARD_FP32 = 5  # fp32 [tokens, dim] temporaries at the peak of rms_norm's autograd backward


def attention_backward_gradients(config: Config) -> int:
    """The gradients alive in the attention core's backward, beside its saved tensors and scratch:
    of its output, of q, k and v (in the parameter dtype), and the residual stream's."""
    s, b = shapes(config), PARAM_BYTES[config.train.precision]
    return s.tokens * (2 * s.q + 2 * s.kv) * b + s.seq_tokens * config.model.dim * b


def eager_norm_backward(config: Config, rebuilt: bool) -> int:
    """The backward of an eager block's RMSNorm (core/layers.py rms_norm, unfused), where an eager
    long-sequence step peaks. Its own temporaries peak at five fp32 [tokens, dim] tensors, in the
    pow's gradient (counted on the CPU: tests/test_planner_memory.py). Beside them the H200's
    allocator trace (`bench.long_context`'s ~1B model, 4 blocks, full recompute, 2^18 and 2^19
    tokens: 8 fp32 and 8 bf16 [T, d] tensors at the peak, the head's kept gradient among them)
    shows 13 parameter-dtype [T, d] tensors' worth of a rebuilt block's: its input, the norm's
    fp32 copies, the gradients flowing (residual and norm output). Not rebuilt, the saved tensors
    are counted with the activations: the two gradients alone. Compiled blocks fuse the norm: 0."""
    t, s = config.train, shapes(config)
    if t.compile:
        return 0
    b = PARAM_BYTES[t.precision]
    rows = s.seq_tokens * config.model.dim
    return rows * (EAGER_NORM_BACKWARD_FP32 * 4 + (13 if rebuilt else 2) * b)


def cp_transient(config: Config) -> int:
    """Context parallelism's buffers beside the saved tensors: the ring's K/V blocks in flight
    (two blocks of k and v, forward; their gradients too in the backward); under all-to-all CP
    the all-to-alls' send and receive copies of q, k, v (or their gradients), and a ring over
    the ring groups passes the all-to-all share's K/V (k, v with their repeated heads)."""
    p, s = config.parallel, shapes(config)
    if p.cp == 1:
        return 0
    b = PARAM_BYTES[config.train.precision]
    if s.a2a == 1:
        return 2 * 2 * s.tokens * s.kv * b
    out = 2 * s.tokens * (s.q + 2 * s.kv_core) * b
    if p.cp // s.a2a > 1:
        out += 2 * 2 * s.tokens * s.kv_core * b
    return out


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
    """The FP8 weight cache (kept only with several micro-batches per step, core/train/parallelize.py):
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
        return {"params": (s.params + s.send) / gib, "grads": (s.grads + s.grad_shards) / gib, "optimizer": s.optimizer / gib,
                "fp8_cache": self.fp8_cache / gib, "activations": self.activations / gib,
                "transient": self.transient / gib, "reduction": self.reduction / gib,
                "other": (self.device_total - self.peak_allocated) / gib, "host_offload": self.offloaded / gib,
                "host_optimizer": s.host / gib}


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
    layers, recomputing = stage_layers(config, c["pp"]), recomputed_layers(config, c["pp"])
    inputs_out = offloaded_input_layers(config, c["pp"])
    chosen, offload = recompute_set(t), set(t.offload_modules)
    per_micro, offloaded, per_layer, rebuilt, rebuilt_attention, brought_back = 0, 0, {}, 0, 0, 0
    # Blocks differ by dense / MoE, recomputed, checkpoint inputs offloaded.
    kinds: dict[tuple[bool, bool, bool], tuple[LayerActivations, int, int]] = {}
    for i in layers:
        kind = moe_layer_rule(m.moe, i), i in recomputing, i in inputs_out
        recompute = chosen if kind[1] else set()
        if kind not in kinds:
            act = block_activations(config, i, recompute, offload, inputs_offloaded=kind[2])
            plain = block_activations(config, i, set(), set()) if recompute else act
            # By the attention's backward the feed-forward's tensors and its norm's are gone.
            attention_part = plain.parts["attention"] + plain.parts["norms"] // 2 if recompute else act.device
            kinds[kind] = act, plain.device, attention_part
        act, plain_bytes, attention_part = kinds[kind]
        per_micro += act.device
        offloaded += act.offloaded
        brought_back = max(brought_back, act.offloaded)
        rebuilt = max(rebuilt, plain_bytes - act.device)  # the backward rebuilds one block's saved tensors at a time
        rebuilt_attention = max(rebuilt_attention, max(0, attention_part - act.device))
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
    # recomputed block, offloaded tensors brought back (one module ahead), an eager norm's
    # backward, the ring's KV blocks (or the all-to-alls' copies), a tiled MLP's chunk.
    # The feed-forward's backward: the rebuilt block, the residual stream's gradient and a tiled
    # MLP's chunk; the attention's: its share of the block, its gradients and the kernel's scratch;
    # then the first norm's (eager).
    norms_rebuilt = bool(recomputing) and bool(chosen & {"block", "norms", "mlp", "attention"})
    at_attention = rebuilt_attention + attention_backward_gradients(config) + attention_backward_scratch(config)
    transient = max(max(loss_transient(config) if last else 0, rebuilt + s.seq_tokens * m.dim * b,
                        2 * brought_back) + tiled_mlp_transient(config),
                    at_attention, eager_norm_backward(config, norms_rebuilt)) + cp_transient(config)
    cache = fp8_cache_bytes(config, c["pp"])
    return MemoryEstimate(rank, state, activations, int(flight * offloaded), transient, cache, per_layer,
                          max(state.packed, state.gather), allocator, comm_groups(config))
