"""Data parallelism and the optimizer against the single-process reference (gloo, CPU, fp32).

Reference: `build_model(cfg, seed)` trained in one process on the whole global batch with
torch.optim.AdamW (same decay rule, same warmup-cosine LR) and torch.nn.utils.clip_grad_norm_.
Each DP rank takes its share of the rows; loss = sum CE / global token count, so summed
gradients equal the reference's.

Tolerance: the only difference is the order in which fp32 partial gradients are added (per-rank
sums, then the collective), ~1e-7 relative per gradient. Adam divides by sqrt(v), which can
amplify that on near-zero gradients, so parameters are compared at atol=rtol=1e-5 after a few
steps (observed max differences are ~1e-7); the clipped norm at rtol=1e-5.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from core.config import ModelConfig
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.train.optim import AdamW, WarmupCosine, clip_grad_norm_
from core.parallel.data import apply_data_parallel, chunk_bounds, zero_shard_dim
from tests.support.cli import ROOT, child_env
from tests.support.distributed import run_distributed
from tests.support.toy import (CFG, HYPER, ToyTP, batch_loss, global_batch, make_trainer, reference_run, toy_pieces,
                               toy_reference, toy_train, train_steps)

NUMEL = sum(p.numel() for p in build_model(ModelConfig(**CFG), seed=7).parameters())


def full_params(model):
    # numpy, not tensors: tensors cross the result queue by shared-memory handles that die with the worker.
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------- workers
def _dp_worker(rank, world, variants):
    mesh = ParallelMesh.build(dp=world)
    out = {}
    for name, kw in variants.items():
        model, dp, opt, sched = make_trainer(mesh, zero=kw.get("zero", True), bucket_mb=kw.get("bucket_mb", 0.01))
        if kw.get("fallback"):
            dp.use_reduce_scatter = False
        losses, norms = train_steps(model, dp, opt, sched, mesh, kw["steps"], accum=kw.get("accum", 1), clip=kw.get("clip"))
        out[name] = dict(losses=losses, norms=norms, params=full_params(model) if rank == 0 else None,
                         state_bytes=opt.state_bytes(), buckets=len(dp.buckets), stats=dict(dp.stats))
        dp.remove()
    # bf16 params: fp32 masters are separate copies (only bytes measured; no training on CPU).
    out["bf16_state_bytes"] = make_trainer(mesh, param_dtype=torch.bfloat16)[2].state_bytes()
    return out


def _check_state_bytes(results, dp):
    """ZeRO-1 state per rank is 1/dp of the unsharded state, up to uneven chunking (a rank
    holds at most ceil(dim/dp) rows of a param), and the ranks' shares sum to it exactly."""
    for key, per_elem in (("zero", 8), ("bf16_state_bytes", 12)):
        shares = [r[key]["state_bytes"] if key == "zero" else r[key] for r in results]
        assert sum(shares) == per_elem * NUMEL, (key, shares)
        assert max(shares) <= per_elem * NUMEL / dp * 1.1, (key, shares)
        print(f"optimizer state bytes per rank, dp={dp}, {'fp32' if per_elem == 8 else 'bf16'}: {shares}")


def _check_against_reference(result, steps, clip):
    ref_losses, ref_norms, ref_params = reference_run(steps, clip)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)
    worst = max(float((torch.from_numpy(result["params"][n]) - ref).abs().max()) for n, ref in ref_params.items())
    print(f"max |param - reference| after {steps} steps: {worst:.2e}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(torch.from_numpy(result["params"][name]), ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_dp2_plain_zero_accumulation_and_fallback_match_single_process():
    variants = {
        "zero": dict(steps=4),
        "plain": dict(steps=4, zero=False),
        "zero_accum2": dict(steps=4, accum=2, clip=0.3),
        "zero_allreduce_fallback": dict(steps=3, fallback=True),
    }
    results = run_distributed(_dp_worker, 2, variants)
    for name, kw in variants.items():
        _check_against_reference(results[0][name], kw["steps"], kw.get("clip"))
        assert results[0][name]["losses"] == results[1][name]["losses"]
    # Several buckets, all launched from backward hooks (overlap), none left to finish.
    stats = results[0]["zero"]["stats"]
    assert results[0]["zero"]["buckets"] >= 4
    assert stats["launched_in_backward"] == 4 * results[0]["zero"]["buckets"] and stats["launched_at_finish"] == 0
    # Clipping really clipped (norm above max) and still matched the reference.
    assert min(results[0]["zero_accum2"]["norms"]) > 0.3
    _check_state_bytes(results, 2)


DP4_VARIANTS = {"zero": dict(steps=3, clip=0.2), "plain": dict(steps=1, zero=False)}


def _world4_worker(rank, world):
    """One spawn of 4 processes serves three tests (process start-up dominates their cost)."""
    return {"dp4": _dp_worker(rank, world, DP4_VARIANTS), "tp": _toy_tp_worker(rank, world), "expert": _expert_worker(rank, world)}


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4_worker, 4)


@pytest.mark.slow
def test_dp4_zero_with_clipping_matches_single_process_and_state_shrinks(world4):
    results = [r["dp4"] for r in world4]
    _check_against_reference(results[0]["zero"], 3, 0.2)
    _check_against_reference(results[0]["plain"], 1, None)
    assert min(results[0]["zero"]["norms"]) > 0.2
    assert results[0]["plain"]["state_bytes"] == 8 * NUMEL  # unsharded: every rank holds it all
    _check_state_bytes(results, 4)


def test_optimizer_state_bytes_at_dp1():
    # fp32: two fp32 moments per element, the master is the param itself; bf16 adds an fp32
    # master copy. dp=2 and dp=4 are measured in the spawned tests above (1/dp of these).
    mesh = ParallelMesh.build()
    assert make_trainer(mesh)[2].state_bytes() == 8 * NUMEL
    assert make_trainer(mesh, param_dtype=torch.bfloat16)[2].state_bytes() == 12 * NUMEL
    print(f"optimizer state bytes per rank, dp=1: fp32 {8 * NUMEL}, bf16 {12 * NUMEL} ({NUMEL} params)")


# ---------------------------------------------------------------- TP / SP / expert attributes
def _toy_tp_worker(rank, world):
    mesh = ParallelMesh.build(dp=2, tp=2)
    model = ToyTP(2, mesh.coordinate("tp"))
    dp = apply_data_parallel(model, mesh)
    # ZeRO dims avoid the TP dims: w (tp dim 0) -> 1, v (tp dim 1) -> 0, g -> 0.
    assert [s.shard_dim for s in dp.slots] == [1, 0, 0]
    opt = AdamW(dp, lr=0.05, weight_decay=0.1)
    losses = toy_train(model, dp, opt, mesh, 3)
    return losses, *(p.detach().numpy().copy() for p in (model.w, model.v, model.g))


@pytest.mark.slow
def test_tp_sharded_and_sequence_parallel_params_reduce_and_clip_like_single_process(world4):
    ref_losses, ref = toy_reference(3)
    results = [r["tp"] for r in world4]
    for rank, (losses, *params) in enumerate(results):
        w, v, g = map(torch.from_numpy, params)
        t = rank % 2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w, ref.w.detach()[2 * t:2 * t + 2], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, ref.v.detach()[:, 2 * t:2 * t + 2], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g, ref.g.detach(), rtol=1e-5, atol=1e-6)


class ToyExpert(nn.Module):
    """Dense w [4,3], norm-like g [3], and one expert row x [1,3] of a global X [2,3] sharded
    over ep (ep_shard_dim 0); rank with expert index e uses X[e]."""

    def __init__(self, experts: slice):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.w, self.g = nn.Parameter(torch.randn(4, 3, generator=g)), nn.Parameter(torch.ones(3))
        self.x = nn.Parameter(torch.randn(2, 3, generator=g)[experts].clone())
        self.x.expert_parallel = experts != slice(None)

    def forward(self, inp: torch.Tensor, expert: int) -> torch.Tensor:
        x = self.x[expert] if self.x.shape[0] == 2 else self.x[0]
        h = inp * self.g
        return torch.tanh(h @ self.w.T).sum() + (torch.tanh(h) * x).sum() ** 2


def _expert_worker(rank, world):
    mesh = ParallelMesh.build(dp=4, ep=2)
    e = mesh.coordinate("ep")
    model = ToyExpert(slice(e, e + 1))
    dp = apply_data_parallel(model, mesh)
    assert [(s.group_name, s.group_size, s.shard_dim) for s in dp.slots] == [("dp_cp", 4, 0), ("dp_cp", 4, 0), ("edp", 2, 1)]
    opt = AdamW(dp, lr=0.05, weight_decay=0.1)
    norms = []
    for step in range(3):
        inp = toy_pieces(step)[rank]
        model(inp, e).backward()
        norms.append(float(clip_grad_norm_(dp, 0.5, mesh)))
        opt.step()
        opt.zero_grad()
    return norms, *(p.detach().numpy().copy() for p in (model.w, model.x))


@pytest.mark.slow
def test_expert_params_reduce_over_edp_and_count_once_in_the_norm(world4):
    ref = ToyExpert(slice(None))
    opt = torch.optim.AdamW([{"params": [ref.w, ref.x], "weight_decay": 0.1}, {"params": [ref.g], "weight_decay": 0.0}],
                            lr=0.05, betas=(0.9, 0.95))
    ref_norms = []
    for step in range(3):
        # ep index of dp rank i is i % 2 (MoE folding: expert rank = i % ep).
        sum(ref(x, i % 2) for i, x in enumerate(toy_pieces(step))).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    results = [r["expert"] for r in world4]
    for rank, (norms, *params) in enumerate(results):
        w, x = map(torch.from_numpy, params)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w, ref.w.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x, ref.x.detach()[rank % 2:rank % 2 + 1], rtol=1e-5, atol=1e-6)
    assert max(ref_norms) > 0.5  # clipping was active


# ------------------------------------------------------------------------------- units
def test_chunking_layout_and_errors():
    assert chunk_bounds(5, 4) == [(0, 2), (2, 2), (4, 1), (5, 0)]  # torch.chunk + trailing empty
    assert [n for _, n in chunk_bounds(66, 4)] == [17, 17, 17, 15]
    p = nn.Parameter(torch.zeros(4, 6))
    assert zero_shard_dim(p) == 0
    p.tp_shard_dim = 0
    assert zero_shard_dim(p) == 1
    bias = nn.Parameter(torch.zeros(4))
    bias.tp_shard_dim = 0
    assert zero_shard_dim(bias) is None
    mesh = ParallelMesh.build()
    with pytest.raises(ValueError, match="grad_reduce='avg' must be one of sum, mean"):
        apply_data_parallel(nn.Linear(2, 2), mesh, grad_reduce="avg")
    with pytest.raises(ValueError, match="bucket_mb=0 must be a positive"):
        apply_data_parallel(nn.Linear(2, 2), mesh, bucket_mb=0)
    with pytest.raises(ValueError, match="min_lr=1.0 must lie between 0 and lr=0.1"):
        WarmupCosine(SimpleNamespace(lr=0), 0.1, 1.0, 0, 10)


def test_schedule_and_accumulation_errors_single_process():
    sched = WarmupCosine(SimpleNamespace(lr=0.0), 1.0, 0.1, 4, 14)
    assert [round(sched.lr_at(s), 6) for s in (0, 3, 4, 9, 14, 20)] == [0.25, 1.0, 1.0, 0.55, 0.1, 0.1]
    sched.step()
    sched.step()
    assert sched.optimizer.lr == 0.75 and sched.state_dict()["last_step"] == 2
    # Without no_sync on the first micro-batch, the second would reduce twice: a clear error.
    model, dp, opt, _ = make_trainer(ParallelMesh.build())
    inputs, labels = global_batch(0)
    batch_loss(model, inputs[:4], labels[:4], 100).backward()
    with pytest.raises(RuntimeError, match="arrived twice.*no_sync"):
        batch_loss(model, inputs[4:], labels[4:], 100).backward()


# ------------------------------------------------------------------------------- GPU (NCCL)
def run_nccl(fn, world, *args):
    return run_distributed(fn, world, *args, backend="nccl")


def _gpu_worker(rank, world, ckpt_dir):
    from core.state.checkpoint import load_checkpoint, save_checkpoint

    mesh = ParallelMesh.build(dp=world)
    model, dp, opt, sched = make_trainer(mesh, param_dtype=torch.bfloat16, device="cuda")
    dtypes = (model.output.weight.dtype, dp.slots[0].master.dtype, dp.slots[0].main_grad.dtype)
    first = train_steps(model, dp, opt, sched, mesh, 1, accum=2, clip=0.3)  # NCCL communicators start here
    rest = train_steps(model, dp, opt, sched, mesh, 3, accum=2, clip=0.3, start=1, no_host_sync=True, defer_clip=True)
    save_checkpoint(ckpt_dir, 4, model, opt, sched, mesh, {"resume_token": "t"})
    fresh, fresh_dp, fresh_opt, fresh_sched = make_trainer(mesh, param_dtype=torch.bfloat16, device="cuda")
    load_checkpoint(f"{ckpt_dir}/step_000004", fresh, fresh_opt, fresh_sched, mesh)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    same &= all(torch.equal(a.master, b.master) for a, b in zip(dp.slots, fresh_dp.slots))
    same &= all(torch.equal(a, b) for a, b in zip(opt.exp_avg_sq, fresh_opt.exp_avg_sq))
    return dict(losses=first[0] + rest[0], norms=first[1] + rest[1], dtypes=[str(d) for d in dtypes],
                stats=dict(dp.stats), buckets=len(dp.buckets), reloaded_equal=bool(same))


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_bf16_zero_matches_fp32_reference_without_host_syncs(tmp_path):
    """bf16 params, fp32 main grads and masters, ZeRO-1 over 2 GPUs with accumulation and
    clipping, against the fp32 CPU reference: bf16 rounding of weights and activations,
    compounded over 4 steps, so losses and norms at 2e-2 relative."""
    ref_losses, ref_norms, _ = reference_run(4, 0.3)
    results = run_nccl(_gpu_worker, 2, str(tmp_path))
    for r in results:
        print(f"nccl bf16 dp=2: losses {r['losses']} vs fp32 reference {ref_losses}")
        assert r["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32"]
        assert r["losses"] == pytest.approx(ref_losses, rel=2e-2) and r["norms"] == pytest.approx(ref_norms, rel=2e-2)
        assert r["stats"] == {"launched_in_backward": 4 * r["buckets"], "launched_at_finish": 0, "fused_grads": 0}
        assert r["reloaded_equal"]


def _deferred_clip_worker(rank, world):
    mesh = ParallelMesh.build(dp=world)
    model, dp, _, _ = make_trainer(mesh)
    opt = AdamW(dp, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=HYPER["wd"], fused=True)
    sched = WarmupCosine(opt, HYPER["lr"], HYPER["min_lr"], HYPER["warmup"], HYPER["max_steps"])
    # The trainer's path: the clip factor rides into torch's fused AdamW as its grad_scale.
    losses, norms = train_steps(model, dp, opt, sched, mesh, 4, accum=2, clip=0.3, defer_clip=True)
    return dict(losses=losses, norms=norms, params=full_params(model) if rank == 0 else None)


@pytest.mark.slow
def test_deferred_clip_in_fused_adamw_matches_single_process():
    # dp=2 with ZeRO, 2 micro-batches per step (the first copies into main_grad, the second
    # adds), clipping active (0.3 < the norms): same as torch.optim.AdamW after explicit clipping.
    results = run_distributed(_deferred_clip_worker, 2)
    _check_against_reference(results[0], 4, 0.3)


def _triton_adamw_worker(rank, world):
    mesh = ParallelMesh.build(dp=world)
    out = {}
    for name, zero, dtype, one_pass in (("fp32_zero", True, torch.float32, True),
                                        ("bf16_zero", True, torch.bfloat16, True), ("bf16_zero_torch", True, torch.bfloat16, False),
                                        ("bf16_plain", False, torch.bfloat16, True), ("bf16_plain_torch", False, torch.bfloat16, False)):
        model, dp, opt, sched = make_trainer(mesh, zero=zero, param_dtype=dtype)
        opt.fused = True
        if not one_pass:  # torch's fused kernel and the separate copy; the model's own kernels unchanged
            opt._triton_step = lambda clip: False
        losses, norms = train_steps(model, dp, opt, sched, mesh, 1, accum=2, clip=0.3, defer_clip=True)
        first_step = dict(masters=[s.master.numpy().copy() for s in dp.slots], params=full_params(model))
        more = train_steps(model, dp, opt, sched, mesh, 3, accum=2, clip=0.3, start=1, defer_clip=True)
        out[name] = dict(losses=losses + more[0], norms=norms + more[1], first_step=first_step,
                         params=full_params(model), ran_triton=opt._tables._key is not None)
        dp.remove()
    return out


def check_one_pass_adamw():
    """The Triton AdamW that also writes the new weights (core.kernels.adamw), dp=2 with
    accumulation and a deferred clip: with fp32 params (ZeRO: the weights go out through the
    all-gather's send buffer) against the torch.optim reference at the file's tolerance; with
    bf16 params, sharded and not, against torch's fused kernel plus the separate copy after one
    step (masters within 1e-6, params within one bf16 rounding step of them), then the losses."""
    results = run_distributed(_triton_adamw_worker, 2)
    first = results[0]
    assert {k: v["ran_triton"] for k, v in first.items()} == {
        "fp32_zero": True, "bf16_zero": True, "bf16_zero_torch": False, "bf16_plain": True, "bf16_plain_torch": False}
    _check_against_reference(first["fp32_zero"], 4, 0.3)
    for name in ("bf16_zero", "bf16_plain"):
        for rank, r in enumerate(results):
            got, want = r[name]["first_step"], r[f"{name}_torch"]["first_step"]
            worst = max(float(abs(a - b).max()) for a, b in zip(got["masters"], want["masters"]))
            print(f"{name}, rank {rank}: max |master - torch fused| after one step {worst:.2e}")
            for a, b in zip(got["masters"], want["masters"]):
                torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-6, atol=1e-7)
            for key, b in want["params"].items():  # bf16 of a master a rounding apart can differ by one step
                torch.testing.assert_close(torch.from_numpy(got["params"][key]), torch.from_numpy(b), rtol=8e-3, atol=0)
        # Later steps: bf16 forward passes let those rounding differences grow (Adam normalises
        # tiny gradients), so only the losses are compared.
        assert first[name]["losses"] == pytest.approx(first[f"{name}_torch"]["losses"], rel=1e-4)


def _split_master_worker(rank, world, ckpt_dir):
    from core.state.checkpoint import load_checkpoint, save_checkpoint

    mesh = ParallelMesh.build(dp=world)
    out = {}
    for name, zero, split, one_pass in (("zero", True, False, True), ("zero_split", True, True, True),
                                        ("plain_split", False, True, True), ("zero_torch", True, False, False),
                                        ("zero_split_torch", True, True, False)):
        model, dp, opt, sched = make_trainer(mesh, zero=zero, param_dtype=torch.bfloat16, split=split)
        opt.fused = True
        if not one_pass:
            opt._triton_step = lambda clip: False
        losses, _ = train_steps(model, dp, opt, sched, mesh, 1, accum=2, clip=0.3, defer_clip=True)
        first = dict(masters=[s.master.numpy().copy() for s in dp.slots], params=full_params(model))
        more, _ = train_steps(model, dp, opt, sched, mesh, 2, accum=2, clip=0.3, start=1, defer_clip=True)
        out[name] = dict(losses=losses + more, first=first, state_bytes=opt.state_bytes(),
                         ran_triton=opt._tables._key is not None)
        if name == "zero_split":  # a checkpoint of split masters resumes split and unsplit, exactly
            save_checkpoint(ckpt_dir, 3, model, opt, sched, mesh, {})
            masters = [s.master for s in dp.slots]
            for fresh_split in (True, False):
                _, fresh_dp, fresh_opt, fresh_sched = make_trainer(mesh, param_dtype=torch.bfloat16, split=fresh_split)
                load_checkpoint(f"{ckpt_dir}/step_000003", fresh_dp.model, fresh_opt, fresh_sched, mesh)
                out[f"reload_{fresh_split}"] = all(torch.equal(a.view(torch.int32), b.master.view(torch.int32))
                                                   for a, b in zip(masters, fresh_dp.slots))
        dp.remove()
    return out


def check_split_masters(ckpt_dir):
    """Split masters (bf16 weight + int16 low half) through the one-pass AdamW and through
    torch's fused kernel: after one step the masters are bit-equal to fp32 masters' (the same
    arithmetic on the same values), the bf16 weights within one rounding step (ties round away
    from zero); state 2 bytes per parameter less; a checkpoint resumes split or not exactly."""
    results = run_distributed(_split_master_worker, 2, ckpt_dir)
    for rank, r in enumerate(results):
        assert [r[k]["ran_triton"] for k in ("zero", "zero_split", "plain_split", "zero_torch", "zero_split_torch")] == [
            True, True, True, False, False]
        for name, same_as in (("zero_split", "zero"), ("zero_split_torch", "zero_torch")):
            for a, b in zip(r[name]["first"]["masters"], r[same_as]["first"]["masters"]):
                assert a.tobytes() == b.tobytes(), (rank, name)
        for key, want in r["zero"]["first"]["params"].items():
            torch.testing.assert_close(torch.from_numpy(r["zero_split"]["first"]["params"][key]),
                                       torch.from_numpy(want), rtol=8e-3, atol=0)
        assert r["zero"]["state_bytes"] - r["zero_split"]["state_bytes"] == sum(a.size for a in r["zero"]["first"]["masters"]) * 2
        assert r["reload_True"] and r["reload_False"], rank
        for name in ("zero_split", "plain_split", "zero_split_torch"):
            assert r[name]["losses"] == pytest.approx(r["zero"]["losses"], rel=1e-4), name
    print("split masters: bit-equal after one step; losses", results[0]["zero_split"]["losses"], "vs", results[0]["zero"]["losses"])


@pytest.mark.slow
def test_one_pass_adamw_matches_single_process_and_torch_fused(tmp_path):
    """check_one_pass_adamw and check_split_masters under Triton's interpreter on CPU, in a fresh interpreter (this
    file run as a script): Triton picks the interpreter when it is imported, and the ranks of this process's spawn
    server imported it without."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, __file__, str(tmp_path)], cwd=ROOT, env=child_env(TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stderr[-5000:]
    assert "bf16_plain, rank 1: max |master - torch fused|" in run.stdout and "split masters: bit-equal" in run.stdout


def test_param_without_grad_this_step_reduces_as_zero():
    # main_grad is not zeroed between steps (the step's first grad overwrites it); a param that
    # gets no grad in a step must still count as zero, not as last step's grad.
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    model = nn.ParameterList([a, b])
    dp = apply_data_parallel(model, ParallelMesh.build(), bucket_mb=0.01, distributed_optimizer=False)
    (a * 2 + b * 5).sum().backward()
    dp.finish_grad_sync()
    assert dp.slots[1].shard_grad.tolist() == [5.0] * 3 and a.grad is None and b.grad is None
    dp.zero_grad()
    (a * 3).sum().backward()
    dp.finish_grad_sync()
    assert dp.slots[0].shard_grad.tolist() == [3.0] * 3
    assert dp.slots[1].shard_grad.tolist() == [0.0] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_pass_adamw_on_gpu_fp32_and_split_masters_against_torch_fused():
    """The compiled kernel (not the interpreter): three steps on tensors of awkward sizes, fp32
    masters against torch's fused AdamW (1e-6), split masters bit-equal to the fp32 ones, the
    bf16 weights of both within one rounding step of the masters."""
    from core.kernels.adamw import AdamWTables, join_master, multi_tensor_adamw, split_master

    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 1000, 4097, 3 * 1024 * 1024 + 5]
    start = [torch.randn(n, device="cuda", generator=gen) * 0.02 for n in sizes]
    grads = [[torch.randn(n, device="cuda", generator=gen) * 1e-3 for n in sizes] for _ in range(3)]
    decays, hyper = [0.1, 0.0, 0.1, 0.1], dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    zeros = lambda: [torch.zeros_like(m) for m in start]  # noqa: E731
    fp32, fp32_moments, outs = [m.clone() for m in start], (zeros(), zeros()), [m.bfloat16() for m in start]
    halves = [split_master(m) for m in start]
    highs, lows, split_moments = [h for h, _ in halves], [low for _, low in halves], (zeros(), zeros())
    ref = [torch.nn.Parameter(m.clone()) for m in start]
    torch_opt = torch.optim.AdamW([{"params": [p], "weight_decay": d} for p, d in zip(ref, decays)], fused=True, **hyper)
    tables, split_tables = AdamWTables(), AdamWTables()
    for step, g in enumerate(grads, 1):
        multi_tensor_adamw(tables, fp32, g, *fp32_moments, outs, decays, step=step, grad_scale=None, **hyper)
        multi_tensor_adamw(split_tables, highs, g, *split_moments, [None] * len(sizes), decays, step=step,
                           grad_scale=None, lows=lows, **hyper)
        for p, grad in zip(ref, g):
            p.grad = grad.clone()
        torch_opt.step()
    for master, high, low, out, want in zip(fp32, highs, lows, outs, ref):
        torch.testing.assert_close(master, want.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(join_master(high, low).view(torch.int32), master.view(torch.int32))
        torch.testing.assert_close(out.float(), master, rtol=8e-3, atol=0)
        torch.testing.assert_close(high.float(), master, rtol=8e-3, atol=0)


if __name__ == "__main__":  # the fresh interpreter of test_one_pass_adamw_matches_single_process_and_torch_fused
    check_one_pass_adamw()
    check_split_masters(sys.argv[1])
