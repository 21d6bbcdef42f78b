"""All-to-all (Ulysses) and hierarchical context parallelism (core/parallel/ulysses.py).

Reference: `varlen_attention` over the whole unsharded packed batch (document-causal), fp64 on
the CPU; each rank's output and the gradients of q, k and v (scattered back to the full batch
through the shard's `source` map and summed over ranks) equal it to 1e-9: the same exact
softmax, computed per head group and, with a ring, merged by log-sum-exp.
Cases (one spawn of 4 gloo processes): "a2a" at cp=2 (two CP groups side by side), "a2a" at
cp=4, "a2a+ring" at cp=4 with cp_a2a=2; grouped-query heads with fewer key/value heads than
the all-to-all group (repeated) and with more. Dynamic CP (`dynamic_a2a_inputs`, dp=2 x cp=2):
one step's packed documents in plan entries on sub-groups of 4, 2 and 1 ranks, each entry's
attention an all-to-all over its own sub-group (plain on one rank), against the same reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from typing import NamedTuple

from core.attention import varlen_attention
from core.mesh import ParallelMesh
from core.parallel.context import CPSubgroups, shard_for_cp
from core.parallel.ulysses import A2ACoreAttention, dynamic_a2a_inputs, shard_for_a2a
from dataservice.cp_plan import padded_length
from tests.support.distributed import run_distributed
from tests.support.runs import RTOL, losses, run_train

LENGTHS = [13, 40, 7, 3, 29]  # uneven documents: every padding path runs
CASES = [  # (cp, a2a size, query heads, key/value heads)
    (2, 2, 4, 1), (2, 2, 4, 4), (4, 4, 8, 2), (4, 2, 4, 2), (4, 2, 4, 1),
]



class Entry(NamedTuple):
    """A plan entry as `dynamic_a2a_inputs` reads it (dataservice.cp_plan.MicroBatchPlan's fields)."""

    group_start: int
    group_size: int
    docs: list[int]


# One dynamic-CP step of 9 documents over 4 ranks, in global execution order: a group of 4 (40 and 29
# tokens: 29 padded to 32, so 8 and 10 per rank), two side-by-side groups of 2 (the second with its
# documents out of step order), then single ranks. GQA: groups of 4 repeat 2 key/value heads, groups
# of 2 do not; with 1 key/value head both repeat it.
DYN_LENGTHS = [13, 40, 7, 3, 29, 1, 22, 5, 9]
DYN_ENTRIES = [Entry(0, 4, [1, 4]), Entry(0, 2, [0, 2]), Entry(2, 2, [6, 3]), Entry(0, 1, [5]), Entry(1, 1, [7]),
               Entry(3, 1, [8])]
DYN_HEADS = [(4, 2), (8, 1)]


def _batch(hq: int, hkv: int, d: int = 8, dv: int = 8, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(t, hkv, dv, generator=gen, dtype=torch.float64)
    grad = torch.randn(t, hq, dv, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return q, k, v, grad, cu, positions


def _reference(hq: int, hkv: int, dv: int, lengths=LENGTHS):
    q, k, v, grad, cu, _ = _batch(hq, hkv, dv=dv, lengths=lengths)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, cu, max(lengths))
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _value_dim(cp: int, a2a: int) -> int:
    """A value head of its own size (MLA's case) with and without a ring, and the equal size."""
    return 8 if (cp, a2a) == (4, 4) else 10


def _groups(world: int, cp: int, a2a: int):
    """This rank's (a2a group, ring group, a2a rank, ring rank); every rank creates every group."""
    me, mine = dist.get_rank(), [None, None]
    for base in range(0, world, cp):
        members = list(range(base, base + cp))
        for i in range(cp // a2a):
            g = dist.new_group(members[i * a2a:(i + 1) * a2a])
            if me in members[i * a2a:(i + 1) * a2a]:
                mine[0] = g
        if cp // a2a > 1:
            for j in range(a2a):
                g = dist.new_group(members[j::a2a])
                if me in members[j::a2a]:
                    mine[1] = g
    c = me % cp
    return mine[0], mine[1], c % a2a, c // a2a


def _worker(rank: int, world: int):
    results = []
    for cp, a2a, hq, hkv in CASES:
        a2a_group, ring_group, a2a_rank, ring_rank = _groups(world, cp, a2a)
        q, k, v, grad, cu, positions = _batch(hq, hkv, dv=_value_dim(cp, a2a))
        ids = torch.arange(q.shape[0])
        s = shard_for_a2a(ids, ids, positions, cu, ring_rank, cp // a2a, a2a_rank, a2a)
        src = s.source
        real = src >= 0

        def local(x):
            out = x.new_zeros(src.numel(), *x.shape[1:])
            out[real] = x[src[real]]
            return out.clone().requires_grad_()

        ql, kl, vl = local(q), local(k), local(v)
        out = A2ACoreAttention(a2a_group, ring_group)(ql, kl, vl, s.meta)
        g = torch.zeros_like(out)
        g[real] = grad[src[real]]
        out.backward(g)
        full = [torch.zeros_like(x) for x in (q, k, v)]
        for acc, part in zip(full, (ql.grad, kl.grad, vl.grad)):
            acc.index_add_(0, src[real], part[real])
        for acc in full:  # every CP group runs the same batch: the world's sum is world/cp groups' sums
            dist.all_reduce(acc)
        results.append((src, out.detach(), [acc / (world // cp) for acc in full]))
    return results, [_dynamic(hq, hkv) for hq, hkv in DYN_HEADS]


def _dynamic(hq: int, hkv: int):
    """This rank's entries of DYN_ENTRIES: (step index, output, sub-group size, tokens held) per
    entry, and q/k/v grads summed over the world (each document is in one entry)."""
    subgroups = CPSubgroups.build(ParallelMesh.build(dp=2, cp=2))
    q, k, v, grad, cu, positions = _batch(hq, hkv, lengths=DYN_LENGTHS)
    ids = torch.arange(q.shape[0])
    full = [torch.zeros_like(x) for x in (q, k, v)]
    outs = []
    for entry in DYN_ENTRIES:
        if not entry.group_start <= subgroups.index < entry.group_start + entry.group_size:
            continue
        s = dynamic_a2a_inputs(entry, ids, ids, positions, cu, subgroups)
        real = s.source >= 0
        step = s.tokens[real]  # the tokens are their own step indices

        def local(x):  # padding rows get arbitrary values: they must not matter
            out = torch.full((s.tokens.numel(), *x.shape[1:]), 0.7, dtype=x.dtype)
            out[real] = x[step]
            return out.requires_grad_()

        ql, kl, vl = local(q), local(k), local(v)
        out = A2ACoreAttention(None, None)(ql, kl, vl, s.meta)
        g = torch.zeros_like(out)
        g[real] = grad[step]
        out.backward(g)
        for acc, part in zip(full, (ql.grad, kl.grad, vl.grad)):
            acc.index_add_(0, step, part[real])
        outs.append((step, out.detach()[real], entry.group_size, s.tokens.numel(), "a2a" in s.meta.extra))
    for acc in full:
        dist.all_reduce(acc)
    return outs, full


@pytest.fixture(scope="module")
def distributed_results():
    return run_distributed(_worker, 4)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"cp{c}-a2a{a}-hq{q}-hkv{k}" for c, a, q, k in CASES])
def test_a2a_attention_matches_varlen_reference(distributed_results, case):
    cp, a2a, hq, hkv = CASES[case]
    want_out, *want_grads = _reference(hq, hkv, _value_dim(cp, a2a))
    sizes = set()
    covered = torch.zeros(sum(LENGTHS), dtype=torch.long)
    for rank in range(4):
        src, out, grads = distributed_results[rank][0][case]
        sizes.add(src.numel())
        real = src >= 0
        torch.testing.assert_close(out[real], want_out[src[real]], rtol=1e-9, atol=1e-9)
        if rank < cp:
            covered.index_add_(0, src[real], torch.ones_like(src[real]))
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert len(sizes) == 1  # every rank holds the same number of tokens
    assert bool((covered == 1).all())  # each token on exactly one rank of a CP group


@pytest.mark.slow
@pytest.mark.parametrize("heads", range(len(DYN_HEADS)), ids=[f"hq{q}-hkv{k}" for q, k in DYN_HEADS])
def test_dynamic_cp_all_to_all_over_sub_groups_matches_varlen_reference(distributed_results, heads):
    """Every entry's output on every member, and the gradients, to 1e-9; each member holds the
    padded tokens the planner counts (pad(L, 2g)/g per document); one-rank entries are not split."""
    hq, hkv = DYN_HEADS[heads]
    want_out, *want_grads = _reference(hq, hkv, 8, DYN_LENGTHS)
    covered = torch.zeros(sum(DYN_LENGTHS), dtype=torch.long)
    sizes = set()
    for rank in range(4):
        outs, grads = distributed_results[rank][1][heads]
        for step, out, g, held, split in outs:
            entry = next(e for e in DYN_ENTRIES if e.group_size == g and e.group_start <= rank < e.group_start + g
                         and set(step.tolist()) <= set(_doc_tokens(e.docs)))
            assert held == sum(int(padded_length(DYN_LENGTHS[d], g)) // g for d in entry.docs), (rank, entry)
            assert split == (g > 1)
            torch.testing.assert_close(out, want_out[step], rtol=1e-9, atol=1e-9)
            covered.index_add_(0, step, torch.ones_like(step))
            sizes.add(g)
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert sizes == {1, 2, 4}
    assert bool((covered == 1).all())  # every token of the step on exactly one member of one entry


def _doc_tokens(docs) -> list[int]:
    starts = torch.tensor([0, *DYN_LENGTHS]).cumsum(0).tolist()
    return [i for d in docs for i in range(starts[d], starts[d + 1])]


def shard_for_cp_share(ids, positions, cu, ring_rank: int, ring: int, k: int) -> torch.Tensor:
    """The ring rank's zigzag share (chunks padded to multiples of k) as `shard_for_cp` makes it."""
    return shard_for_cp(ids, ids, positions, cu, ring_rank, ring, multiple_of=2 * k, chunk_multiple=k).source


def test_shard_for_a2a_pieces_cover_the_ring_share():
    """Without processes: the K pieces of a ring rank's share, stacked and gathered, are the share."""
    ids = torch.arange(sum(LENGTHS))
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    for ring, k in ((1, 2), (2, 2), (1, 3)):
        for r in range(ring):
            pieces = [shard_for_a2a(ids, ids, positions, cu, r, ring, a, k, multiple_of=2) for a in range(k)]
            assert len({p.tokens.numel() for p in pieces}) == 1 and pieces[0].tokens.numel() % 2 == 0
            stacked = torch.cat([p.source for p in pieces])
            layout = pieces[0].meta.extra["a2a"]
            share = stacked[layout.gather_index]
            lengths = layout.ring_doc_lengths
            assert sum(lengths) == share.numel() and all(n % k == 0 for n in lengths)
            want = shard_for_cp_share(ids, positions, cu, r, ring, k)
            assert torch.equal(share, want)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout", [
    (2, ["parallel.cp=2", "parallel.cp_comm=a2a"]),
    (4, ["parallel.cp=2", "parallel.cp_comm=a2a", "parallel.tp=2"]),  # 1 key/value head per rank, repeated
    (4, ["parallel.cp=4", "parallel.cp_comm=a2a+ring", "parallel.cp_a2a=2"]),
], ids=["a2a-cp2", "a2a-cp2-tp2", "a2a+ring-cp4"])
def test_training_with_all_to_all_cp_follows_the_single_process(tmp_path, dataset, reference, nproc, layout):
    """Reference: the single-process run of the same data (RTOL: fp32, reduction order only)."""
    run_train(tmp_path / "run", dataset, nproc, *layout)
    got = losses(tmp_path / "run")
    assert got.keys() == reference.keys() and len(got) == 4
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=RTOL), (step, got, reference)
