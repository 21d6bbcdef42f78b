"""Multi-head latent attention under tensor, sequence and context parallelism equals one process.

References (fp32 unless said, tiny MLA models whose value heads (6) are narrower than their
query/key heads (8 + 4), on packed documents of uneven lengths):
- ring attention: `core.attention.varlen_attention` on the whole packed batch, float64, so any
  masking, merging or K|V packing error shows above 1e-12;
- the model: the plain GPT in one process on the whole micro-batch (loss = summed token
  cross-entropy, its gradients). TP shards are gathered along `tp_shard_dim`, CP ranks sum their
  losses and gradients. Tolerance 2e-5 relative (floor 2e-5 of the tensor's largest gradient),
  that of the GQA tests (tests/test_context_parallel.py, tests/test_tensor_parallel.py): only
  the order of sums differs; a latent gradient left partial over tp, or a token attending
  across a document, moves gradients by >1e-2.

All in-process distributed cases run in one spawn of 4 gloo processes (start-up dominates on 2
cores): tp=2 with and without sequence parallelism (with and without a query latent, with biases),
cp=2 and cp=4 ring, cp=2 x tp=2, and dynamic CP on sub-groups. One end-to-end `tessera-train`
case covers the MoE model with expert, pipeline and context parallelism, ZeRO-1, `mla_up` and a
resume at another tp.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from core.attention import varlen_attention
from core.config import ModelConfig
from core.layers import AttentionMeta
from core.mesh import ParallelMesh
from core.parallel.context import CPSubgroups, apply_cp, dynamic_cp_inputs, shard_for_cp
from core.parallel.ring_attention import ring_attention
from core.parallel.tensor import apply_tp, sync_sequence_parallel_grads
from core.train.loss import cross_entropy_sum
from core.train.model import build_model
from dataservice.cp_plan import CostModel, plan_cp_step
from dataservice.packing import IGNORE_INDEX
from tests.support.distributed import run_distributed

MLA = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, ffn_dim=64, attention="mla", kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
CONFIGS = {
    "q_latent": ModelConfig(**MLA, q_lora_rank=12, attention_bias=True),  # wq_a, q_norm, wq_b; biased wkv_a, wo
    "no_q_latent": ModelConfig(**MLA),  # one query projection (V2-Lite's shape)
}
SEED = 7
RTOL = 2e-5
LATENT_PARAMS = ("wq_a.weight", "wq_a.bias", "q_norm.weight", "wkv_a.weight", "wkv_a.bias", "kv_norm.weight")


def packed_batch(lengths: list[int], pad: int = 0, seed: int = 0):
    """Packed documents (labels: the next token of the same document), then a padding segment."""
    g = torch.Generator().manual_seed(seed)
    segs = list(lengths) + ([pad] if pad else [])
    tokens = torch.randint(1, MLA["vocab_size"], (sum(segs),), generator=g)
    labels, positions = torch.full_like(tokens, IGNORE_INDEX), torch.zeros_like(tokens)
    start = 0
    for i, n in enumerate(segs):
        positions[start:start + n] = torch.arange(n)
        if i < len(lengths):
            labels[start:start + n - 1] = tokens[start + 1:start + n]
        else:
            tokens[start:start + n] = 0
        start += n
    cu = torch.tensor([0] + torch.tensor(segs).cumsum(0).tolist(), dtype=torch.int32)
    return tokens, labels, positions, cu


BATCHES = {
    "static": packed_batch([37, 5, 64, 1, 19, 2, 11], pad=5, seed=1),  # 144 tokens: divisible by tp and 2*cp
    # Under a 48-token budget the 150-token document needs a group of 4, the 90-token one 2 or more.
    "dynamic": packed_batch([3, 150, 7, 12, 5, 9, 1, 90, 20, 4, 33, 17], pad=6, seed=2),
}


def reference(cfg: ModelConfig, batch):
    """Single process: (loss sum, {name: grad})."""
    tokens, labels, positions, cu = batch
    model = build_model(cfg, seed=SEED)
    meta = AttentionMeta(cu_seqlens=cu, max_seqlen=int(cu.diff().max()), doc_lengths=tuple(cu.diff().tolist()))
    loss, _ = cross_entropy_sum(model(tokens, positions, meta), labels)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _full_grads(model, tp_group=None):
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dim = getattr(p, "tp_shard_dim", None)
        if tp_group is not None and dim is not None:
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, grad.contiguous(), group=tp_group)
            grad = torch.cat(parts, dim=dim)
        out[name] = grad
    return out


def _sum_over(grads: dict, loss: torch.Tensor, group):
    if group is not None:
        for g in list(grads.values()) + [loss]:
            dist.all_reduce(g, group=group)
    return float(loss), grads


def _ring_errors(group, cp_rank: int, cp_size: int) -> float:
    """Max |ring - reference| over the output and the q/k/v gradients: float64, value heads of 6
    features against query/key heads of 12, two query heads per key/value head, odd lengths."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 13, 1, 22, 7, 2]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = sum(lengths)
    q = torch.randn(total, 4, 12, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(total, 2, 12, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(total, 2, 6, dtype=torch.float64, generator=g).requires_grad_()
    dout = torch.randn(total, 4, 6, dtype=torch.float64, generator=g)
    ref = varlen_attention(q, k, v, cu, max(lengths))
    ref.backward(dout)
    ids = torch.arange(total)
    shard = shard_for_cp(ids, ids, ids, cu, cp_rank, cp_size)
    real, src = shard.source >= 0, shard.source.clamp(min=0)

    def local(x):  # padding rows get arbitrary values: they must not matter
        y = x.detach()[src].clone()
        y[~real] = 0.7
        return y.requires_grad_()

    ql, kl, vl = local(q), local(k), local(v)
    out = ring_attention(ql, kl, vl, shard.meta.extra["cp"], group)
    assert out.shape == (ql.shape[0], 4, 6)
    out.backward(torch.where(real[:, None, None], dout[src], 0.0))
    pairs = [(out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)]
    return max(float((a.detach()[real] - b.detach()[shard.source[real]]).abs().max()) for a, b in pairs)


def _tp(mesh, cfg, batch, sp: bool):
    """tp over the mesh's tp group: loss and gathered gradients, plus what the latent gradients
    were before `sync_sequence_parallel_grads` summed them and which parameters it sums."""
    tokens, labels, positions, cu = batch
    model = apply_tp(build_model(cfg, seed=SEED), mesh, sequence_parallel=sp)
    meta = AttentionMeta(cu_seqlens=cu, max_seqlen=int(cu.diff().max()), doc_lengths=tuple(cu.diff().tolist()))
    loss, _ = cross_entropy_sum(model(tokens, positions, meta), labels, mesh.group("tp"))
    loss.backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("kv_norm.weight")}
    partial = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel_partial", False))
    sync_sequence_parallel_grads(model, mesh)
    return float(loss.detach()), _full_grads(model, mesh.group("tp")), before, partial


def _static_cp(mesh, cfg, batch, tp: bool = False):
    model = build_model(cfg, seed=SEED)
    if tp:
        apply_tp(model, mesh, sequence_parallel=True)
    apply_cp(model, mesh)
    tokens, labels, positions, cu = batch
    s = shard_for_cp(tokens, labels, positions, cu, mesh.coordinate("cp"), mesh.size("cp"), multiple_of=2 if tp else 1)
    loss, _ = cross_entropy_sum(model(s.tokens, s.position_ids, s.meta), s.labels, mesh.group("tp") if tp else None)
    loss.backward()
    if tp:
        sync_sequence_parallel_grads(model, mesh)
    grads = _full_grads(model, mesh.group("tp") if tp else None)
    return _sum_over(grads, loss.detach().clone(), mesh.group("cp"))


def _dynamic_cp(mesh, cfg, batch, budget: int):
    subgroups = CPSubgroups.build(mesh)
    tokens, labels, positions, cu = batch
    plan = plan_cp_step(cu.diff().numpy(), mesh.size("dp_cp"), budget, CostModel(per_token=1e-6, per_pair=1e-8))
    model = apply_cp(build_model(cfg, seed=SEED), None)
    loss = torch.zeros(())
    for entry in plan.for_rank(subgroups.index):
        s = dynamic_cp_inputs(entry, tokens, labels, positions, cu, subgroups)
        part, _ = cross_entropy_sum(model(s.tokens, s.position_ids, s.meta), s.labels)
        part.backward()
        loss += part.detach()
    sizes = sorted({m.group_size for m in plan.microbatches})
    return (*_sum_over(_full_grads(model), loss, dist.group.WORLD), sizes)


def _worker(rank, world):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = {}
    cp4 = ParallelMesh.build(cp=4)
    dp2cp2 = ParallelMesh.build(dp=2, cp=2)
    out["ring_cp4"] = _ring_errors(cp4.group("cp"), cp4.coordinate("cp"), 4)
    out["ring_cp2"] = _ring_errors(dp2cp2.group("cp"), dp2cp2.coordinate("cp"), 2)
    tp2 = ParallelMesh.build(dp=2, tp=2)
    for name, cfg in CONFIGS.items():
        for sp in (False, True):
            out[f"tp2_sp{int(sp)}_{name}"] = _tp(tp2, cfg, BATCHES["static"], sp)
    cfg = CONFIGS["no_q_latent"]
    out["cp2"] = _static_cp(dp2cp2, cfg, BATCHES["static"])
    out["cp2_tp2"] = _static_cp(ParallelMesh.build(cp=2, tp=2), CONFIGS["q_latent"], BATCHES["static"], tp=True)
    out["dynamic"] = _dynamic_cp(cp4, cfg, BATCHES["dynamic"], budget=48)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=300)


def _assert_matches(got, want, what):
    loss, grads = got
    ref_loss, ref_grads = want
    assert loss == pytest.approx(ref_loss, rel=RTOL), what
    assert grads.keys() == ref_grads.keys(), what
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=RTOL, atol=RTOL * float(g.abs().max()),
                                   msg=lambda m: f"{what}: {name}: {m}")


@pytest.mark.slow
def test_ring_attention_with_narrower_value_heads_matches_varlen(results):
    for res in results:
        assert res["ring_cp2"] < 1e-12 and res["ring_cp4"] < 1e-12, (res["ring_cp2"], res["ring_cp4"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tensor_parallel_mla_matches_single_process(results, name, sp):
    ref_loss, ref_grads = reference(CONFIGS[name], BATCHES["static"])
    for res in results:
        loss, grads, before, partial = res[f"tp2_sp{int(sp)}_{name}"]
        # The loss is the mean's numerator here: cross_entropy_sum over the vocab-parallel logits.
        _assert_matches((loss, grads), (ref_loss, ref_grads), f"{name} sp={sp}")
        latent = sorted(n for n in ref_grads if n.split("attention.", 1)[-1] in LATENT_PARAMS)
        assert latent and set(latent) <= set(partial), (latent, partial)  # summed over tp by the sync
        for n, g in before.items():  # one rank's kv_norm gradient covered only its own heads
            assert not torch.allclose(g, ref_grads[n], rtol=1e-3), n


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cp2", "cp2_tp2"])
def test_context_parallel_mla_matches_single_process(results, case):
    name = "q_latent" if case == "cp2_tp2" else "no_q_latent"
    want = reference(CONFIGS[name], BATCHES["static"])
    for res in results:
        _assert_matches(res[case], want, case)


@pytest.mark.slow
def test_dynamic_cp_mla_matches_single_process(results):
    want = reference(CONFIGS["no_q_latent"], BATCHES["dynamic"])
    for res in results:
        loss, grads, sizes = res["dynamic"]
        assert sizes[0] == 1 and sizes[-1] >= 2, sizes  # both plain and ring micro-batches ran
        _assert_matches((loss, grads), want, "dynamic")


# ---- end to end: tessera-train on the MoE model with MLA -------------------------------------

E2E_MLA = ["model.attention=mla", "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
           "model.qk_rope_head_dim=8", "model.v_head_dim=16"]


@pytest.mark.slow
def test_mla_moe_training_matches_single_process_across_layouts_and_a_resharded_resume(tmp_path, dataset):
    """tiny_moe.toml with MLA (value heads 16, query/key heads 24): steps 1-2 at tp=2 x ep=2 (sequence
    parallel, ZeRO-1, `mla_up` recomputed), saved, then resumed at tp=1 for steps 3-4 under pp=2 x
    cp=2 x ep=2 (ring attention over packed rows): every step's loss equals the single process's
    within tests/support/runs.py's RTOL (fp32, reduction order only, over a few AdamW steps).
    The resume loads the tp-sharded MLA weights into another tp (checkpoint resharding)."""
    from tests.support.runs import MOE_CONFIG, NO_SAVE, RTOL, losses, run_train

    run_train(tmp_path / "ref", dataset, 1, "parallel.ep=1", *E2E_MLA, NO_SAVE, config=MOE_CONFIG)
    run = tmp_path / "run"
    run_train(run, dataset, 4, "parallel.ep=2", "parallel.tp=2", 'train.recompute_modules=["mla_up"]',
              "train.stop_at_step=2", *E2E_MLA, config=MOE_CONFIG)
    run_train(run, dataset, 4, "parallel.ep=2", "parallel.pp=2", "parallel.cp=2", "parallel.tp=1", *E2E_MLA,
              resume=True, config=MOE_CONFIG)
    ref, got = losses(tmp_path / "ref"), losses(run)
    assert got.keys() == ref.keys() == {1, 2, 3, 4}
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (step, got, ref)
