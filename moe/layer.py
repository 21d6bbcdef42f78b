"""The MoE feed-forward layer: router -> dispatcher -> grouped experts -> combine (+ shared).

`MoELayer(cfg, layer_id)` is what `core.train.model.TransformerBlock` puts in `feed_forward` on MoE
layers; it is called as `layer(x, meta)` with x [T, dim] and the micro-batch's
`core.layers.AttentionMeta`, and returns [T, dim]. It is a plain single-rank module until
`moe.parallel.apply_ep` gives it an expert-parallel dispatcher and (with TP) its
tensor-parallel mode.

Auxiliary losses without changing the model's signature. The balancing loss and z-loss are
added to the objective through the backward pass: an autograd function passes the layer's
output through unchanged and, in backward, hands the loss term the gradient `scale`
(Megatron's trick). With the training loop's main loss = sum(token CE) / global token count
over all micro-batches and data-parallel ranks, and gradients summed over those ranks, the
objective of one optimizer step is

    main loss + aux_coeff * A + z_coeff * Z

over the step's micro-batches m (a micro-batch is what one forward of the model sees, counted
once however many context-parallel or "split" TP ranks share it), their sequences s (the
segments of `meta.cu_seqlens` with document tokens) and their document tokens t (padding, a
row's end or the context-parallel split's, is routed but never counted: `meta.real`):

    A = (1/M) sum_m  E/(k n_m^2) sum_e count_me P_me      (micro-batch level, the default)
    A = (1/S) sum_s  E/(k n_s^2) sum_e count_se P_se      (model.moe.aux_loss_per_sequence)
    Z = (1/T) sum_t  logsumexp(logits_t)^2

with n the unit's document tokens, count its assignments to expert e, P the sum of its tokens'
probabilities of e; M, S, T the step's counts over all ranks, which the loop states before each
step: `set_moe_loss_scale(model, M, S, T)`. A sequence or micro-batch split over ranks is
balanced as one: its sums are all-reduced over the group, and each rank's term is its own
tokens' share (linear in P given the counts), the shares adding up to the whole. So S- and
T-averaged terms do not depend on how a step's documents are grouped into micro-batches (the
same on every layout, dynamic CP included); the micro-batch level term is the same wherever the
micro-batches are (every static layout; a dynamic-CP plan makes its own micro-batches, so there
it is the mean over the plan's). Without S and T (`set_moe_loss_scale(model, N)`, default N = 1)
each micro-batch's per-sequence loss is the mean over its sequences and its z-loss the mean
over its tokens, each divided by N: right for one process and one micro-batch.

Per-batch data travels through `forward`. Per-sequence balancing needs the sequence
boundaries of the micro-batch this rank runs: `meta.cu_seqlens` (over this rank's tokens:
its context-parallel share; under sequence parallelism the whole micro-batch's, of which x
is a shard), with `meta.total_tokens` their total on the host, so checking them costs no
device sync. The meta is an argument, never state on the layer: recomputation in the
backward and pipeline schedules that run several micro-batches' forwards before their
backwards each see their own micro-batch's boundaries. Only the eager dispatch (`_route`)
reads it, so its per-batch values are no guards of the compiled block.

Statistics: each layer counts, over its training forwards since the last read, its expert
loads, drops and loss values (`take_stats`); `moe.stats` turns them into metrics, summed
over every rank and pipeline stage. `update_expert_bias(model, mesh)` runs the
auxiliary-loss-free balancing step once per optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from core.config import ModelConfig
from core.eager import eager_only
from core.layers import AttentionMeta, FeedForward
from core.parallel.comm import (
    all_gather_tokens,
    all_reduce,
    copy_to_group,
    reduce_from_group,
    reduce_scatter_tokens,
    split_tokens,
)
from moe.dispatcher import build_dispatcher
from moe.experts import GroupedExperts, expert_align
from moe.router import Routing, TopKRouter, balancing_stats, sequence_balancing_losses, sequence_ids


class _AttachLoss(torch.autograd.Function):
    """Identity on `out`; in backward gives `loss` the gradient `scale`."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale, ctx.loss_dtype = scale, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.loss_dtype, device=grad.device), None


def _in_recompute() -> bool:
    """True while activation checkpointing re-runs a forward inside backward: statistics
    must not count those tokens twice."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class MoELayer(nn.Module):
    """Routed SwiGLU experts (plus optional always-on shared experts) for one block."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        moe = cfg.moe
        hidden = moe.ffn_dim or cfg.ffn_dim
        self.layer_id, self.moe = layer_id, moe
        self.router = TopKRouter(cfg.dim, moe)  # first: it checks the settings (core.validation.check_moe)
        self.experts = GroupedExperts(moe.num_experts, cfg.dim, hidden)
        self.shared_experts = None
        if moe.num_shared_experts > 0:
            self.shared_experts = FeedForward(cfg.dim, moe.shared_ffn_dim or moe.num_shared_experts * hidden)
        self.dispatcher = build_dispatcher(moe.dispatcher, moe.num_experts, align=expert_align(moe))
        # Tensor parallelism (set by moe.parallel.apply_ep): "none", "split" (each TP rank
        # routes its own token shard, experts replicated) or "sharded" (TP ranks share
        # the tokens, expert hidden sizes split).
        self.tp_mode, self.tp_group, self.tp_size, self.sequence_parallel = "none", None, 1, False
        # The step's counts the auxiliary losses are divided by (`set_moe_loss_scale`).
        self.aux_loss_divisor, self.sequence_divisor, self.token_divisor = 1.0, None, None
        self.overlap_shared = True
        self._side_stream = None
        self.register_buffer("_bias_load", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        self._stats: dict[str, torch.Tensor | int] = {}

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, meta: AttentionMeta | None = None) -> torch.Tensor:
        """x [T, dim] -> [T, dim]. `meta`: the micro-batch's `AttentionMeta` (its sequence
        boundaries), needed only with `aux_loss_per_sequence`."""
        x, token_offset = self._enter_tp(x)
        routing = self.router(x)
        shared = self._shared_start(x)
        y, loss = self._route(x, routing, token_offset, meta)
        if shared is not None:
            y = y + self._shared_finish(*shared)
        if loss is not None and torch.is_grad_enabled() and loss.requires_grad:
            # "sharded" TP: every TP rank holds the same whole loss, the TP sum counts it once.
            tp_share = self.tp_size if self.tp_mode == "sharded" else 1
            y = _AttachLoss.apply(y, loss, 1.0 / tp_share)
        return self._leave_tp(y)

    # Outside torch.compile, in one piece: the per-expert row counts change every batch, so
    # compiled, the dispatch recompiled on each new routing (and then ran with dynamic shapes);
    # its time is the opaque grouped GEMMs and the all-to-all, which compiling would not speed
    # up. The per-sequence auxiliary loss depends on the batch's boundaries (the meta is read
    # here only, so its per-batch values never become guards), and the statistics are a
    # host-side dict whose state would be a guard. One eager piece, not three: each graph
    # break costs the host a compiled graph's entry and exit, forward and backward, per layer
    # and micro-batch. Router and shared experts stay in the block's compiled graphs.
    @eager_only
    def _route(self, x: torch.Tensor, routing: Routing, token_offset: int, meta: AttentionMeta | None):
        """(the routed experts' combined output, the auxiliary loss term to attach or None)."""
        expert_in, tokens_per_expert, row_weights = self.dispatcher.dispatch(x, routing)
        expert_out = self.experts(expert_in, tokens_per_expert, row_weights, self.dispatcher.pending_layout())
        # The balancing loss's small kernels after the expert GEMMs are queued: the host issues
        # them while the GPU runs the GEMMs, where issued first the GPU idled through them.
        loss, parts = self._aux_loss(routing, token_offset, x.shape[0], meta)
        y = self.dispatcher.combine(expert_out)
        if self.training and not _in_recompute():
            self._record(routing, parts, self._real(meta, token_offset, x.shape[0]))
        return y, loss

    def _enter_tp(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's tokens for routing, and where they start in the micro-batch."""
        if self.tp_mode == "split":
            rank = dist.get_rank(self.tp_group)
            if self.sequence_parallel:  # x already is this rank's shard
                return x, rank * x.shape[0]
            local = split_tokens(x, self.tp_group)
            return local, rank * local.shape[0]
        if self.tp_mode == "sharded":
            return (all_gather_tokens(x, self.tp_group) if self.sequence_parallel else copy_to_group(x, self.tp_group)), 0
        return x, 0

    def _leave_tp(self, y: torch.Tensor) -> torch.Tensor:
        if self.tp_mode == "split" and not self.sequence_parallel:
            return all_gather_tokens(y, self.tp_group, reduce_grad=False)
        if self.tp_mode == "sharded":
            return reduce_scatter_tokens(y, self.tp_group) if self.sequence_parallel else reduce_from_group(y, self.tp_group)
        return y

    # Runs inside `_route`, outside torch.compile: the per-sequence statistics are shaped by the
    # batch's document count (and check it on the host), so a compiled block recompiled per batch.
    def _aux_loss(self, routing: Routing, token_offset: int, n: int, meta: AttentionMeta | None):
        """(the loss term to attach or None, the micro-batch's values for the metrics).

        The micro-batch is what one forward of the model sees, whole: in "split" TP mode x is a
        shard of it, under context parallelism (meta.extra["cp_group"]) a CP share of it. The
        sums the losses are made of (assignments, probabilities and tokens per sequence, the
        z-loss's sum) are then summed over those groups in one small all-reduce each, so every
        sequence is balanced as one; each rank's term is its own tokens' share of the whole
        (the losses are linear in the probability sums given the counts), and the shares add up
        over the groups. Only document tokens count (`meta.real`): padding, a row's or the
        split's, is routed but neither counted nor balanced."""
        moe, parts = self.moe, {}
        aux_on, z_on = moe.aux_loss_coeff > 0, moe.z_loss_coeff > 0
        split = self.tp_mode == "split"
        total = n * self.tp_size if split else n
        if not (aux_on or z_on) or total == 0:  # an empty micro-batch (dynamic CP) adds nothing
            return None, parts
        device, e = routing.probs.device, self.moe.num_experts
        weights = self._real(meta, token_offset, n)
        if aux_on and moe.aux_loss_per_sequence:
            cu = self._boundaries(meta, total).to(device)
            seq = sequence_ids(cu, token_offset, n)
            nseq = cu.numel() - 1
        else:  # the micro-batch as one sequence
            seq, nseq = torch.zeros(n, dtype=torch.int64, device=device), 1
        pieces = []
        if aux_on:
            counts, prob_sums, lengths = balancing_stats(routing.probs, routing.indices, seq, nseq, weights)
            pieces += [counts.reshape(-1), prob_sums.detach().reshape(-1), lengths]
        if z_on:
            lse2 = torch.logsumexp(routing.logits, dim=-1).square()
            z_sum = lse2.sum() if weights is None else (lse2 * weights).sum()
            z_count = torch.full((1,), float(n), device=device) if weights is None else weights.sum().view(1)
            pieces += [z_sum.detach().view(1), z_count.to(z_sum.dtype)]
        full = torch.cat(pieces)
        cp_group = meta.extra.get("cp_group") if meta is not None else None
        for group in (self.tp_group if split else None, cp_group):
            if group is not None:
                full = all_reduce(full, group)
        # The metrics count each micro-batch once: on the first rank of its CP group.
        leader = cp_group is None or dist.get_rank(cp_group) == 0
        loss = None
        if aux_on:
            counts_all = full[: nseq * e].view(nseq, e)
            lengths_all = full[2 * nseq * e: 2 * nseq * e + nseq]
            mine = sequence_balancing_losses(counts_all, prob_sums, lengths_all, moe.top_k)
            whole = sequence_balancing_losses(counts_all, full[nseq * e: 2 * nseq * e].view(nseq, e), lengths_all,
                                              moe.top_k)
            units = (lengths_all > 0).sum().to(whole.dtype)
            if self.sequence_divisor is not None and moe.aux_loss_per_sequence:
                term = mine.sum() / self.sequence_divisor  # mean over the step's sequences
            elif moe.aux_loss_per_sequence:
                term = mine.sum() / units.clamp_min(1) / self.aux_loss_divisor  # mean over this micro-batch's
            else:
                term = mine.sum() / self.aux_loss_divisor  # mean over the step's micro-batches
            if leader:
                parts["aux_loss"], parts["aux_units"] = whole.sum().detach(), units
            loss = moe.aux_loss_coeff * term
        if z_on:
            z_all, count_all = full[-2], full[-1]
            if self.token_divisor is not None:
                term = z_sum / self.token_divisor  # mean over the step's document tokens
            else:
                term = z_sum / count_all.clamp_min(1) / self.aux_loss_divisor
            if leader:
                parts["z_loss"], parts["z_tokens"] = z_all, count_all
            term = moe.z_loss_coeff * term
            loss = term if loss is None else loss + term
        return loss, parts

    def _real(self, meta: AttentionMeta | None, token_offset: int, n: int) -> torch.Tensor | None:
        """float [n]: 1 for this rank's routed tokens that belong to documents, 0 for padding; None: all 1."""
        real = meta.real if meta is not None else None
        if real is None:
            return None
        if real.shape[0] < token_offset + n:
            raise ValueError(f"MoE layer {self.layer_id}: meta.real covers {real.shape[0]} tokens but the layer routes "
                             f"tokens {token_offset}..{token_offset + n}; pass the AttentionMeta of this micro-batch")
        return real[token_offset:token_offset + n].to(torch.float32)

    def _boundaries(self, meta: AttentionMeta | None, total: int) -> torch.Tensor:
        if meta is None:
            raise ValueError(
                f"MoE layer {self.layer_id}: model.moe.aux_loss_per_sequence needs the sequence boundaries; "
                "call the layer as layer(x, meta) with the micro-batch's AttentionMeta"
            )
        cu = meta.cu_seqlens.to(dtype=torch.int64)
        # Reading cu[-1] off the GPU is a host sync per layer (the GPU queue drains, then idles
        # while the host catches up): the training loop's metas carry the total on the host.
        covered = meta.total_tokens if meta.total_tokens is not None else int(cu[-1])
        if covered != total:
            raise ValueError(
                f"MoE layer {self.layer_id}: cu_seqlens covers {covered} tokens but the micro-batch has {total}; "
                "pass the AttentionMeta of this rank's micro-batch"
            )
        return cu

    def _shared_start(self, x: torch.Tensor):
        """Start the shared experts; on GPU on a side stream so they overlap the dispatch."""
        if self.shared_experts is None:
            return None
        # Compiled code cannot trace stream switches (record_stream); inductor orders the work.
        if not (x.is_cuda and self.overlap_shared) or torch.compiler.is_compiling():
            return self.shared_experts(x), None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=x.device)
        side, main = self._side_stream, torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            x.record_stream(side)
            out = self.shared_experts(x)
        return out, side

    def _shared_finish(self, out: torch.Tensor, side) -> torch.Tensor:
        if side is not None:
            main = torch.cuda.current_stream(out.device)
            main.wait_stream(side)
            out.record_stream(main)
        return out

    # ------------------------------------------------------------- statistics
    @torch.no_grad()
    def _record(self, routing: Routing, parts: dict[str, torch.Tensor], weights: torch.Tensor | None) -> None:
        counts, assignments = routing.tokens_per_expert, routing.indices.numel()
        if weights is not None:  # document tokens only (padding is routed, not counted)
            real = weights.bool().unsqueeze(1).expand_as(routing.indices)
            counts = torch.zeros_like(counts).scatter_add_(0, routing.indices.reshape(-1), real.reshape(-1).long())
            assignments = real.sum()
        self._bias_load += counts
        s = self._stats
        if not s:  # the counters the host knows stay host ints: no kernel launch per forward for them
            s.update(tokens_per_expert=torch.zeros_like(counts), forwards=0, assignments=0)
        s["tokens_per_expert"] += counts
        s["forwards"] += 1
        s["assignments"] = s["assignments"] + assignments
        if routing.keep is not None:
            dropped = ~routing.keep if weights is None else ~routing.keep & real
            s["dropped"] = s.get("dropped", 0) + dropped.sum()
        for name, value in parts.items():
            value = value.detach().float()
            s[name] = s[name] + value if name in s else value

    def take_stats(self) -> dict:
        """This rank's raw statistics since the last call, copied towards the host without
        waiting (`moe.stats` packs and reads them); resets them."""
        s, self._stats = self._stats, {}
        return {name: value.to("cpu", non_blocking=True) if isinstance(value, torch.Tensor) else value
                for name, value in s.items()}


# --------------------------------------------------------------- model-level API
def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def set_moe_loss_scale(model: nn.Module, num_losses: int | float, sequences: float | None = None,
                       tokens: float | None = None) -> None:
    """Tell every MoE layer what one optimizer step's auxiliary losses are averaged over
    (module docstring): `num_losses` micro-batches (each counted once, whatever ranks split it),
    and, given, the step's `sequences` (documents) and document `tokens`, over all ranks. Without
    them the per-sequence balancing loss is each micro-batch's mean over its sequences and the
    z-loss each micro-batch's mean over its tokens, averaged over the `num_losses` micro-batches."""
    if num_losses <= 0:
        raise ValueError(f"set_moe_loss_scale: num_losses must be > 0 (micro-batches x dp), got {num_losses}")
    for name, value in (("sequences", sequences), ("tokens", tokens)):
        if value is not None and value <= 0:
            raise ValueError(f"set_moe_loss_scale: {name} must be > 0 when given, got {value}")
    for layer in moe_layers(model):
        layer.aux_loss_divisor = float(num_losses)
        layer.sequence_divisor = None if sequences is None else float(sequences)
        layer.token_divisor = None if tokens is None else float(tokens)


@torch.no_grad()
def update_expert_bias(model: nn.Module, mesh=None) -> None:
    """Auxiliary-loss-free balancing step (DeepSeek-V3): for layers with bias_update_rate > 0,
    sum the loads seen since the last call over the data-parallel ranks (dp x cp, and tp whose
    ranks may see different tokens), then bias_e += rate * sign(mean load - load_e).
    Call once per optimizer step on every rank of a pipeline stage."""
    layers = [m for m in moe_layers(model) if m.moe.bias_update_rate > 0]
    if not layers:
        return
    loads = torch.stack([m._bias_load for m in layers])  # one collective for all layers
    if mesh is not None:
        for name in ("dp_cp", "tp"):
            if mesh.size(name) > 1:
                dist.all_reduce(loads, group=mesh.group(name))
    for layer, load in zip(layers, loads):
        load = load.float()
        layer.router.expert_bias += layer.moe.bias_update_rate * torch.sign(load.mean() - load)
        layer._bias_load.zero_()
