"""All-to-all (Ulysses) and hierarchical context parallelism: `parallel.cp_comm = "a2a" | "a2a+ring"`.

The CP group of `cp = R x K` ranks is seen as R ring ranks of K all-to-all ranks each (K =
`parallel.cp_a2a`; "a2a" is R = 1, K = cp). Rank c is all-to-all rank c % K of ring rank
c // K: the K ranks of an all-to-all group are neighbours (inside a node), the ring hops
between groups.

The split (`shard_for_a2a`): each document is padded at its end so that its 2R zigzag chunks
(`core.parallel.context.shard_for_cp` over the R ring ranks) are multiples of K tokens; the
ring rank's share of each document, [chunk r | chunk 2R-1-r], is then cut into K equal
contiguous pieces and all-to-all rank a keeps piece a of every document. Every rank holds
the same number of tokens.

Attention (`A2ACoreAttention`): one all-to-all over the K ranks turns q, k, v from [tokens of
this rank, all local heads] into [tokens of the whole ring share, heads / K]; the ring share
is then attended exactly like a ring-CP rank's buffer (R > 1: ring attention over the R
ring ranks with the ring layout; R = 1: the share is every document whole, document-causal
varlen attention), and a second all-to-all brings [own tokens, all heads] back. Per layer
the all-to-alls move 3 + 1 activations of this rank's tokens, whatever the sequence length,
where a ring moves K/V R times.

Grouped-query attention: key/value heads are repeated up to the next multiple of K when K
does not divide their count (K must divide the query heads and be a multiple or a divisor of
the key/value heads); each rank then receives whole query groups with their own key/value
head, so the attention is unchanged.

Dynamic CP (`dynamic_a2a_inputs`): each plan entry's documents are split over the entry's own
sub-group as "a2a" splits them over a CP group (R = 1, K = the sub-group's size g), and the
sub-group rides in `meta.extra["a2a_group"]`; an entry of one rank is not split and attends
plainly. A document over g ranks is padded to a multiple of 2g, as the ring pads it, so each
member holds the tokens the planner counted (`dataservice.cp_plan.padded_length`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.attention import varlen_attention
from core.eager import eager_only
from core.layers import AttentionMeta, model_blocks
from core.mesh import ParallelMesh
from core.parallel.context import CPInputs, CPSubgroups, _cu, _iota, dynamic_cp_inputs, gather_documents, shard_for_cp
from core.parallel.ring_attention import CPLayout, ring_attention

__all__ = ["A2ALayout", "shard_for_a2a", "A2ACoreAttention", "apply_a2a_cp", "A2AGroups", "dynamic_a2a_inputs"]


@dataclass(frozen=True)
class A2ALayout:
    """One rank's share under all-to-all CP, and how the K shares of its group make the ring share."""

    a2a_rank: int
    a2a_size: int
    ring_size: int
    gather_index: torch.Tensor  # long [K * T]: ring-share order -> index into the K received shares, stacked
    ring_cu: torch.Tensor  # int32 [docs + 1] over the ring share
    ring_max: int
    ring_doc_lengths: tuple[int, ...]  # ring_cu's lengths on the host
    ring_layout: CPLayout | None  # the ring share's zigzag layout (R > 1), None for R = 1


def shard_for_a2a(tokens: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                  ring_rank: int, ring_size: int, a2a_rank: int, a2a_size: int, *, pad_token: int = 0,
                  multiple_of: int = 1, real_tokens: torch.Tensor | None = None) -> CPInputs:
    """This rank's share of a packed micro-batch (see the module docstring); `multiple_of`: the
    local token count's multiple (sequence parallelism's tp); `real_tokens` as `shard_for_cp`'s."""
    if not 0 <= a2a_rank < a2a_size or not 0 <= ring_rank < ring_size:
        raise ValueError(f"a2a rank {a2a_rank} of {a2a_size} or ring rank {ring_rank} of {ring_size} is out of range")
    k = a2a_size
    ring = shard_for_cp(tokens, labels, position_ids, cu_seqlens, ring_rank, ring_size, pad_token=pad_token,
                        multiple_of=multiple_of * k, chunk_multiple=k, real_tokens=real_tokens)
    share_lens = ring.meta.cu_seqlens.long().diff()  # 2 * chunk per document: multiples of K
    piece = share_lens // k
    local = int(piece.sum())
    dev = tokens.device
    share_starts = ring.meta.cu_seqlens[:-1].long()
    doc = torch.repeat_interleave(torch.arange(piece.numel(), device=dev), piece, output_size=local)
    take = share_starts[doc] + a2a_rank * piece[doc] + _iota(piece, local)
    cu_local = _cu(piece)
    # Where each ring-share token sits in the K stacked local shares (rank a's share at a * local).
    total = local * k
    share_doc = torch.repeat_interleave(torch.arange(piece.numel(), device=dev), share_lens, output_size=total)
    offset = _iota(share_lens, total)
    owner = offset // piece[share_doc]
    gather = owner * local + cu_local[:-1].long()[share_doc] + offset % piece[share_doc]
    ring_lengths = tuple(share_lens.tolist())
    layout = A2ALayout(a2a_rank, k, ring_size, gather, ring.meta.cu_seqlens, max(ring_lengths, default=0),
                       ring_lengths, ring.meta.extra.get("cp") if ring_size > 1 else None)
    host_pieces = tuple(piece.tolist())
    meta = AttentionMeta(cu_seqlens=cu_local, max_seqlen=max(host_pieces, default=0), extra={"a2a": layout},
                         doc_lengths=host_pieces, real=ring.meta.real[take] if ring.meta.real is not None else None)
    return CPInputs(ring.tokens[take], ring.labels[take], ring.position_ids[take], meta, ring.source[take])


class _AllToAll(torch.autograd.Function):
    """x [K * n, ...] (block j for rank j) -> [K * n, ...] (block j from rank j); backward the same."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _heads_to_tokens(x: torch.Tensor, k: int, gather_index: torch.Tensor, group) -> torch.Tensor:
    """[T, H, D] (own tokens, all heads) -> [K*T, H/K, D] (the ring share in order, this rank's heads)."""
    t, h, d = x.shape
    send = x.reshape(t, k, h // k, d).transpose(0, 1).reshape(k * t, h // k, d)  # head block j first for rank j
    return _AllToAll.apply(send, group)[gather_index]


def _tokens_to_heads(y: torch.Tensor, k: int, gather_index: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `_heads_to_tokens`: [K*T, H/K, D] in ring-share order -> [T, H, D]."""
    kt, hk, d = y.shape
    stacked = torch.empty_like(y).index_copy(0, gather_index, y)  # back to rank-major order
    got = _AllToAll.apply(stacked, group)  # block j: own tokens, rank j's heads
    return got.reshape(k, kt // k, hk, d).transpose(0, 1).reshape(kt // k, k * hk, d)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class A2ACoreAttention(nn.Module):
    """Drop-in for `CoreAttention` under `cp_comm` "a2a" / "a2a+ring" (see the module docstring).
    The all-to-all runs over `meta.extra["a2a_group"]` where the batch names one (dynamic CP's
    sub-group), else over `a2a_group`."""

    def __init__(self, a2a_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None):
        super().__init__()
        self.a2a_group, self.ring_group = a2a_group, ring_group

    @eager_only  # per-batch layouts and collectives, as the ring
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        layout: A2ALayout | None = meta.extra.get("a2a")
        if layout is None:  # an unsharded batch (cp size 1)
            return varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, doc_lengths=meta.doc_lengths)
        size = layout.a2a_size
        group = meta.extra.get("a2a_group", self.a2a_group)
        if group is None or dist.get_world_size(group) != size:
            have = "no process group" if group is None else f"a group of {dist.get_world_size(group)} ranks"
            raise ValueError(f"the batch is split for an all-to-all over {size} ranks but {have} is known: build the "
                             "model with apply_a2a_cp or put the group in meta.extra['a2a_group']")
        if q.shape[1] % size:
            raise ValueError(f"all-to-all CP: {q.shape[1]} query heads on this rank cannot be split over "
                             f"parallel.cp_a2a={size}")
        kv_heads = k.shape[1]
        if kv_heads % size:  # repeat whole key/value heads so each rank gets its query groups' own
            kv_heads = math.lcm(kv_heads, size)
            if q.shape[1] % kv_heads:
                raise ValueError(f"all-to-all CP: {k.shape[1]} key/value heads cannot be shared out to "
                                 f"parallel.cp_a2a={size} ranks with {q.shape[1]} query heads")
            k, v = _repeat_kv(k, kv_heads), _repeat_kv(v, kv_heads)
        index = layout.gather_index
        qs, ks, vs = (_heads_to_tokens(t, size, index, group) for t in (q, k, v))
        if layout.ring_layout is not None:
            out = ring_attention(qs, ks, vs, layout.ring_layout, self.ring_group)
        else:
            out = varlen_attention(qs, ks, vs, layout.ring_cu, layout.ring_max, doc_lengths=layout.ring_doc_lengths)
        return _tokens_to_heads(out, size, index, group)


class A2AGroups:
    """The all-to-all and ring sub-groups of every CP group (built once: a collective, every rank
    creates every group in the same order)."""

    def __init__(self, mesh: ParallelMesh, a2a_size: int):
        cp = mesh.size("cp")
        if cp % a2a_size:
            raise ValueError(f"parallel.cp_a2a={a2a_size} must divide parallel.cp={cp}")
        self.a2a_size, self.ring_size = a2a_size, cp // a2a_size
        c = mesh.coordinate("cp")
        self.a2a_rank, self.ring_rank = c % a2a_size, c // a2a_size
        self.a2a_group = self.ring_group = None
        ranks = mesh.mesh.mesh  # [pp, dp, cp, tp]
        me = dist.get_rank()
        for pp in range(ranks.shape[0]):
            for dp in range(ranks.shape[1]):
                for tp in range(ranks.shape[3]):
                    members = ranks[pp, dp, :, tp].tolist()
                    for i in range(self.ring_size):
                        group = dist.new_group(members[i * a2a_size:(i + 1) * a2a_size])
                        if me in members[i * a2a_size:(i + 1) * a2a_size]:
                            self.a2a_group = group
                    for j in range(a2a_size):
                        if self.ring_size > 1:
                            group = dist.new_group(members[j::a2a_size])
                            if me in members[j::a2a_size]:
                                self.ring_group = group


def apply_a2a_cp(model: nn.Module, groups: A2AGroups | None) -> nn.Module:
    """Swap every block's `core_attention` for `A2ACoreAttention` (in place; after tensor parallelism).
    With groups None (dynamic CP) every split batch names its sub-group in its meta."""
    a2a, ring = (groups.a2a_group, groups.ring_group) if groups is not None else (None, None)
    for _, block in model_blocks(model):
        block.attention.core_attention = A2ACoreAttention(a2a, ring)
    return model


def dynamic_a2a_inputs(entry, tokens: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                       cu_seqlens: torch.Tensor, subgroups: CPSubgroups, *, pad_token: int = 0,
                       multiple_of: int = 1) -> CPInputs:
    """`dynamic_cp_inputs` for all-to-all attention: this rank's share of one plan entry, split
    over the entry's sub-group of g ranks (one all-to-all group, no ring); g = 1 is not split."""
    start, size = int(entry.group_start), int(entry.group_size)
    if size == 1:
        return dynamic_cp_inputs(entry, tokens, labels, position_ids, cu_seqlens, subgroups, pad_token=pad_token,
                                 multiple_of=multiple_of)
    group = subgroups.group(start, size)
    docs = gather_documents(tokens, labels, position_ids, cu_seqlens, entry.docs)
    out = shard_for_a2a(*docs, 0, 1, subgroups.index - start, size, pad_token=pad_token, multiple_of=multiple_of)
    out.meta.extra["a2a_group"] = group
    out.meta.extra["cp_group"] = group  # MoE layers balance each sequence over the entry's group
    return out
