"""Expert parallelism (alone, with data parallelism, with tensor parallelism) equals the
single-process MoE model.

Reference: `build_model(cfg, seed)` in each worker process, run on EVERY data-parallel
rank's micro-batches one after another (the aux losses are per micro-batch, so the reference
must see the same micro-batches, not one merged batch), loss = sum(token CE) / global label
count, aux losses scaled by 1 / (micro-batches x dp) through `set_moe_loss_scale`, gradients
accumulated. The parallel run: each rank runs only its own micro-batches, then
`sync_sequence_parallel_grads` (TP) and `reduce_moe_grads` (expert grads over "edp", the
rest over "dp_cp"); every gradient must equal the reference's slice for this rank (experts
[ep_rank * E/ep, ...), TP shards along `tp_shard_dim`), the all-reduced loss the
reference loss, and the MoE statistics summed over all ranks (`moe.stats`, as the trainer
sums them) the reference's: the same expert loads, the same mean losses.

Tolerance: everything is fp32 on CPU. Parallelism only changes summation order: an expert's
GEMM sums the tokens of several ranks at once, gradients are summed by all-reduce, TP splits
matmul reductions. That moves results by a few fp32 ulps: we allow 1e-5 relative with an
absolute floor of 1e-6 x the largest reference gradient of that tensor (entries near zero
have no meaningful relative error); measured errors are printed (about 1e-7).
Routing is discrete, so a near-tie flipped by such an ulp would change a token's expert; the
fixed seeds here have no such tie (the test would fail loudly, not pass wrongly).
"""

from __future__ import annotations

import pytest

import torch
import torch.distributed as dist

from core.config import ModelConfig, MoEConfig
from core.train.loss import cross_entropy_sum
from core.mesh import ParallelMesh
from core.layers import AttentionMeta
from core.train.model import build_model
from moe.dispatcher import build_dispatcher
from moe.layer import moe_layers, set_moe_loss_scale
from moe.parallel import apply_ep, reduce_moe_grads
from moe.router import TopKRouter
from moe.stats import MoEStatsLayout, moe_metrics, take_moe_stats
from tests.distributed import run_distributed

RTOL = 1e-5
T = 32  # tokens per micro-batch: divisible by tp (sequence parallelism) and by tp again (split)


def _batch(vocab: int, dp_rank: int, micro: int):
    """A packed micro-batch of 3 documents; labels -100 at document ends."""
    g = torch.Generator().manual_seed(1000 * dp_rank + micro)
    cut = sorted(torch.randperm(T - 2, generator=g)[:2].add(1).tolist())
    lengths = [cut[0], cut[1] - cut[0], T - cut[1]]
    tokens = torch.randint(0, vocab, (T,), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.roll(tokens, -1).clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels[cu[1:] - 1] = -100
    return tokens, positions, labels, AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths))


def _model(cfg: ModelConfig):
    model = build_model(cfg, seed=5)
    with torch.no_grad():  # a non-zero, identical bias on every rank: selection must agree
        for layer in moe_layers(model):
            layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, cfg.moe.num_experts))
    return model


def _run(model, batches, global_labels, tp_group):
    loss = torch.zeros(())
    for tokens, positions, labels, meta in batches:
        part, _ = cross_entropy_sum(model(tokens, positions, meta), labels, tp_group)
        (part / global_labels).backward()
        loss += part.detach()
    return loss


def _expected_slice(ref_grad, param, ep_rank, ep, tp_rank):
    g = ref_grad
    if ep > 1 and getattr(param, "ep_shard_dim", None) is not None:
        n = g.shape[0] // ep
        g = g[ep_rank * n:(ep_rank + 1) * n]
    dim = getattr(param, "tp_shard_dim", None)
    if dim is not None:
        n = param.shape[dim]
        g = g.narrow(dim, tp_rank * n, n)
    return g


def _parity_worker(rank, world, scenarios):
    torch.manual_seed(0)
    results = {}
    for name, sc in scenarios.items():
        tp, ep, micro = sc.get("tp", 1), sc["ep"], sc.get("micro", 1)
        dp = world // tp
        moe = MoEConfig(**{"num_experts": 8, "top_k": 2, "ffn_dim": 16, "z_loss_coeff": 1e-3, **sc.get("moe", {})})
        cfg = ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=64, moe=moe)
        cfg.moe.first_k_dense = 1
        mesh = ParallelMesh.build(dp=dp, tp=tp, ep=ep)
        tp_group = mesh.group("tp") if tp > 1 else None
        all_batches = [[_batch(cfg.vocab_size, d, m) for m in range(micro)] for d in range(dp)]
        global_labels = float(sum((b[2] != -100).sum() for bs in all_batches for b in bs))

        ref = _model(cfg)
        set_moe_loss_scale(ref, micro * dp)
        ref_loss = sum(_run(ref, bs, global_labels, None) for bs in all_batches)

        model = _model(cfg)
        if tp > 1:
            from core.parallel.tensor import apply_tp

            apply_tp(model, mesh, sequence_parallel=sc["sp"])
        apply_ep(model, mesh, etp=sc.get("etp", 1), sequence_parallel=sc.get("sp", True))
        set_moe_loss_scale(model, micro * dp)
        rows = torch.zeros((), dtype=torch.int64)
        def count_rows(module, args, out):
            rows.add_(args[0].shape[0])

        hooks = [m.experts.register_forward_hook(count_rows) for m in moe_layers(model)]
        loss = _run(model, all_batches[mesh.coordinate("dp")], global_labels, tp_group)
        for h in hooks:
            h.remove()
        if tp > 1:
            from core.parallel.tensor import sync_sequence_parallel_grads

            sync_sequence_parallel_grads(model, mesh)
        reduce_moe_grads(model, mesh)

        dist.all_reduce(loss, group=mesh.group("dp_cp"))
        torch.testing.assert_close(loss / global_labels, ref_loss / global_labels, rtol=RTOL, atol=0)
        # Every assignment reaches an expert exactly once (dropless), or exactly the kept ones.
        dist.all_reduce(rows)
        assigned = len(moe_layers(model)) * dp * micro * T * moe.top_k  # each TP rank sees all T ...
        if not (tp > 1 and sc.get("etp", 1) == 1):
            assigned *= tp  # ... except in "split" mode, where TP ranks share them out
        if moe.capacity_factor == 0:
            assert int(rows) == assigned, f"{name}: {int(rows)} expert rows for {assigned} assignments"
        else:
            assert 0 < int(rows) < assigned, f"{name}: capacity {moe.capacity_factor} dropped nothing"

        # The statistics, summed over all ranks as the trainer sums them, are the reference's.
        layout = MoEStatsLayout.of_run(cfg, mesh, etp=sc.get("etp", 1), timed=False)
        stats = layout.pack(take_moe_stats(model))
        dist.all_reduce(stats)
        check_stats(layout.summarize(stats), moe_metrics(ref), name)

        ref_grads = dict(ref.named_parameters())
        worst = 0.0
        ep_rank, tp_rank = mesh.coordinate("ep"), mesh.coordinate("tp")
        for pname, param in model.named_parameters():
            expected = _expected_slice(ref_grads[pname].grad, param, ep_rank, ep, tp_rank)
            assert expected.shape == param.grad.shape, f"{name} {pname}: {tuple(param.grad.shape)} vs {tuple(expected.shape)}"
            floor = 1e-6 * expected.abs().max().item()
            torch.testing.assert_close(param.grad, expected, rtol=RTOL, atol=floor, msg=lambda m: f"{name} {pname}: {m}")
            worst = max(worst, ((param.grad - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item())
            if "router" in pname:
                assert param.grad.abs().sum() > 0, f"{name}: router got no gradient"
        results[name] = worst
    return results


def check_stats(got: dict, want: dict, name: str) -> None:
    """MoE metrics of a parallel run against the single-process run's: the same keys, the same
    loads (routing is the same: see the module docstring), the loss means to RTOL."""
    assert got.keys() == want.keys() and want, f"{name}: {sorted(got)} vs {sorted(want)}"
    for key, value in want.items():
        if isinstance(value, list):
            assert got[key] == value, f"{name} {key}: {got[key]} vs {value}"
        else:
            assert got[key] == pytest.approx(value, rel=RTOL, abs=1e-12), f"{name} {key}: {got[key]} vs {value}"


def _report(results):
    worst = {k: max(r[k] for r in results) for k in results[0]}
    for k, v in worst.items():
        print(f"{k}: worst gradient error relative to max |grad| = {v:.1e}")
    return worst


@pytest.mark.slow
def test_ep2_alltoall_and_allgather_match_single_process():
    scenarios = {
        "ep2 alltoall, softmax top-2, 2 micro-batches": dict(ep=2, micro=2),
        "ep2 allgather, sigmoid groups + shared + bias, capacity 1.0, per-sequence aux": dict(
            ep=2, moe=dict(dispatcher="allgather", router="sigmoid", n_groups=4, topk_groups=2, top_k=4,
                           num_shared_experts=1, bias_update_rate=1e-3, capacity_factor=1.0,
                           aux_loss_per_sequence=True, routed_scaling_factor=1.5)),
    }
    _report(run_distributed(_parity_worker, 2, scenarios))


@pytest.mark.slow
def test_ep4_and_ep2_x_dp2_match_single_process():
    scenarios = {
        "ep4 alltoall": dict(ep=4),
        "ep2 x edp2 alltoall, capacity 1.25": dict(ep=2, micro=2, moe=dict(capacity_factor=1.25)),
        "ep2 x edp2 allgather, sigmoid": dict(ep=2, moe=dict(dispatcher="allgather", router="sigmoid")),
    }
    _report(run_distributed(_parity_worker, 4, scenarios))


def _phases_worker(rank, world):
    # Two micro-batches in flight through each dispatcher's phases, interleaved (both
    # preprocesses, both exchanges, both postprocesses; then the combines likewise, in the
    # other order), with experts that scale their rows by (1 + global expert id): each result
    # must equal that micro-batch's own dispatch + combine run alone.
    e, k, dim = 8, 2, 16
    router = TopKRouter(dim, MoEConfig(num_experts=e, top_k=k))
    torch.manual_seed(0)
    for p in router.parameters():
        torch.nn.init.normal_(p)
    group = dist.new_group(list(range(world)))
    torch.manual_seed(10 + rank)
    xs = [torch.randn(12 + 4 * m + rank, dim) for m in range(2)]  # uneven token counts per rank
    routings = [router(x) for x in xs]
    out = {}
    for kind in ("alltoall", "allgather"):
        d = build_dispatcher(kind, e, group, weigh_in_experts=False)  # the combine weighs: experts below do not
        scale = 1.0 + torch.arange(d.num_local) + d.ep_rank * d.num_local

        def experts(rows, counts):
            return rows * torch.repeat_interleave(scale, counts).unsqueeze(1)

        alone = []
        for x, r in zip(xs, routings):
            rows, counts, _ = d.dispatch(x, r)
            alone.append(d.combine(experts(rows, counts)))
        staged = [d.dispatch_preprocess(x, r) for x, r in zip(xs, routings)]
        exchanged = [d.dispatch_exchange(rows, h) for rows, h in staged]
        grouped = [d.dispatch_postprocess(rows, h) for rows, (_, h) in zip(exchanged, staged)]
        outs = [experts(rows, counts) for rows, counts in grouped]
        handles = [h for _, h in staged]
        back = [d.combine_preprocess(o, h) for o, h in reversed(list(zip(outs, handles)))][::-1]
        back = [d.combine_exchange(rows, h) for rows, h in reversed(list(zip(back, handles)))][::-1]
        ys = [d.combine_postprocess(rows, h) for rows, h in zip(back, handles)]
        for y, want, x, r in zip(ys, alone, xs, routings):
            torch.testing.assert_close(y, want, rtol=0, atol=0)
            # and the experts' scaling, applied by hand per assignment
            manual = (x.unsqueeze(1) * (1.0 + r.indices).unsqueeze(2) * r.weights.unsqueeze(2)).sum(1)
            torch.testing.assert_close(y, manual, rtol=1e-5, atol=1e-5)
        out[kind] = True
    return out


@pytest.mark.slow
def test_dispatch_phases_with_two_micro_batches_in_flight_match_one_at_a_time():
    results = run_distributed(_phases_worker, 2)
    assert results == [{"alltoall": True, "allgather": True}] * 2, results
