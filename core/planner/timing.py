"""Step time of a config and layout, from a calibration table (`core.planner.calibration`).

One micro-batch through one pipeline rank's layers, forward and backward, is a sum of:

- GEMMs (rates by shape; backward = the dgrad and wgrad products of each forward one), the
  routed experts' grouped GEMMs, causal attention by document length (every row taken as one
  document: the upper bound of a packed row's attention) divided over the CP ranks;
- memory-bound passes of the eager modules (norms, rotary, SwiGLU, residual adds, the loss, the
  MoE permutations, the fp32 main-grad accumulation), by bytes;
- the communication on the critical path: tensor parallelism's all-gathers / reduce-scatters
  (or all-reduces) around every sub-layer, expert parallelism's all-to-alls (the dispatch less
  what the shared experts' side stream hides) and its host sync on the split sizes, the CP
  ring's KV exchange beyond what the blocks' compute hides, activation offload beyond what a
  block's compute hides;
- recomputation: the forward of every recomputed module again in the backward.

A micro-batch never takes less than the host needs to issue it (`host_us_per_block`).
The step: 1F1B takes (m + pp - 1) micro-batch times of the slowest stage, interleaving
(m + (pp - 1)/v), plus the point-to-point sends; then the gradient reduction as the trainer
runs it: with pp = 1 the buckets launch during the last micro-batch's backward in bucket order
as their gradients complete (simulated bucket by bucket, core/parallel/data.py's bucketing),
with pp > 1 all of them after the schedule (`no_sync` over the whole pipeline); then the
clip norm, fused AdamW over this rank's ZeRO-1 chunks, and the parameter all-gather.

Communication inside a node uses the NVLink table, a group whose ranks span nodes the network
table (ranks are laid out tp fastest, then cp, dp, pp, as core.mesh does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config import Config
from core.metrics import flops_per_token
from core.rules import FUSED_CHUNK_ELEMENTS, attention_width, grad_accum_steps, moe_layer_rule, offloaded_checkpoints, recompute_set
from core.planner.calibration import Calibration
from core.planner.memory import block_activations, shapes
from core.validation import cp_a2a_size
from core.planner.state import (PARAM_BYTES, cached, layout_key, local_params, offloaded_input_layers,
                               recomputed_layers, stage_layers)

# Bytes moved per element by the eager modules (read + write), forward; backward about twice.
NORM_BYTES = 36  # bf16 in: two fp32 copies, square-mean, rsqrt-mul, cast, gain
ROTARY_BYTES = 60  # per q/k element: fp32 halves, four products, cat, cast
RESIDUAL_BYTES = 6  # per stream element: one bf16 add
LOSS_BYTES = 30  # per logit: max, fp32 shift, exp, sum (fwd); one-hot fix, scale, cast (bwd)
MAIN_GRAD_BYTES = 10  # per parameter and micro-batch: bf16 gradient read, fp32 main grad read + write
ADAMW_BYTES = 28  # per chunk element: master, grad, moments read; master, moments written
ADAMW_BF16_MOMENTS_BYTES = 20  # the one-pass kernel with bf16 moments (train.optimizer_moments_dtype): 2 bytes each
# The host step with bf16 moments against fp32 ones: the pieces' casts into and out of the fp32
# scratch cost about what the update does (16M elements on one core: 48 vs 17 ms, 53 vs 26 ms).
HOST_BF16_MOMENTS_FACTOR = 2.4
COMPILED_PASSES = 0.35  # share of the eager modules' bytes left after inductor fuses a block
COMPILED_HOST = 0.5  # share of the eager host time left with compiled blocks
EP_SYNC_US = 60.0  # the dispatcher reads the split sizes on the host before each all-to-all
STEP_HOST_MS = 2.0  # the step's own host work: label counts, clip, scheduler, metrics
HOST_ADAMW_GBPS = 30.0  # the CPU's fused AdamW on ADAMW_BYTES per element: 1.1G elements/s on one core, 16M elements


def group_spans_nodes(config: Config, group: str, gpus_per_node: int) -> bool:
    """Whether a process group's ranks sit on more than one node (ranks: tp, cp, dp, pp; an
    all-to-all CP group, `cp_a2a`, is neighbouring CP ranks)."""
    p = config.parallel
    span = {"tp": p.tp, "cp": p.tp * p.cp, "cp_a2a": p.tp * cp_a2a_size(config), "dp_cp": p.tp * p.cp * p.dp,
            "ep": p.tp * p.ep, "edp": p.tp * p.cp * p.dp, "pp": p.tp * p.cp * p.dp * p.pp}[group]
    if group == "edp" and p.dp * p.cp // p.ep == 1:
        return False
    return span > gpus_per_node


@dataclass
class Pass:
    """Seconds of one micro-batch through this rank's layers, by kind."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        if seconds:
            self.parts[kind] = self.parts.get(kind, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class TimeEstimate:
    """A step's predicted seconds and their parts."""

    step_s: float
    tokens_per_s: float
    micro_s: float  # one micro-batch, forward + backward, the slowest stage
    forward: dict[str, float]  # one micro-batch, by kind
    backward: dict[str, float]
    host_bound: bool
    pipeline_s: float  # all micro-batches through the schedule
    bubble: float  # the schedule's idle share
    grad_sync_s: float  # exposed gradient reduction
    optimizer_s: float  # clip + AdamW + parameter gather
    mfu: float

    def breakdown(self) -> dict[str, float]:
        """Seconds by part of the step (compute kinds summed over micro-batches and stages)."""
        scale = (self.pipeline_s * (1 - self.bubble)) / max(self.micro_s, 1e-12)
        out: dict[str, float] = {}
        for side in (self.forward, self.backward):
            for kind, seconds in side.items():
                out[kind] = out.get(kind, 0.0) + seconds * scale
        out["bubble"] = self.pipeline_s * self.bubble
        out["grad_sync"] = self.grad_sync_s
        out["optimizer"] = self.optimizer_s
        return out


class _Model:
    """The per-micro-batch costs of one config, layout and calibration."""

    def __init__(self, config: Config, cal: Calibration, gpus_per_node: int):
        self.c, self.cal, self.g = config, cal, gpus_per_node
        self.m, self.p, self.t = config.model, config.parallel, config.train
        self.s = shapes(config)
        self.b = PARAM_BYTES[self.t.precision]
        self.gemm_dtype = "fp8" if self.t.precision == "fp8" else "bf16"
        self.passes = COMPILED_PASSES if self.t.compile else 1.0
        self.recompute = recompute_set(self.t)
        self.offload = set(self.t.offload_modules)
        self.sp = self.p.sequence_parallel and self.p.tp > 1
        self.mla_up_s = 0.0  # set by _mla_projections

    # -- building blocks ---------------------------------------------------------------------

    def linear(self, tokens: int, n: int, k: int, fwd: Pass | None, bwd: Pass | None, kind: str = "gemm",
               dtype: str | None = None) -> float:
        """A [tokens, k] x [k, n] product: forward, and its dgrad + wgrad in the backward."""
        dtype = dtype or self.gemm_dtype
        f = self.cal.gemm_s(tokens, n, k, dtype)
        if fwd is not None:
            fwd.add(kind, f)
        if bwd is not None:
            bwd.add(kind, self.cal.gemm_s(tokens, k, n, dtype) + self.cal.gemm_s(k, n, tokens, dtype))
        return f

    def mem(self, nbytes: float, kernels: int) -> float:
        return self.cal.memory_s(nbytes * self.passes, max(1, int(kernels * self.passes)))

    def coll(self, op: str, group: str, nbytes: float) -> float:
        size = {"tp": self.p.tp, "cp": self.p.cp, "cp_a2a": self.s.a2a, "dp_cp": self.p.dp * self.p.cp, "ep": self.p.ep,
                "edp": self.p.dp * self.p.cp // self.p.ep}[group]
        return self.cal.collective_s(op, size, nbytes, group_spans_nodes(self.c, group, self.g))

    def tp_in_out(self, fwd: Pass | None, bwd: Pass | None) -> float:
        """One sub-layer's tensor-parallel collectives (input and output), each direction."""
        if self.p.tp == 1:
            return 0.0
        full = self.s.tokens * self.m.dim * self.b
        if self.sp:
            one = self.coll("all_gather", "tp", full) + self.coll("reduce_scatter", "tp", full)
        else:
            one = self.coll("all_reduce", "tp", full)
        if fwd is not None:
            fwd.add("tp_comm", one)
        if bwd is not None:
            bwd.add("tp_comm", one)
        return one

    # -- sub-layers: each returns its forward seconds (what recomputing it costs) --------------

    def norm(self, fwd: Pass, bwd: Pass) -> float:
        f = self.mem(self.s.seq_tokens * self.m.dim * NORM_BYTES, 7)
        fwd.add("memory", f)
        bwd.add("memory", 2 * f)
        return f

    def attention(self, fwd: Pass, bwd: Pass) -> tuple[float, float]:
        """(forward seconds of the sub-layer, of its core)."""
        s, m, t = self.s, self.m, self.t
        T, d, hd = s.tokens, m.dim, m.attention_head_dim
        kv_width = 2 * s.kv_core  # this rank's k and v features per token (what the ring sends)
        q_width, out_width = s.q, s.q
        if m.attention == "mla":
            f, rot, kv_width = self._mla_projections(fwd, bwd)
            hd = (m.attention_head_dim + m.value_head_dim) / 2  # the core's FLOPs: scores over hd, values over v
            out_width = s.q_heads * m.value_head_dim
        else:
            f = self.linear(T, s.q + 2 * s.kv, d, fwd, bwd)
            f += self.linear(T, d, s.q, fwd, bwd)
            rot = self.mem(T * (s.q + s.kv) * ROTARY_BYTES, 12)
        if m.qk_norm:
            rot += self.mem(T * (s.q + s.kv) * NORM_BYTES, 7)
        fwd.add("memory", rot)
        bwd.add("memory", 2 * rot)
        f += rot
        cp = self.p.cp
        core_f = self.cal.attention_s(t.seq_len, t.micro_batch_size, s.q_heads, hd, False) / cp
        core_b = self.cal.attention_s(t.seq_len, t.micro_batch_size, s.q_heads, hd, True) / cp
        if cp > 1 and s.a2a > 1:
            # All-to-all CP: q, k, v in and the output back over the group, forward; their
            # gradients the same way in the backward; on the critical path (the core waits).
            one = sum(self.coll("all_to_all", "cp_a2a", T * width * self.b)
                      for width in (q_width, kv_width / 2, kv_width / 2, out_width))
            fwd.add("cp_comm", one)
            bwd.add("cp_comm", one)
        ring = cp // s.a2a
        if ring > 1:
            core_f, core_b = core_f / self.cal.ring_efficiency, core_b / self.cal.ring_efficiency
            # Each of the ring - 1 steps sends this rank's k and v (a2a+ring: those of its
            # group's share, K times the tokens with 1/K of the heads; backward: and their
            # grads) while a block computes; what the blocks do not hide is exposed.
            kv = T * kv_width * self.b
            step = self.cal.p2p_s(kv, group_spans_nodes(self.c, "cp", self.g))
            fwd.add("cp_comm", max(0.0, (ring - 1) * step - core_f))
            bwd.add("cp_comm", max(0.0, 2 * (ring - 1) * step - core_b))
        fwd.add("attention", core_f)
        bwd.add("attention", core_b)
        f += core_f + self.tp_in_out(fwd, bwd)
        return f, core_f

    def _mla_projections(self, fwd: Pass, bwd: Pass) -> tuple[float, float, int]:
        """Multi-head latent attention's GEMMs (the down-projections whole on every tp rank, the
        up-projections and wo on this rank's heads) and its elementwise work (latent norms,
        rotary on the rope features, the concatenations); (GEMM seconds, memory seconds, the
        k + v features per token of this rank)."""
        m, T, d = self.m, self.s.tokens, self.m.dim
        heads = m.num_heads // self.p.tp
        hd, nope, rope, dv = m.attention_head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        if m.q_lora_rank:
            f = self.linear(T, m.q_lora_rank, d, fwd, bwd) + self.linear(T, heads * hd, m.q_lora_rank, fwd, bwd)
        else:
            f = self.linear(T, heads * hd, d, fwd, bwd)
        f += self.linear(T, m.kv_lora_rank + rope, d, fwd, bwd)
        f += self.linear(T, heads * (nope + dv), m.kv_lora_rank, fwd, bwd)
        f += self.linear(T, d, heads * dv, fwd, bwd)
        rot = self.mem(T * (heads + 1) * rope * ROTARY_BYTES, 12)
        rot += self.mem(T * (m.q_lora_rank + m.kv_lora_rank) * NORM_BYTES, 7)
        rot += self.mem(T * heads * 2 * hd * 2 * self.b, 2)  # [nope | rope] joined for q and k
        # What recompute `mla_up` runs again besides the core: the up-projections and the rest.
        dtype = self.gemm_dtype
        self.mla_up_s = rot + self.cal.gemm_s(T, heads * (nope + dv), m.kv_lora_rank, dtype) + \
            self.cal.gemm_s(T, heads * hd, m.q_lora_rank or d, dtype)
        return f, rot, heads * (hd + dv)

    def dense_ffn(self, fwd: Pass, bwd: Pass) -> tuple[float, float]:
        """(forward seconds of the FFN, of its SwiGLU product). Tiled (`train.mlp_chunk_tokens`):
        the GEMMs at the chunk's rows, and the backward runs each chunk's w1 and w3 and its
        SwiGLU again (it keeps only the input)."""
        T, d, H = self.s.tokens, self.m.dim, self.s.ffn
        chunk = self.t.mlp_chunk_tokens
        if chunk and T > chunk:
            n = T / chunk
            one_f, one_b = Pass(), Pass()
            f = n * (self.linear(chunk, H, d, one_f, one_b) * 2 + self.linear(chunk, d, H, one_f, one_b))
            for side, one in ((fwd, one_f), (bwd, one_b)):
                for kind, seconds in one.parts.items():
                    side.add(kind, n * seconds)
            glu = self.mem(T * H * 5 * self.b, 2)
            fwd.add("memory", glu)
            bwd.add("memory", 2 * glu)
            bwd.add("recompute", n * 2 * self.cal.gemm_s(chunk, H, d, self.gemm_dtype) + glu)
            return f + glu + self.tp_in_out(fwd, bwd), glu
        f = self.linear(T, H, d, fwd, bwd) * 2 + self.linear(T, d, H, fwd, bwd)
        glu = self.mem(T * H * 5 * self.b, 2)
        fwd.add("memory", glu)
        bwd.add("memory", 2 * glu)
        return f + glu + self.tp_in_out(fwd, bwd), glu

    def moe_ffn(self, fwd: Pass, bwd: Pass) -> tuple[float, float, float]:
        """(forward seconds of the MoE layer, of its routed experts, of their SwiGLU products)."""
        s, m, p = self.s, self.m, self.p
        Tr, R, d, b = s.routed_tokens, s.expert_rows, m.dim, self.b
        f = 0.0
        router = self.cal.gemm_s(Tr, s.experts, d) * 4  # fp32
        router += self.mem(Tr * s.experts * 4 * 8 + Tr * d * 6, 12)
        fwd.add("moe_router", router)
        bwd.add("moe_router", 2 * router)
        f += router
        shared = 0.0
        if s.shared_hidden:
            shared = self.linear(Tr, s.shared_hidden, d, fwd, bwd) * 2 + self.linear(Tr, d, s.shared_hidden, fwd, bwd)
            glu_s = self.mem(Tr * s.shared_hidden * 5 * b, 2)
            fwd.add("memory", glu_s)
            bwd.add("memory", 2 * glu_s)
            shared += glu_s
        permute = self.mem(R * d * b * 4 + R * 24, 8)  # dispatch gather + combine weighted sum
        fwd.add("moe_permute", permute)
        bwd.add("moe_permute", 2 * permute)
        local = s.experts // p.ep
        experts = 0.0
        for n, k in ((2 * s.expert_hidden, d), (d, s.expert_hidden)):  # gate and up in one GEMM (w13), down
            one = self.cal.grouped_gemm_s(R, local, n, k, self.gemm_dtype)
            experts += one
            fwd.add("experts", one)
            bwd.add("experts", self.cal.grouped_gemm_s(R, local, k, n, self.gemm_dtype)
                    + self.cal.grouped_gemm_s(R, local, n, k, self.gemm_dtype))
        glu = self.mem(R * s.expert_hidden * 5 * b, 2)
        fwd.add("memory", glu)
        bwd.add("memory", 2 * glu)
        experts += glu
        chunk = self.t.mlp_chunk_tokens
        if chunk and s.tokens > chunk:  # tiled: each chunk runs its forward again in the backward
            bwd.add("recompute", experts + shared)
        a2a = 0.0
        if p.ep > 1:
            one = self.coll("all_to_all", "ep", R * d * b) + EP_SYNC_US * 1e-6
            # The dispatch overlaps the shared experts (side stream); the combine does not.
            a2a = max(0.0, one - shared) + one
            fwd.add("ep_comm", a2a)
            bwd.add("ep_comm", 2 * one)
        tp = 0.0
        if p.tp > 1:
            full = s.tokens * d * b
            if p.etp > 1:  # gather the tokens in, reduce(-scatter) the outputs
                tp = (self.coll("all_gather", "tp", full) + self.coll("reduce_scatter", "tp", full)) if self.sp \
                    else self.coll("all_reduce", "tp", full)
            elif not self.sp:  # split mode without SP: the outputs are all-gathered
                tp = self.coll("all_gather", "tp", full)
            tp += self.cal.latency_us["intra"] * 1e-6  # the balancing statistics' all-reduce
            fwd.add("tp_comm", tp)
            bwd.add("tp_comm", tp)
        return f + shared + permute + experts + a2a + tp, experts, glu

    # -- one block, one micro-batch ------------------------------------------------------------

    def block(self, layer: int, fwd: Pass, bwd: Pass, recomputed: bool = True, inputs_out: bool = True) -> float:
        """Adds one block's forward and backward (`recomputed`: with the recompute set; `inputs_out`:
        its checkpoint inputs go to the host, if offloaded at all); returns the block's compute
        seconds (for the offload copies to hide behind)."""
        r = self.recompute if recomputed else set()
        before = fwd.total + bwd.total
        n1 = self.norm(fwd, bwd)
        attn_f, core_f = self.attention(fwd, bwd)
        n2 = self.norm(fwd, bwd)
        res = self.mem(2 * self.s.seq_tokens * self.m.dim * RESIDUAL_BYTES, 2)
        fwd.add("memory", res)
        bwd.add("memory", res)
        if moe_layer_rule(self.m.moe, layer):
            ffn_f, experts_f, glu_f = self.moe_ffn(fwd, bwd)
        else:
            (ffn_f, glu_f), experts_f = self.dense_ffn(fwd, bwd), 0.0
        if "block" in r:
            again = n1 + attn_f + n2 + ffn_f + res
        else:
            again = (attn_f if "attention" in r else self.mla_up_s + core_f if "mla_up" in r
                     else core_f if "attention_core" in r else 0.0)
            # A norm or SwiGLU product runs twice more: its checkpoint's recompute for its own
            # backward, and the recipe that stands for its dropped output in its consumers'.
            again += 2 * (n1 + n2) if "norms" in r else 0.0
            if "mlp" in r:
                again += ffn_f
            else:
                again += experts_f if "moe_experts" in r else 2 * glu_f if "swiglu" in r else 0.0
        bwd.add("recompute", again)
        compute = fwd.total + bwd.total - before
        if self.offload or offloaded_checkpoints(self.c):  # the copies both ways, less what compute hides
            moved = block_activations(self.c, layer, r, self.offload, inputs_offloaded=inputs_out).offloaded
            copy = self.cal.pcie_s(moved)
            fwd.add("offload", max(0.0, copy - (compute / 3)))  # the forward is about a third
            bwd.add("offload", max(0.0, copy - 2 * compute / 3))
        return compute

    def fused_loss(self, fwd: Pass, bwd: Pass) -> None:
        """`train.fused_loss`: the head and the loss over token chunks of FUSED_CHUNK_ELEMENTS
        logits (core/train/loss.py), all in the forward: each chunk's GEMMs at its rows, its
        row passes, its weight gradient added into the fp32 main grad of the head (a read and a
        write of [V/tp, dim] per chunk), under TP two all-reduces of the chunk's row statistics;
        the final norm's forward and backward passes with them, over all T tokens (under sequence
        parallelism every rank normalises the gathered input)."""
        s, d = self.s, self.m.dim
        chunk = max(1, min(s.tokens, FUSED_CHUNK_ELEMENTS // s.vocab))
        n = s.tokens / chunk
        per_chunk = 3 if self.t.compile else 21  # the norm's kernels each way, compiled or eager
        fwd.add("memory", self.mem(3 * s.tokens * d * NORM_BYTES, int(per_chunk * n)))
        one_f, one_b = Pass(), Pass()
        self.linear(chunk, s.vocab, d, one_f, one_b, "head", "bf16")
        for one in (one_f, one_b):
            fwd.add("head", n * one.total)
        fwd.add("loss", n * self.mem(chunk * s.vocab * LOSS_BYTES, 6))
        fwd.add("loss", n * self.cal.memory_s(s.vocab * d * 8, 1))
        if self.p.tp > 1:
            fwd.add("tp_comm", n * 2 * self.coll("all_reduce", "tp", chunk * 8))

    def micro_batch(self, pp_rank: int) -> tuple[Pass, Pass, float]:
        """Forward and backward of one micro-batch through this pipeline rank's layers; and the
        host's time to issue them."""
        fwd, bwd = Pass(), Pass()
        s, m, p = self.s, self.m, self.p
        layers, recomputing = stage_layers(self.c, pp_rank), recomputed_layers(self.c, pp_rank)
        inputs_out = offloaded_input_layers(self.c, pp_rank)
        # Blocks differ by dense / MoE, recomputed, checkpoint inputs offloaded.
        kinds: dict[tuple[bool, bool, bool], tuple[Pass, Pass]] = {}
        for i in layers:
            kind = moe_layer_rule(m.moe, i), i in recomputing, i in inputs_out
            if kind not in kinds:
                kinds[kind] = Pass(), Pass()
                self.block(i, *kinds[kind], recomputed=kind[1], inputs_out=kind[2])
            for side, one in zip((fwd, bwd), kinds[kind]):
                for name, seconds in one.parts.items():
                    side.add(name, seconds)
        T, d = s.tokens, m.dim
        if pp_rank == 0:
            emb = self.mem(T * d * self.b * 2, 1)
            fwd.add("memory", emb)
            bwd.add("memory", self.mem(T * d * (self.b + 8), 2))
        if pp_rank == p.pp - 1:
            for _ in range(1 + m.mtp_layers):  # the shared head and loss once per MTP depth too
                if self.t.fused_loss:
                    self.fused_loss(fwd, bwd)
                    continue
                self.norm(fwd, bwd)
                self.linear(T, s.vocab, d, fwd, bwd, "head", "bf16")
                loss = self.mem(T * s.vocab * LOSS_BYTES / 2, 6)
                fwd.add("loss", loss)
                bwd.add("loss", loss)
                if p.tp > 1:
                    fwd.add("tp_comm", 2 * self.coll("all_reduce", "tp", T * 8))
            for _ in range(m.mtp_layers):  # each depth's embedding, two norms and input projection
                self.linear(T, d, 2 * d, fwd, bwd, "gemm", "bf16")
                self.norm(fwd, bwd)
                self.norm(fwd, bwd)
        # Every parameter's gradient is added into its fp32 main grad once per micro-batch.
        numel = cached(("numel", pp_rank) + layout_key(self.c),
                       lambda: sum(spec.numel for spec in local_params(self.c, pp_rank)))
        bwd.add("memory", self.cal.memory_s(numel * MAIN_GRAD_BYTES, len(layers) * 9 + 4))
        moe_layers = sum(1 for i in layers if moe_layer_rule(m.moe, i))
        host_us = self.cal.host_us_per_block
        host = (moe_layers * host_us["moe"] + (len(layers) - moe_layers) * host_us["dense"]) * 1e-6
        if self.t.compile:
            host *= COMPILED_HOST
        return fwd, bwd, host


def _buckets(config: Config, pp_rank: int, cap_mb: float) -> list[tuple[str, int, float]]:
    """(group, fp32 bytes, when its last gradient is ready as a share of the backward) of each
    gradient bucket, in launch order, as core/parallel/data.py builds them."""
    return cached(("buckets", pp_rank, cap_mb) + layout_key(config), lambda: _make_buckets(config, pp_rank, cap_mb))


def _make_buckets(config: Config, pp_rank: int, cap_mb: float) -> list[tuple[str, int, float]]:
    specs = local_params(config, pp_rank)
    layers = stage_layers(config, pp_rank)
    order = {layer: i for i, layer in enumerate(reversed(layers))}

    def ready(name: str) -> float:
        if name.startswith(("layers.", "mtp.")):
            layer = int(name.split(".")[1]) + (config.model.num_layers if name.startswith("mtp.") else 0)
            return (order[layer] + 1) / max(len(layers), 1)
        return 1.0 if name.startswith("tok_embeddings") else 0.0

    cap = int(cap_mb * 2**20)
    buckets, open_ = [], {}
    for spec in reversed(specs):
        group = "edp" if spec.expert else "dp_cp"
        entry = open_.setdefault(group, [0, 0.0])
        entry[0] += spec.numel * 4
        entry[1] = max(entry[1], ready(spec.name))
        if entry[0] >= cap:
            buckets.append((group, entry[0], entry[1]))
            open_[group] = [0, 0.0]
    buckets += [(g, n, r) for g, (n, r) in open_.items() if n]
    return buckets


def _grad_sync(model: _Model, pp_rank: int, backward_s: float, overlapped: bool) -> float:
    """Exposed seconds of the gradient reduction after the last backward."""
    c, p, cal = model.c, model.p, model.cal

    def buckets() -> list[tuple[float, float]]:  # (seconds, ready share) per bucket, launch order
        op = "reduce_scatter" if p.distributed_optimizer else "all_reduce"
        out = []
        for group, nbytes, ready in _buckets(c, pp_rank, p.bucket_mb):
            if (p.dp * p.cp // p.ep if group == "edp" else p.dp * p.cp) > 1:
                seconds = model.coll(op, group, nbytes)
                if p.distributed_optimizer:
                    seconds += cal.memory_s(nbytes * 2, 1)  # packing rank-major
                out.append((seconds, ready))
        return out

    key = ("sync", pp_rank, model.g) + layout_key(c)
    if key not in cal.memo:
        cal.memo[key] = buckets()
    clock = 0.0
    for seconds, ready in cal.memo[key]:
        clock = max(clock, ready * backward_s if overlapped else backward_s) + seconds
    return max(0.0, clock - backward_s)


def _optimizer(model: _Model, pp_rank: int) -> float:
    """Clip norm, fused AdamW over this rank's chunks, the parameter all-gather and unpack."""
    c, p, cal = model.c, model.p, model.cal
    b = model.b

    def sums() -> tuple[float, float, float, float]:  # chunk, numel, gathered dense / expert bytes
        chunk = numel = dense = expert = 0.0
        for spec in local_params(c, pp_rank):
            size = p.dp * p.cp // p.ep if spec.expert else p.dp * p.cp
            numel += spec.numel
            if p.distributed_optimizer and size > 1:
                chunk += spec.numel / size
                if spec.expert:
                    expert += spec.numel * b
                else:
                    dense += spec.numel * b
            else:
                chunk += spec.numel
        return chunk, numel, dense, expert

    chunk, numel, dense, expert = cached(("optimizer", pp_rank) + layout_key(c), sums)
    seconds = cal.memory_s(chunk * 4, 16) + cal.collective_s("all_reduce", 8, 8)  # the norm
    bf16_moments = c.train.optimizer_moments_dtype == "bf16"
    if c.train.optimizer_offload:
        # On the CPU, each bucket's weights crossing the link while the next is updated; the
        # gradients crossed during the backward, all but the last bucket's hidden by it.
        host = chunk * ADAMW_BYTES / (HOST_ADAMW_GBPS * 1e9) * (HOST_BF16_MOMENTS_FACTOR if bf16_moments else 1.0)
        seconds += max(host, cal.pcie_s(chunk * b)) + cal.pcie_s(min(chunk * 4, p.bucket_mb * 2**20))
        seconds += cal.memory_s(numel * 2 * b, 32)  # unpack params
    else:
        seconds += cal.memory_s(chunk * (ADAMW_BF16_MOMENTS_BYTES if bf16_moments else ADAMW_BYTES), 16)
        seconds += cal.memory_s(chunk * (4 + b) + numel * 2 * b, 32)  # pack masters, unpack params
    for group, nbytes in (("dp_cp", dense), ("edp", expert)):
        if nbytes:  # the all-gathers of the new weights: launched together, waited for together
            seconds += model.coll("all_gather", group, nbytes)
    return seconds


def estimate_time(config: Config, cal: Calibration, gpus_per_node: int = 8) -> TimeEstimate:
    """Predicted step time of a validated config on (pp*dp*cp*tp) GPUs of `cal`'s kind."""
    model = _Model(config, cal, gpus_per_node)
    p, t, m = config.parallel, config.train, config.model
    accum = grad_accum_steps(config)
    stages = []
    for pp_rank in range(p.pp):
        fwd, bwd, host = model.micro_batch(pp_rank)
        gpu = fwd.total + bwd.total
        stages.append((max(gpu, host), fwd, bwd, host > gpu))
    micro_s, fwd, bwd, host_bound = max(stages, key=lambda x: x[0])
    if p.pp == 1:
        pipeline_s, bubble = accum * micro_s, 0.0
    else:
        v = p.pp_virtual_stages
        ticks = accum + (p.pp - 1) / v
        # Each micro-batch crosses every stage boundary twice (activation, then its gradient).
        send = cal.p2p_s(model.s.seq_tokens * m.dim * model.b, group_spans_nodes(config, "pp", gpus_per_node))
        pipeline_s = ticks * micro_s + 2 * v * accum * send
        bubble = (pipeline_s - accum * micro_s) / pipeline_s
    # pp = 1: the reduction overlaps the last micro-batch's backward; pp > 1: it follows the schedule.
    grad = max(_grad_sync(model, r, bwd.total if p.pp == 1 else 0.0, p.pp == 1) for r in range(p.pp))
    opt = max(_optimizer(model, r) for r in range(p.pp))
    step = pipeline_s + grad + opt + STEP_HOST_MS * 1e-3
    tokens = t.global_batch_size * t.seq_len
    return TimeEstimate(step, tokens / step, micro_s, fwd.parts, bwd.parts, host_bound, pipeline_s, bubble, grad, opt,
                        _mfu(config, tokens / step))


def _mfu(config: Config, tokens_per_s: float) -> float:
    """Model FLOPs utilisation against the bf16 peak (989 TFLOP/s per GPU), the project's accounting."""
    m, p, t = config.model, config.parallel, config.train
    total = cached(("total",) + layout_key(config), lambda: sum(s.numel for s in local_params(_whole(config))))
    moe = m.moe
    embedding = m.vocab_size * m.dim
    active = total
    if moe.num_experts:
        hidden = moe.ffn_dim or m.ffn_dim
        per_expert = 3 * m.dim * hidden
        layers = sum(1 for i in range(m.num_layers + m.mtp_layers) if moe_layer_rule(moe, i))
        active -= layers * per_expert * (moe.num_experts - moe.top_k)
    head = 0 if m.tie_embeddings else m.vocab_size * m.dim
    flops = flops_per_token(active, embedding, m.num_layers, attention_width(m), t.seq_len,
                            m.mtp_layers, head)  # the trainer's accounting (core/metrics.py)
    world = p.pp * p.dp * p.cp * p.tp
    return flops * tokens_per_s / (989e12 * world)


def _whole(config: Config) -> Config:
    """The same model on one rank (for parameter counts)."""
    whole = Config(model=config.model)
    whole.train.precision = config.train.precision
    whole.parallel.dp = 1
    return whole
