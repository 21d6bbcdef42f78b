"""The model's plain building blocks: RMSNorm, rotary positions (with scaling), grouped-query attention, SwiGLU.

They know nothing of parallelism or of how the model is assembled. Every tensor flows flattened
as [tokens, ...] over a packed micro-batch; `AttentionMeta.cu_seqlens` marks the document
boundaries attention must not cross. The parallelize steps rewrite submodules in place (linear
layers, `core_attention`), so head counts are read from tensor shapes, never from the config.
`model_blocks` is the one place that knows where a model keeps its blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.attention import varlen_attention
from core.config import ModelConfig
from core.eager import eager_only
from core.kernels import fused


@dataclass
class AttentionMeta:
    """What the layers need to know about a packed micro-batch besides its hidden states: the
    document boundaries attention must not cross, which MoE layers also read to balance their
    experts per sequence. Made once per micro-batch and handed to every layer as an argument of
    its forward, so a recomputation or a pipeline schedule that runs micro-batches out of order
    always sees the boundaries of the micro-batch it runs."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1] over this rank's tokens
    max_seqlen: int
    extra: dict[str, Any] = field(default_factory=dict)  # context-parallel plans and the like
    doc_lengths: tuple[int, ...] | None = None  # cu_seqlens' segment lengths on the host, if known
    total_tokens: int | None = None  # cu_seqlens[-1] on the host, if known: checks without a device sync
    # bool [T] over this rank's tokens: True for tokens of documents, False for padding (a row's
    # end, the context-parallel split's); None: every token is a document's. MoE layers count and
    # balance these only; everything else runs every token.
    real: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.total_tokens is None and self.doc_lengths is not None:
            self.total_tokens = sum(self.doc_lengths)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's math (also run by the fused head loss on token chunks, core/train/loss.py)."""
    # Normalise in fp32: bf16 mean-of-squares loses too much on long hidden sizes.
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32 on the CPU, scale of cos and sin) for `cfg`'s rotary scaling.

    The same numbers as transformers' rope initialisation for each `model.rope_scaling.type`:
    - none: theta^(-2i/d);
    - linear: those divided by `factor`;
    - llama3: wavelengths 2*pi/f longer than L/low_freq_factor (L the original context) divided
      by `factor`, shorter than L/high_freq_factor kept, in between a blend that moves
      linearly in L/wavelength;
    - yarn: per frequency a blend of f/factor (interpolated) and f (extrapolated), the weight
      ramping over the dimensions where the original context makes between beta_fast and
      beta_slow rotations; cos and sin scaled by `attention_factor` (0: 0.1*ln(factor)+1, or
      the ratio of the two mscale terms when mscale and mscale_all_dim are set).
    """
    r, d, theta = cfg.rope_scaling, cfg.rope_head_dim, cfg.rope_theta
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    inv_freq = 1.0 / theta ** exponents
    if r.type == "none":
        return inv_freq, 1.0
    if r.type == "linear":
        return inv_freq / r.factor, 1.0
    context = r.original_max_position_embeddings
    if r.type == "llama3":
        low_wavelen, high_wavelen = context / r.low_freq_factor, context / r.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
        smooth = (context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        blended = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    # yarn
    if r.attention_factor:
        scale = r.attention_factor
    elif r.mscale and r.mscale_all_dim:
        scale = _yarn_mscale(r.factor, r.mscale) / _yarn_mscale(r.factor, r.mscale_all_dim)
    else:
        scale = _yarn_mscale(r.factor)

    def dimension_at(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return d * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_at(r.beta_fast), dimension_at(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolated = 1 - ramp
    return (1.0 / (r.factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated, scale


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [tokens, head_dim/2] for the true positions of each token (packed or split),
    from `rope_frequencies`' inv_freq and scale."""
    angles = position_ids.float()[:, None] * inv_freq.to(position_ids.device)[None, :]
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class CoreAttention(nn.Module):
    """softmax(q k^T) v within documents; a module so parallel steps can swap or recompute it."""

    # Outside torch.compile: the document boundaries (cu_seqlens length, max_seqlen) change
    # with every packed batch, so a compiled block recompiled on each one until dynamo's
    # recompile limit; the attention kernels are opaque to inductor anyway.
    @eager_only
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        return varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, doc_lengths=meta.doc_lengths)


class Attention(nn.Module):
    """Grouped-query attention: q, k, v projections (optionally with biases), optional RMS norm
    of each q and k head (Qwen3's qk-norm, one gain shared by the heads), rotary, core, output."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = d = cfg.attention_head_dim
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * d, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * d, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * d, bias=bias)
        self.wo = nn.Linear(cfg.num_heads * d, cfg.dim, bias=bias)
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.core_attention = CoreAttention()
        # (q, k, v) of x in one call, where a backend joins the three projections (and the norm
        # before them: core.precision.te_fused.TeNormQKV); None: wq, wk and wv one by one
        self.qkv_projection = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        q, k, v = self.qkv_projection(x) if self.qkv_projection is not None else (self.wq(x), self.wk(x), self.wv(x))
        heads = (-1, self.head_dim)
        q, k, v = q.unflatten(-1, heads), k.unflatten(-1, heads), v.unflatten(-1, heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.core_attention(q, k, v, meta)
        return self.wo(out.flatten(-2))


class SwiGLU(nn.Module):
    """silu(a) * b: a module of its own so recomputation or offload can take the product alone.
    Run eagerly on a GPU it is one Triton pass each way (core.kernels.fused.swiglu); compiled,
    inductor fuses the plain ops itself."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and fused.triton_enabled(a) and a.shape == b.shape \
                and a.dtype == b.dtype:
            return fused.swiglu(a, b)
        return F.silu(a) * b


class FusedSwiGLU(SwiGLU):
    """silu(gate) * up on one [rows, 2 x hidden] input, gate in the first half of each row and up
    in the second: the routed experts' gate and up GEMM output (moe.experts.GroupedExperts). Eager
    on a GPU it is one Triton pass each way whose backward writes ONE [rows, 2 x hidden] gradient
    (core.kernels.fused.swiglu_fused), so the GEMM's backward needs no add of two input gradients.
    A SwiGLU, so recomputation and offload of `swiglu` take it too.

    `row_weights` [rows] (optional): each row's product times its routing weight, in fp32 before
    the one rounding to h13's dtype (the MoE layer's weights applied before the down projection)."""

    def forward(self, h13: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.compiler.is_compiling() and fused.triton_enabled(h13):
            return fused.swiglu_fused(h13, row_weights)
        gate, up = h13.chunk(2, dim=-1)  # chunk's backward is one cat: the gradient stays one tensor
        if row_weights is None:
            return F.silu(gate) * up
        return _WeightedSwiGLU.apply(h13, row_weights)


class _WeightedSwiGLU(torch.autograd.Function):
    """silu(gate) * up * w per row in PyTorch ops (CPU, or Triton off), computed as the Triton
    kernel does (at least fp32, one rounding) and saving what it saves: h13 and the weights."""

    @staticmethod
    def forward(ctx, h13, weights):
        ctx.save_for_backward(h13, weights)
        wide = torch.promote_types(h13.dtype, torch.float32)
        gate, up = h13.to(wide).chunk(2, dim=-1)
        return (F.silu(gate) * up * weights.to(wide).unsqueeze(-1)).to(h13.dtype)

    @staticmethod
    def backward(ctx, grad):
        h13, weights = ctx.saved_tensors
        wide = torch.promote_types(h13.dtype, torch.float32)
        gate, up = h13.to(wide).chunk(2, dim=-1)
        grad = grad.to(wide)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_weights = (grad * silu * up).sum(-1).to(weights.dtype)
        grad = grad * weights.to(wide).unsqueeze(-1)
        grad13 = torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * silu], dim=-1)
        return grad13.to(h13.dtype), grad_weights


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x).

    `chunk_tokens` > 0 (`train.mlp_chunk_tokens`): tiled, `tiled_swiglu` over that many tokens at a
    time, so the [tokens, hidden] intermediates never exist for the whole sequence. A
    tensor-parallel w2 then reduces the tiled partial sums once (`w2.reduce_partial`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.act = SwiGLU()
        self.fused = None  # the whole FFN (and the norm before it) in one call: core.precision.te_fused.TeNormMLP
        self.chunk_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        if self.chunk_tokens and x.shape[0] > self.chunk_tokens:
            out = self._tiled(x)
            reduce = getattr(self.w2, "reduce_partial", None)
            return reduce(out) if reduce is not None else out
        return self.w2(self.act(self.w1(x), self.w3(x)))

    @eager_only  # see tiled_swiglu
    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight, self.chunk_tokens)


def _weight_grad(weight: torch.Tensor, acc: dict, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """Add grad_out^T @ inputs to the weight's gradient: into its fp32 main grad where data
    parallelism gave it one (gradient-accumulation fusion), else into an fp32 sum in `acc`.

    A weight of the fused linears (core.parallel.wgrad) has its main grad zeroed once per step, so
    the product is always added."""
    if getattr(weight, "main_grad_added_in_graph", False):
        fused.add_weight_grad_(weight.main_grad, grad_out, inputs)
        return
    sink = getattr(weight, "main_grad_sink", None)
    if sink is not None:
        sink.write(lambda main_grad, accumulate: fused.matmul_into_(main_grad, grad_out.t(), inputs, accumulate))
    else:
        part = torch.mm(grad_out.t(), inputs).to(torch.promote_types(inputs.dtype, torch.float32))
        acc[weight] = acc[weight].add_(part) if weight in acc else part


class _TiledSwiGLU(torch.autograd.Function):
    """w2(silu(w1 x) * w3 x) chunk by chunk over the tokens; saves x only (the weights are held). The
    backward recomputes each chunk's two projections and takes the three weight gradients and the
    chunk's input gradient by hand (no autograd inside: a weight's gradient arrives once)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, w1, w3, w2, chunk):
        out = x.new_empty(x.shape[0], w2.shape[0])
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            out[rows] = F.linear(F.silu(F.linear(x[rows], w1)) * F.linear(x[rows], w3), w2)
        ctx.save_for_backward(x)
        # The weights are held, not saved: saved tensors come back through the recompute and offload
        # hooks as other tensor objects, without the main_grad / main_grad_sink the backward writes to
        ctx.weights = (w1, w3, w2)
        ctx.chunk = chunk
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        (x,), (w1, w3, w2) = ctx.saved_tensors, ctx.weights
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        x_c, w1_c, w3_c, w2_c = (t.to(dtype) for t in (x, w1, w3, w2))
        grad_x = torch.empty(x.shape, dtype=dtype, device=x.device)
        wide = torch.promote_types(dtype, torch.float32)  # the elementwise part in at least fp32
        sums: dict = {}
        for start in range(0, x.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            xs, g = x_c[rows], grad_out[rows].to(dtype)
            a, b = (xs @ w1_c.t()).to(wide), (xs @ w3_c.t()).to(wide)
            sig = torch.sigmoid(a)
            silu = a * sig
            _weight_grad(w2, sums, g, (silu * b).to(dtype))
            dh = (g @ w2_c).to(wide)
            da = (dh * b * sig * (1 + a * (1 - sig))).to(dtype)
            db = (dh * silu).to(dtype)
            torch.mm(da, w1_c, out=grad_x[rows])
            grad_x[rows] += db @ w3_c
            _weight_grad(w1, sums, da, xs)
            _weight_grad(w3, sums, db, xs)
        # written into the main grads: a zero with all-zero strides, which data parallelism only counts
        grads = [sums[w].to(w.dtype) if w in sums else w.new_zeros(()).expand(w.shape) for w in (w1, w3, w2)]
        return grad_x.to(x.dtype), *grads, None


def tiled_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, chunk: int) -> torch.Tensor:
    """F.linear(silu(x w1^T) * (x w3^T), w2) over `chunk` tokens at a time: the forward and the
    backward hold one chunk's [chunk, hidden] intermediates, never the sequence's.

    Never traced (`FeedForward._tiled` is eager only): in a compiled block the joint graph's common-subexpression pass merged the
    backward's recomputed chunk projections with the forward's, so every chunk's [chunk, hidden]
    products were kept for the backward (+15 GiB a block at 8B and 256K tokens: out of memory);
    the sink's first-write choice is also Python state a traced backward would freeze."""
    return _TiledSwiGLU.apply(x, w1, w3, w2, chunk)


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every transformer block a GPT or pipeline chunk holds: its
    `layers` ModuleDict (`layers.{i}`), then each multi-token prediction module's block
    (`mtp.{k}.block`). The parallelize steps rewrite blocks through this, so an MTP block gets
    the same tensor, context, precision and recompute treatment as the model's own layers."""
    blocks = [(f"layers.{name}", block) for name, block in model.layers.items()]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        blocks += [(f"mtp.{k}.block", module.block) for k, module in enumerate(mtp)]
    return blocks
