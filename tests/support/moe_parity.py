"""Expert parallelism (alone, with data parallelism, with tensor parallelism) against the
single-process MoE model, as one worker run by tests/test_moe_parallel.py and tests/test_moe_tp.py.

Each worker process builds the reference `build_model(cfg, seed)` and runs it on EVERY
data-parallel rank's micro-batches one after another (the aux losses are per micro-batch),
loss = sum(token CE) / global label count, aux losses scaled by 1 / (micro-batches x dp),
gradients accumulated; the parallel model runs only this rank's micro-batches, then
`sync_sequence_parallel_grads` (TP) and `reduce_moe_grads`; every gradient must equal the
reference's slice for this rank, and the MoE statistics summed over all ranks (`moe.stats`, as
the trainer sums them) the reference's. Tolerance (RTOL, with an absolute floor of 1e-6 x the
largest reference gradient of the tensor): tests/test_moe_parallel.py's docstring says why.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from core.config import ModelConfig, MoEConfig
from core.layers import AttentionMeta
from core.mesh import ParallelMesh
from core.parallel.tensor import apply_tp, sync_sequence_parallel_grads
from core.train.loss import cross_entropy_sum
from core.train.model import build_model
from moe.layer import moe_layers, set_moe_loss_scale
from moe.parallel import apply_ep, reduce_moe_grads
from moe.stats import MoEStatsLayout, moe_metrics, take_moe_stats

RTOL = 1e-5
T = 32  # tokens per micro-batch: divisible by tp (sequence parallelism) and by tp again (split)


def parity_batch(vocab: int, dp_rank: int, micro: int):
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


def parity_model(cfg: ModelConfig):
    model = build_model(cfg, seed=5)
    with torch.no_grad():  # a non-zero, identical bias on every rank: selection must agree
        for layer in moe_layers(model):
            layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, cfg.moe.num_experts))
    return model


def run_micro_batches(model, batches, global_labels, tp_group):
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


def parity_worker(rank, world, scenarios):
    """Each scenario (tp, ep, etp, sp, micro-batches, MoE settings) on this rank against the
    reference in this process: the all-reduced loss and every gradient slice at RTOL; returns
    {scenario: worst gradient error relative to the tensor's max |grad|}."""
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
        all_batches = [[parity_batch(cfg.vocab_size, d, m) for m in range(micro)] for d in range(dp)]
        global_labels = float(sum((b[2] != -100).sum() for bs in all_batches for b in bs))

        ref = parity_model(cfg)
        set_moe_loss_scale(ref, micro * dp)
        ref_loss = sum(run_micro_batches(ref, bs, global_labels, None) for bs in all_batches)

        model = parity_model(cfg)
        if tp > 1:
            apply_tp(model, mesh, sequence_parallel=sc["sp"])
        apply_ep(model, mesh, etp=sc.get("etp", 1), sequence_parallel=sc.get("sp", True))
        set_moe_loss_scale(model, micro * dp)
        rows = torch.zeros((), dtype=torch.int64)
        def count_rows(module, args, out):
            rows.add_(args[0].shape[0])

        hooks = [m.experts.register_forward_hook(count_rows) for m in moe_layers(model)]
        loss = run_micro_batches(model, all_batches[mesh.coordinate("dp")], global_labels, tp_group)
        for h in hooks:
            h.remove()
        if tp > 1:
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
            assert expected.shape == param.grad.shape, \
                f"{name} {pname}: {tuple(param.grad.shape)} vs {tuple(expected.shape)}"
            floor = 1e-6 * expected.abs().max().item()
            torch.testing.assert_close(param.grad, expected, rtol=RTOL, atol=floor,
                                       msg=lambda m: f"{name} {pname}: {m}")
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


def report(results):
    """The worst gradient error of each scenario over the ranks, printed and returned."""
    worst = {k: max(r[k] for r in results) for k in results[0]}
    for k, v in worst.items():
        print(f"{k}: worst gradient error relative to max |grad| = {v:.1e}")
    return worst
