"""MoE under pipeline parallelism equals the single-process model: per-sequence balancing
through the 1F1B and interleaved schedules, with recomputation, and with expert parallelism.

Reference: `build_model(cfg, seed)` in each worker, run over EVERY data-parallel rank's
micro-batches one after another (the aux losses are per micro-batch), each micro-batch's CE
sum divided by the step's global label count before backward, aux losses scaled by
1 / (micro-batches x dp) through `set_moe_loss_scale`. The pipelined run, pp=2 x dp=2 on 4
gloo processes (each data-parallel rank its own micro-batches, both of its stages the same
ones): `run_pipeline_step`, then `reduce_moe_grads`. The all-reduced loss, every gradient
(an expert-parallel rank's slice of the experts) and the MoE statistics summed over all
ranks (`moe.stats`, as the trainer sums them) must equal the reference's.

Every micro-batch has its own document boundaries and per-sequence balancing reads them: a
stage that runs micro-batch i's backward (recomputed: its forward again) after micro-batch
i+1's forward must still balance over i's sequences, or the router's gradient is wrong.

Tolerance: as tests/test_moe_parallel.py (fp32 on CPU, only summation order differs): 1e-5
relative, with an absolute floor of 1e-6 x the largest reference gradient of each tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from core.config import Config, MoEConfig
from core.layers import AttentionMeta
from core.mesh import ParallelMesh
from core.parallel.pipeline import build_pipeline_stage, run_pipeline_step
from core.parallel.recompute import apply_recompute
from core.train.data import StepInputs
from core.train.loss import cross_entropy_sum
from core.train.model import build_model
from moe.layer import set_moe_loss_scale
from moe.parallel import apply_ep, reduce_moe_grads
from moe.stats import MoEStatsLayout, moe_metrics, take_moe_stats
from tests.support.distributed import run_distributed

RTOL = 1e-5
TOKENS = 32
MICRO = 4  # micro-batches per data-parallel rank: several in flight on the first stage
SEED = 5


def make_config(schedule: str = "1f1b", virtual: int = 1, ep: int = 1) -> Config:
    """4 layers (0 dense, 1-3 MoE) over pp=2: each stage (or virtual stage) holds MoE layers."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_dim = 64, 32, 4, 4, 2, 64
    m.moe = MoEConfig(num_experts=8, top_k=2, ffn_dim=16, first_k_dense=1, aux_loss_coeff=0.01,
                      aux_loss_per_sequence=True, z_loss_coeff=1e-3)
    p = cfg.parallel
    p.pp, p.dp, p.ep, p.pp_schedule, p.pp_virtual_stages = 2, 2, ep, schedule, virtual
    return cfg


def micro_batch(vocab: int, dp_rank: int, index: int) -> StepInputs:
    """A packed micro-batch of 2-4 documents (boundaries of its own); labels -100 at document ends."""
    g = torch.Generator().manual_seed(100 * dp_rank + index)
    cuts = sorted(torch.randperm(TOKENS - 2, generator=g)[:1 + index % 3].add(1).tolist())
    cu = torch.tensor([0, *cuts, TOKENS], dtype=torch.int32)
    lengths = cu.diff().tolist()
    tokens = torch.randint(0, vocab, (TOKENS,), generator=g)
    labels = tokens.roll(-1)
    labels[cu[1:].long() - 1] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])
    meta = AttentionMeta(cu_seqlens=cu, max_seqlen=max(lengths), doc_lengths=tuple(lengths))
    return StepInputs(tokens, labels, positions, meta, TOKENS, int((labels != -100).sum()))


def _expected_grad(ref_grad: torch.Tensor, param, ep_rank: int, ep: int) -> torch.Tensor:
    if ep > 1 and getattr(param, "ep_shard_dim", None) is not None:
        n = ref_grad.shape[0] // ep
        return ref_grad[ep_rank * n:(ep_rank + 1) * n]
    return ref_grad


def _check_stats(got: dict, want: dict, name: str) -> None:
    assert got.keys() == want.keys() and want, f"{name}: {sorted(got)} vs {sorted(want)}"
    for key, value in want.items():
        if isinstance(value, list):  # loads: the same routing, the same counts
            assert got[key] == value, f"{name} {key}: {got[key]} vs {value}"
        else:
            assert got[key] == pytest.approx(value, rel=RTOL), f"{name} {key}: {got[key]} vs {value}"


def _worker(rank, world, cases):
    torch.manual_seed(0)
    out = {}
    for name, kwargs in cases.items():
        recompute, modules = kwargs.pop("recompute", ("none", ()))
        cfg = make_config(**kwargs)
        p = cfg.parallel
        mesh = ParallelMesh.build(pp=p.pp, dp=p.dp, ep=p.ep)
        batches = [[micro_batch(cfg.model.vocab_size, d, i) for i in range(MICRO)] for d in range(p.dp)]
        global_labels = float(sum(mb.num_labels for bs in batches for mb in bs))

        ref = build_model(cfg.model, seed=SEED)
        set_moe_loss_scale(ref, MICRO * p.dp)
        ref_loss = 0.0
        for mb in (mb for bs in batches for mb in bs):
            part, _ = cross_entropy_sum(ref(mb.tokens, mb.position_ids, mb.meta), mb.labels)
            (part / global_labels).backward()
            ref_loss += float(part)

        model = build_model(cfg.model, seed=SEED)
        apply_ep(model, mesh)
        set_moe_loss_scale(model, MICRO * p.dp)
        stage = build_pipeline_stage(model, mesh, cfg)
        for chunk in stage.chunks:
            apply_recompute(chunk, recompute, modules)
        result = run_pipeline_step(stage, batches[mesh.coordinate("dp")],
                                   lambda logits, mb: cross_entropy_sum(logits, mb.labels), mesh, cfg,
                                   loss_divisor=global_labels)
        reduce_moe_grads(model, mesh)

        loss = result.loss_sum.double().reshape(1)
        dist.all_reduce(loss, group=mesh.group("dp_cp"))
        assert float(loss) == pytest.approx(ref_loss, rel=RTOL), name
        ref_grads = dict(ref.named_parameters())
        names = []
        for pname, param in stage.named_parameters():
            want = _expected_grad(ref_grads[pname].grad, param, mesh.coordinate("ep"), p.ep)
            torch.testing.assert_close(param.grad, want, rtol=RTOL, atol=1e-6 * want.abs().max().item(),
                                       msg=lambda m: f"{name} {pname}: {m}")
            names.append(pname)

        layout = MoEStatsLayout.of_run(cfg.model, mesh, etp=1, timed=False)
        stats = layout.pack(take_moe_stats(model))
        dist.all_reduce(stats)
        _check_stats(layout.summarize(stats), moe_metrics(ref), name)
        out[name] = names
    return out


CASES = {
    "pp2 x dp2, 1f1b": dict(),
    "pp2 x dp2, interleaved v2": dict(schedule="interleaved", virtual=2),
    "pp2 x dp2, 1f1b, whole blocks recomputed": dict(recompute=("full", ())),
    "pp2 x dp2, interleaved v2, feed-forwards recomputed": dict(schedule="interleaved", virtual=2,
                                                               recompute=("none", ("mlp",))),
    "pp2 x ep2 (dp2), 1f1b": dict(ep=2),
}


@pytest.mark.slow
def test_moe_pipelines_with_per_sequence_aux_match_single_process():
    per_rank = run_distributed(_worker, 4, {name: dict(kw) for name, kw in CASES.items()})
    every = {name for name, _ in build_model(make_config().model, seed=SEED).named_parameters()}
    for name in CASES:  # every parameter of the plain model lives on some stage
        assert set().union(*(r[name] for r in per_rank)) == every, name
