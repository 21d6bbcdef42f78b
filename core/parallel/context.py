"""Context parallelism: split each packed micro-batch over a CP group, attend with a ring.

The split (`shard_for_cp`): every document (segment of `cu_seqlens`) is padded at its end to
a multiple of 2*cp tokens and cut into 2*cp equal chunks; CP rank r keeps chunks r and
2*cp-1-r of EVERY document (zigzag), so each rank holds the same number of tokens and the
same causal work whatever the mix of lengths. Padding tokens sit after their document's
last token, so under causal masking no real token ever sees one; their labels are -100, so
the loss and every gradient are exactly those of the unpadded batch. Position ids are the
true ones (padding continues its document's count), so rotary embeddings are unchanged.
Chosen over a split of the whole row because a row-level split would make a rank's share
of attention depend on where documents fall, and over uneven chunks because equal chunks
keep every ring message the same size.

Static CP: `apply_cp(model, mesh)` swaps each block's `core_attention` for
`RingCoreAttention`, which runs ring attention on the group in `meta.extra["cp_group"]`, or
the mesh's "cp" group. A micro-batch that was not sharded (no `meta.extra["cp"]`) takes the
plain varlen path, so the same model serves CP size 1.

Dynamic CP: `CPSubgroups.build(mesh)` makes once every aligned power-of-two sub-group of
the dp*cp ranks; `dynamic_cp_inputs` turns one entry of a rank's plan (from
`dataservice.cp_plan`) into that rank's shard, with the entry's sub-group in the meta.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from core.attention import varlen_attention
from core.eager import eager_only
from core.mesh import ParallelMesh
from core.layers import AttentionMeta, model_blocks
from core.parallel.ring_attention import CPLayout, ring_attention
from dataservice.packing import IGNORE_INDEX

__all__ = ["CPInputs", "CPLayout", "shard_for_cp", "RingCoreAttention", "apply_cp", "CPSubgroups",
           "gather_documents", "dynamic_cp_inputs"]


class CPInputs(NamedTuple):
    """One rank's model inputs after the split. `source` maps each local token to its index in
    the unsharded micro-batch, -1 for padding (tests and debugging use it)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    meta: AttentionMeta
    source: torch.Tensor


def _check(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or int(value) != value or value < lo or (hi is not None and value > hi):
        right = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={value!r} must be an integer {right}")
    return int(value)


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def _iota(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """concat(arange(n) for n in lengths), vectorised."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths, output_size=total)


def shard_for_cp(tokens: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 cp_rank: int, cp_size: int, *, pad_token: int = 0, multiple_of: int = 1,
                 chunk_multiple: int = 1, real_tokens: torch.Tensor | None = None) -> CPInputs:
    """This CP rank's zigzag share of a packed micro-batch (see the module docstring).

    tokens/labels/position_ids: [T] (a flattened micro-batch); cu_seqlens: [segments + 1]
    document boundaries over them (padding segments count as documents, labels -100).
    `multiple_of`: make the local token count a multiple of it (tensor-parallel sequence
    parallelism needs tp) by one extra all-padding document at the end.
    `chunk_multiple`: make every chunk a multiple of it (all-to-all CP cuts each rank's share of a
    document into that many pieces: `core.parallel.ulysses`); then cp_size 1 pads too.
    With cp_size 1 (and chunk_multiple 1) nothing is split (no layout in the meta; empty segments dropped).
    `real_tokens`: bool [T], the micro-batch's document tokens (`AttentionMeta.real`; None: all);
    the shard's `meta.real` marks its own, the split's padding never among them.
    """
    cp_size = _check("cp_size", cp_size, 1)
    cp_rank = _check("cp_rank", cp_rank, 0, cp_size - 1)
    multiple_of = _check("multiple_of", multiple_of, 1)
    chunk_multiple = _check("chunk_multiple", chunk_multiple, 1)
    total = tokens.shape[0]
    if tokens.dim() != 1 or labels.shape != tokens.shape or position_ids.shape != tokens.shape:
        raise ValueError(f"tokens, labels, position_ids must be flat [T] tensors of one length; got shapes "
                         f"{tuple(tokens.shape)}, {tuple(labels.shape)}, {tuple(position_ids.shape)}")
    cu = cu_seqlens.to(tokens.device, torch.long)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}; got {cu_seqlens.tolist()[:8]}...")
    lens = cu.diff()
    starts = cu[:-1][lens > 0]
    lens = lens[lens > 0]
    dev = tokens.device
    if cp_size == 1 and chunk_multiple == 1:  # nothing to split; at most one padding document for `multiple_of`
        extra = -total % multiple_of
        source = torch.arange(total + extra, device=dev)
        if extra:
            tail = torch.arange(extra, device=dev)
            tokens = torch.cat((tokens, torch.full_like(tail, pad_token).to(tokens.dtype)))
            labels = torch.cat((labels, torch.full_like(tail, IGNORE_INDEX).to(labels.dtype)))
            position_ids = torch.cat((position_ids, tail.to(position_ids.dtype)))
            source[total:] = -1
            lens = torch.cat((lens, lens.new_tensor([extra])))
            keep = real_tokens if real_tokens is not None else torch.ones(total, dtype=torch.bool, device=dev)
            real_tokens = torch.cat((keep.to(dev, torch.bool), torch.zeros(extra, dtype=torch.bool, device=dev)))
        host_lens = tuple(lens.tolist())  # one host read (as the max needs anyway), shared by every layer
        meta = AttentionMeta(cu_seqlens=_cu(lens), max_seqlen=max(host_lens, default=0), doc_lengths=host_lens,
                             real=real_tokens)
        return CPInputs(tokens, labels, position_ids, meta, source)

    two = 2 * cp_size
    chunk = (lens + two * chunk_multiple - 1) // (two * chunk_multiple) * chunk_multiple  # c_d: tokens per chunk of document d
    local = 2 * int(chunk.sum())
    extra = 0
    while (local + 2 * extra) % multiple_of:  # one all-padding document fixes the count
        extra += 1
    if extra:
        chunk = torch.cat((chunk, chunk.new_tensor([extra])))
        lens = torch.cat((lens, lens.new_zeros(1)))
        starts = torch.cat((starts, starts.new_zeros(1)))
        local += 2 * extra
    n = chunk.numel()
    doc = torch.repeat_interleave(torch.arange(n, device=dev), 2 * chunk, output_size=local)
    i = _iota(2 * chunk, local)
    c = chunk[doc]
    offset = torch.where(i < c, cp_rank * c + i, (two - 1 - cp_rank) * c + (i - c))  # offset in the padded document
    real = offset < lens[doc]
    src = torch.where(real, starts[doc] + offset, torch.full_like(offset, -1))
    # Padding continues its document's positions: last real position + how far past the end.
    last_pos = position_ids[(starts + lens - 1).clamp(min=0)].long() if total else torch.zeros_like(lens)
    last_pos = torch.where(lens > 0, last_pos, torch.full_like(lens, -1))
    pad_pos = last_pos[doc] + offset - lens[doc] + 1

    def take(x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        picked = x[src.clamp(min=0)].long() if total else fill
        return torch.where(real, picked, fill).to(x.dtype)

    local_tokens = take(tokens, torch.full_like(src, pad_token))
    local_labels = take(labels, torch.full_like(src, IGNORE_INDEX))
    local_pos = take(position_ids, pad_pos)
    local_real = real if real_tokens is None else real & real_tokens.to(dev)[src.clamp(min=0)] if total else real

    cu_local, cu_half = _cu(2 * chunk), _cu(chunk)
    first = torch.repeat_interleave(cu_local[:-1].long(), chunk, output_size=local // 2) + _iota(chunk, local // 2)
    max_chunk = int(chunk.max()) if n else 0
    equal_docs = n if n and int(chunk.min()) == max_chunk else 0  # lets the ring use dense block kernels
    layout = CPLayout(cp_rank, cp_size, cu_local, cu_half, 2 * max_chunk, max_chunk, first,
                      first + torch.repeat_interleave(chunk, chunk, output_size=local // 2), equal_docs)
    meta = AttentionMeta(cu_seqlens=cu_local, max_seqlen=layout.max_seqlen, extra={"cp": layout}, total_tokens=local,
                         real=local_real)
    return CPInputs(local_tokens, local_labels, local_pos, meta, src)


class RingCoreAttention(nn.Module):
    """Drop-in for `CoreAttention`: ring attention when the batch carries a CP layout."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group

    @eager_only  # as CoreAttention: per-batch layouts, collectives
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        layout = meta.extra.get("cp")
        if layout is None or layout.cp_size == 1:
            return varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, doc_lengths=meta.doc_lengths)
        group = meta.extra.get("cp_group", self.group)
        if group is None:
            raise ValueError(f"the batch is sharded for cp_size={layout.cp_size} but no process group is known: "
                             "build the model with apply_cp(model, mesh) or put the group in meta.extra['cp_group']")
        if dist.get_world_size(group) != layout.cp_size:
            raise ValueError(f"the batch is sharded for cp_size={layout.cp_size} but its group has "
                             f"{dist.get_world_size(group)} ranks")
        return ring_attention(q, k, v, layout, group)


def apply_cp(model: nn.Module, mesh: ParallelMesh | None) -> nn.Module:
    """Swap every block's `core_attention` for `RingCoreAttention` on the mesh's "cp" group (in place).

    Apply after tensor parallelism (it keeps the module slot and sees the local heads) and
    before recompute wrappers. With mesh None or cp == 1 the group is None: the model still
    runs dynamic-CP batches that name their group in `meta.extra["cp_group"]`."""
    group = mesh.group("cp") if mesh is not None and mesh.size("cp") > 1 else None
    for _, block in model_blocks(model):
        block.attention.core_attention = RingCoreAttention(group)
    return model


# ---- dynamic context parallelism ---------------------------------------------------------


class CPSubgroups:
    """Every aligned power-of-two sub-group of the dp*cp ranks, built once (a collective).

    The dp*cp ranks of one (pp, tp) slice are numbered i = dp_coord*cp + cp_coord; a group of
    size g starting at s (a multiple of g) holds i in [s, s+g). Groups are made for every pp
    and tp slice because `new_group` must be called by all ranks in the same order."""

    def __init__(self, index: int, size: int, groups: dict[tuple[int, int], dist.ProcessGroup]):
        self.index, self.size, self._groups = index, size, groups

    @classmethod
    def build(cls, mesh: ParallelMesh, max_group: int | None = None) -> "CPSubgroups":
        n = mesh.size("dp_cp")
        index = mesh.coordinate("dp") * mesh.size("cp") + mesh.coordinate("cp")
        groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        if not mesh.distributed:
            return cls(index, n, groups)
        ranks = torch.arange(dist.get_world_size()).view(mesh.pp, n, mesh.tp)
        pp_me, tp_me = mesh.coordinate("pp"), mesh.coordinate("tp")
        g = 2
        while g <= min(n, max_group or n):
            for start in range(0, n - g + 1, g):
                for pp in range(mesh.pp):
                    for tp in range(mesh.tp):
                        group = dist.new_group(ranks[pp, start:start + g, tp].tolist())
                        if pp == pp_me and tp == tp_me:
                            groups[(start, g)] = group
            g *= 2
        return cls(index, n, groups)

    def group(self, start: int, size: int) -> dist.ProcessGroup | None:
        """The sub-group [start, start+size) of this rank's slice; None for size 1."""
        if size == 1:
            return None
        if (start, size) not in self._groups:
            raise ValueError(f"no CP sub-group of size {size} starting at {start}: groups are aligned powers of two "
                             f"within {self.size} ranks (start a multiple of size)")
        if not start <= self.index < start + size:
            raise ValueError(f"dp_cp rank {self.index} is not in the CP sub-group [{start}, {start + size})")
        return self._groups[(start, size)]


def gather_documents(tokens: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                     doc_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack the documents `doc_ids` (segment indices of `cu_seqlens`) of a step into one
    micro-batch, in the given order: (tokens, labels, position_ids, cu_seqlens)."""
    cu = cu_seqlens.to(tokens.device, torch.long)
    ids = torch.as_tensor(doc_ids, dtype=torch.long, device=tokens.device).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cu.numel() - 1):
        raise ValueError(f"document ids must be in [0, {cu.numel() - 1}); got {ids.tolist()[:8]}")
    lens = cu[1:][ids] - cu[:-1][ids]
    total = int(lens.sum())
    index = torch.repeat_interleave(cu[:-1][ids], lens, output_size=total) + _iota(lens, total)
    return tokens[index], labels[index], position_ids[index], _cu(lens)


def dynamic_cp_inputs(entry, tokens: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor, subgroups: CPSubgroups, *, pad_token: int = 0,
                      multiple_of: int = 1) -> CPInputs:
    """This rank's inputs for one plan entry (anything with `group_start`, `group_size`, `docs`).

    The step's documents are given as one flat packed batch (`cu_seqlens` over all of them);
    the entry's documents are packed, zigzag-split over its group, and the group goes into
    `meta.extra["cp_group"]` for `RingCoreAttention`."""
    start, size = int(entry.group_start), int(entry.group_size)
    group = subgroups.group(start, size)
    docs = gather_documents(tokens, labels, position_ids, cu_seqlens, entry.docs)
    out = shard_for_cp(*docs, subgroups.index - start, size, pad_token=pad_token, multiple_of=multiple_of)
    if group is not None:
        out.meta.extra["cp_group"] = group
    return out
