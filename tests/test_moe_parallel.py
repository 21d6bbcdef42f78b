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
from core.mesh import ParallelMesh
from moe.comm import ExchangeTimer
from moe.dispatcher import build_dispatcher
from moe.parallel import apply_ep
from moe.router import TopKRouter
from moe.stats import MoEStatsLayout, take_moe_stats
from tests.support.distributed import run_distributed
from tests.support.moe_parity import parity_worker, report, parity_batch, parity_model, run_micro_batches


@pytest.mark.slow
def test_ep2_alltoall_and_allgather_match_single_process():
    scenarios = {
        "ep2 alltoall, softmax top-2, 2 micro-batches": dict(ep=2, micro=2),
        "ep2 allgather, sigmoid groups + shared + bias, capacity 1.0, per-sequence aux": dict(
            ep=2, moe=dict(dispatcher="allgather", router="sigmoid", n_groups=4, topk_groups=2, top_k=4,
                           num_shared_experts=1, bias_update_rate=1e-3, capacity_factor=1.0,
                           aux_loss_per_sequence=True, routed_scaling_factor=1.5)),
    }
    report(run_distributed(parity_worker, 2, scenarios))


@pytest.mark.slow
def test_ep4_and_ep2_x_dp2_match_single_process():
    scenarios = {
        "ep4 alltoall": dict(ep=4),
        "ep2 x edp2 alltoall, capacity 1.25": dict(ep=2, micro=2, moe=dict(capacity_factor=1.25)),
        "ep2 x edp2 allgather, sigmoid": dict(ep=2, moe=dict(dispatcher="allgather", router="sigmoid")),
    }
    report(run_distributed(parity_worker, 4, scenarios))


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


def _exchange_timer_worker(rank, world):
    # Two ep=2 models in one process, the first built with a timer: its exchanges (forward and
    # backward) are timed, the second model's are not, neither while nor after the first runs.
    moe = MoEConfig(num_experts=4, top_k=2, ffn_dim=16)
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, moe=moe)
    mesh = ParallelMesh.build(dp=world, ep=world)
    timer = ExchangeTimer()
    timed, untimed = parity_model(cfg), parity_model(cfg)
    apply_ep(timed, mesh, exchange_timer=timer)
    apply_ep(untimed, mesh)
    batch = [parity_batch(cfg.vocab_size, rank, 0)]
    run_micro_batches(timed, batch, 1.0, None)
    taken = take_moe_stats(timed, timer)
    seconds = ExchangeTimer.seconds(taken[1])
    run_micro_batches(untimed, batch, 1.0, None)
    _, none = take_moe_stats(untimed)
    layout = MoEStatsLayout.of_model(timed, timed=True)
    return seconds > 0, none is None, timer.pop_seconds() == 0.0, "moe/all_to_all_s" in layout.summarize(layout.pack(taken))


@pytest.mark.slow
def test_the_exchange_timer_times_its_own_run_only():
    assert run_distributed(_exchange_timer_worker, 2) == [(True, True, True, True)] * 2
