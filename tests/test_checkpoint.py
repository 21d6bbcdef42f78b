"""Checkpoints: save at one layout, load at another, keep training; a killed save loses nothing.

Reference for "continues": the uninterrupted run on the same global batches (the single-process
AdamW run of tests/support/toy.py, as in tests/test_data_parallel.py). Tolerance as there (fp32,
reduction order only): rtol 1e-5 on losses. Layouts: dp=2 (ZeRO-1) -> dp=4 (ZeRO-1 and plain
AdamW) -> dp=1 (no process group); tensor-parallel resharding dp=2 x tp=2 -> dp=4 x tp=1 with the real
`apply_tp` GPT (sequence parallel, grads clipped), and dp=2 x tp=2 -> dp=4 x tp=1 -> dp=1 on a
toy model whose params carry the same `tp_shard_dim` / `tp_full_shape` tags, small enough to
give empty ZeRO chunks.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core import placement
from core.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from core.config import ModelConfig, MoEConfig
from core.mesh import ParallelMesh
from core.layers import AttentionMeta
from core.train.model import build_model
from core.train.optim import AdamW, clip_grad_norm_
from core.parallel.data import apply_data_parallel
from moe.experts import GroupedExperts
from tests.support.distributed import context, free_port, run_distributed
from tests.support.toy import ToyTP, make_trainer, reference_run, toy_reference, toy_train, train_steps

RTOL = 1e-5
TP_CLIP = 0.3  # below the norms of these steps: clipping is active in the TP run


def _save_dp2(rank, world, root):
    mesh = ParallelMesh.build(dp=2)
    model, dp, opt, sched = make_trainer(mesh)
    first, _ = train_steps(model, dp, opt, sched, mesh, 3)
    path = save_checkpoint(root, 3, model, opt, sched, mesh, {"resume_token": "token-at-3"})
    return first, str(path)


def _scramble(model):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)


def _load_gpt_and_continue(mesh, path, zero=True, clip=None):
    model, dp, opt, sched = make_trainer(mesh, zero=zero)
    _scramble(model)  # whatever the model held must be replaced by the checkpoint
    step, extra = load_checkpoint(path, model, opt, sched, mesh)
    assert (step, extra, opt.step_count, sched.last_step) == (3, {"resume_token": "token-at-3"}, 3, 3)
    losses, norms = train_steps(model, dp, opt, sched, mesh, 3, start=3, clip=clip)
    dp.remove()
    return (losses, norms) if clip else losses


def _toy_trainer(mesh, tp):
    model = ToyTP(tp, mesh.coordinate("tp"))
    dp = apply_data_parallel(model, mesh)
    return model, dp, AdamW(dp, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)


def _world4(rank, world, gpt_path, toy_root, tp_root):
    out = {}
    # The real tensor-parallel GPT (core.parallel.tensor.apply_tp, sequence parallel, vocab-
    # parallel loss) with ZeRO-1 and clipping at dp=2 x tp=2, saved, continued at dp=4 x tp=1.
    mesh_tp = ParallelMesh.build(dp=2, tp=2)
    model, dp, opt, sched = make_trainer(mesh_tp)
    out["gpt_tp_first"] = train_steps(model, dp, opt, sched, mesh_tp, 3, clip=TP_CLIP)
    save_checkpoint(tp_root, 3, model, opt, sched, mesh_tp, {"resume_token": "token-at-3"})
    dp.remove()
    out["gpt_tp_next"] = _load_gpt_and_continue(ParallelMesh.build(dp=4), latest_checkpoint(tp_root), clip=TP_CLIP)
    # Toy TP model: train 3 steps at dp=2 x tp=2 and save ...
    mesh_tp = ParallelMesh.build(dp=2, tp=2)
    model, dp, opt = _toy_trainer(mesh_tp, 2)
    out["toy_first"] = toy_train(model, dp, opt, mesh_tp, 3)
    out["toy_path"] = str(save_checkpoint(toy_root, 3, model, opt, None, mesh_tp, {"k": 1}))
    dp.remove()
    # ... and continue at dp=4 x tp=1 (the ZeRO chunk of w along dim 1 is empty on rank 3).
    mesh_dp = ParallelMesh.build(dp=4)
    model, dp, opt = _toy_trainer(mesh_dp, 1)
    _scramble(model)
    assert load_checkpoint(out["toy_path"], model, opt, None, mesh_dp) == (3, {"k": 1})
    assert [s.bounds[3][1] for s in dp.slots] == [0, 0, 0]  # w: 3 cols, v: 3 rows, g: 3 over 4 ranks
    out["toy_next"] = toy_train(model, dp, opt, mesh_dp, 3, start=3)
    dp.remove()
    # GPT saved at dp=2: continue at dp=4 with ZeRO-1 and with plain AdamW.
    out["gpt_zero"] = _load_gpt_and_continue(mesh_dp, gpt_path, zero=True)
    out["gpt_plain"] = _load_gpt_and_continue(mesh_dp, gpt_path, zero=False)
    return out


def _world4_all(rank, world, gpt_path, root):
    """One spawn of 4 processes for the layout and the expert tests (start-up dominates)."""
    out = _world4(rank, world, gpt_path, f"{root}/toy", f"{root}/tp")
    out["moe"] = _moe_worker(rank, world, f"{root}/moe")
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    first, gpt_path = run_distributed(_save_dp2, 2, str(root / "gpt"))[0]
    return root, first, gpt_path, run_distributed(_world4_all, 4, gpt_path, str(root))


@pytest.mark.slow
def test_save_at_one_layout_load_at_others_and_continue(saved):
    root, first, gpt_path, results = saved
    ref_losses, _, _ = reference_run(6, None)
    torch.testing.assert_close(torch.tensor(first), torch.tensor(ref_losses[:3]), rtol=RTOL, atol=0)
    assert latest_checkpoint(root / "gpt") == Path(gpt_path)

    toy_ref, _ = toy_reference(6)
    clip_losses, clip_norms, _ = reference_run(6, TP_CLIP)
    assert min(clip_norms) > TP_CLIP
    for r in results:
        losses = r["gpt_tp_first"][0] + r["gpt_tp_next"][0]
        norms = r["gpt_tp_first"][1] + r["gpt_tp_next"][1]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(clip_losses), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(clip_norms), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(r["toy_first"]), torch.tensor(toy_ref[:3]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(r["toy_next"]), torch.tensor(toy_ref[3:]), rtol=RTOL, atol=0)
        for key in ("gpt_zero", "gpt_plain"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(ref_losses[3:]), rtol=RTOL, atol=0)

    # dp=1 in this very process, without any process group: the same files load as full tensors.
    assert _load_gpt_and_continue(ParallelMesh.build(), gpt_path) == _approx(ref_losses[3:])
    mesh = ParallelMesh.build()
    model = ToyTP(1, 0)
    dp = apply_data_parallel(model, mesh)
    opt = AdamW(dp, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    load_checkpoint(results[0]["toy_path"], model, opt, None, mesh)
    _, ref_model = toy_reference(3)
    for name in ("w", "v", "g"):
        torch.testing.assert_close(getattr(model, name).detach(), getattr(ref_model, name).detach(), rtol=1e-5, atol=1e-6)


def _approx(values):
    return pytest.approx(values, rel=RTOL)


# ------------------------------------------------------------------- a save that dies
def _killed_worker(rank, world, port, root, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = ParallelMesh.build(dp=world)
    model, dp, opt, sched = make_trainer(mesh)
    torch.manual_seed(100 + rank)
    losses, _ = train_steps(model, dp, opt, sched, mesh, 2)
    save_checkpoint(root, 2, model, opt, sched, mesh, {"resume_token": "token-at-2"})
    draw = torch.rand(3).tolist()  # what the generator gives right after the good checkpoint
    losses += train_steps(model, dp, opt, sched, mesh, 1, start=2)[0]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"draw": draw, "losses": losses}))
    if rank == 0:  # die after writing this rank's shard files, before the checkpoint is complete
        from torch.distributed.checkpoint import FileSystemWriter

        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            result = write(self, plan, planner)
            result.wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    save_checkpoint(root, 3, model, opt, sched, mesh, {"resume_token": "token-at-3"})


def _resume_worker(rank, world, root):
    mesh = ParallelMesh.build(dp=world)
    model, dp, opt, sched = make_trainer(mesh)
    path = latest_checkpoint(root)
    step, extra = load_checkpoint(path, model, opt, sched, mesh)
    draw = torch.rand(3).tolist()
    losses, _ = train_steps(model, dp, opt, sched, mesh, 1, start=step)
    save_checkpoint(root, 3, model, opt, sched, mesh, {"resume_token": "token-at-3"}, keep=1)
    return step, extra, draw, losses


@pytest.mark.slow
def test_killed_save_keeps_the_previous_checkpoint_which_loads(tmp_path):
    root, out_dir = tmp_path / "ckpt", tmp_path / "out"
    out_dir.mkdir()
    ctx = context()
    port = free_port()
    procs = [ctx.Process(target=_killed_worker, args=(r, 2, port, str(root), str(out_dir))) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=120)
    for p in procs[1:]:  # the survivor waits in a collective for the dead rank: end it
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    assert procs[0].exitcode == -signal.SIGKILL, procs[0].exitcode

    assert (root / "step_000003.tmp").is_dir() and not (root / "step_000003").exists()
    assert (root / "latest").read_text().strip() == "step_000002"
    assert latest_checkpoint(root) == root / "step_000002"

    before = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    results = run_distributed(_resume_worker, 2, str(root))
    ref_losses, _, _ = reference_run(3, None)
    for r, (step, extra, draw, losses) in enumerate(results):
        assert (step, extra) == (2, {"resume_token": "token-at-2"})
        assert draw == before[r]["draw"]  # same layout: each rank's generator restored
        assert losses == _approx(before[r]["losses"][2:]) and losses == _approx(ref_losses[2:])
    # The next good save replaced the debris; keep=1 pruned step 2.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003"]
    assert latest_checkpoint(root) == root / "step_000003"


# ------------------------------------------------------------------- single process
def test_latest_pointer_keep_and_errors(tmp_path):
    mesh = ParallelMesh.build()
    model, dp, opt, sched = make_trainer(mesh)
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, sched, mesh, {"resume_token": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]
    # A missing pointer falls back to the newest complete folder; debris is never chosen.
    (tmp_path / "latest").unlink()
    (tmp_path / "step_000009.tmp").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"
    try:
        load_checkpoint(tmp_path / "step_000009.tmp", model, opt, sched, mesh)
    except FileNotFoundError as err:
        assert "not a complete checkpoint" in str(err)
    else:
        raise AssertionError("loading an incomplete checkpoint must fail")
    try:
        save_checkpoint(tmp_path, 4, model, opt, sched, mesh, None, keep=0)
    except ValueError as err:
        assert "keep=0 must be >= 1" in str(err)
    else:
        raise AssertionError("keep=0 must be refused")


# ------------------------------------------------------------------- expert parallelism
def _moe_batch(dp_rank: int, step: int, vocab: int = 64, tokens: int = 32):
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    ids = torch.randint(0, vocab, (tokens + 1,), generator=g)
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 12, tokens], dtype=torch.int32), max_seqlen=20)
    return ids[:-1], torch.cat([torch.arange(12), torch.arange(tokens - 12)]), ids[1:], meta


def _moe_trainer(mesh):
    from moe.layer import set_moe_loss_scale
    from moe.parallel import apply_ep

    moe = MoEConfig(num_experts=8, top_k=2, ffn_dim=16, first_k_dense=1)
    model = build_model(ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, moe=moe), seed=5)
    apply_ep(model, mesh)
    set_moe_loss_scale(model, mesh.size("dp_cp"))
    dp = apply_data_parallel(model, mesh)
    return model, dp, AdamW(dp, lr=0.01, weight_decay=0.1)


def _moe_steps(model, dp, opt, mesh, steps, start):
    losses = []
    for step in range(start, start + steps):
        batches = [_moe_batch(d, step) for d in range(mesh.size("dp_cp"))]
        count = sum(b[2].numel() for b in batches)
        tokens, positions, labels, meta = batches[mesh.coordinate("dp")]
        logits = model(tokens, positions, meta)
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / count
        loss.backward()
        clip_grad_norm_(dp, 0.5, mesh)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.group("dp_cp"))
        losses.append(float(total))
    return losses


def _moe_worker(rank, world, root):
    # ep=2 (experts split in halves, their ZeRO chunks over edp=2) -> ep=4 and ep=1.
    mesh = ParallelMesh.build(dp=4, ep=2)
    model, dp, opt = _moe_trainer(mesh)
    assert {s.group_name for s in dp.slots} == {"dp_cp", "edp"}
    _moe_steps(model, dp, opt, mesh, 2, 0)
    save_checkpoint(root, 2, model, opt, None, mesh)
    out = {"ep2": _moe_steps(model, dp, opt, mesh, 2, 2)}
    dp.remove()
    for ep in (4, 1):
        mesh = ParallelMesh.build(dp=4, ep=ep)
        model, dp, opt = _moe_trainer(mesh)
        _scramble(model)
        load_checkpoint(f"{root}/step_000002", model, opt, None, mesh)
        out[f"ep{ep}"] = _moe_steps(model, dp, opt, mesh, 2, 2)
        dp.remove()
    return out


@pytest.mark.slow
def test_expert_parallel_checkpoint_reshards_across_ep(saved):
    """MoE (moe.parallel.apply_ep, expert params `expert_parallel`, ZeRO over edp): saved at
    ep=2, continued at ep=4 and ep=1; the two following losses equal the uninterrupted ep=2
    run's (the second one depends on the restored Adam moments)."""
    for r in (result["moe"] for result in saved[3]):
        for ep in ("ep4", "ep1"):
            torch.testing.assert_close(torch.tensor(r[ep]), torch.tensor(r["ep2"]), rtol=RTOL, atol=0)


# ------------------------------------------------------------------ older layouts
class _TwoWeightExperts(torch.nn.Module):
    """Routed experts as checkpoints held them before gate and up were one weight: w1 (gate) and
    w3 (up) [E, dim, hidden], w2 [E, hidden, dim]; expert params like GroupedExperts'."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w1 = torch.nn.Parameter(torch.randn(experts, dim, hidden, generator=g))
        self.w3 = torch.nn.Parameter(torch.randn(experts, dim, hidden, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, dim, generator=g))
        for param in self.parameters():
            placement.tag_expert(param)


def _holder(experts):
    holder = torch.nn.Module()
    holder.experts = experts  # parameter names as in a model: experts.w1, experts.w13, ...
    return holder


def _split_experts(holder, ep: int, rank: int):
    """Keep this rank's experts of every expert param, tagged as moe.parallel.apply_ep tags them."""
    if ep > 1:
        for name, full in list(holder.experts.named_parameters()):
            placement.tag_expert(full, 0, full.shape)
            part = torch.nn.Parameter(full.detach().chunk(ep, 0)[rank].clone())
            setattr(holder.experts, name, placement.copy_expert_tags(full, part))
    return holder


def _older_experts_case(rank, root, dp_size, ep):
    mesh = ParallelMesh.build(dp=dp_size, ep=ep)
    old = _split_experts(_holder(_TwoWeightExperts(4, 5, 6)), ep, rank)
    dp = apply_data_parallel(old, mesh)
    opt = AdamW(dp, lr=0.01, weight_decay=0.1)
    for step in range(2):
        loss = sum(((rank + 1 + step) * p).sin().sum() for p in old.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(root, 2, old, opt, None, mesh, {"k": 2})
    new = _split_experts(_holder(GroupedExperts(4, 5, 6)), ep, rank)
    new_dp = apply_data_parallel(new, mesh)
    new_opt = AdamW(new_dp, lr=0.01, weight_decay=0.1)
    _scramble(new)
    assert load_checkpoint(f"{root}/step_000002", new, new_opt, None, mesh) == (2, {"k": 2})
    w13, w2 = new.experts.w13, new.experts.w2
    out = {"weights": [torch.equal(w13[:, :, 0], old.experts.w1), torch.equal(w13[:, :, 1], old.experts.w3),
                       torch.equal(w2, old.experts.w2)]}
    states = {}
    for optimizer, dparallel in ((opt, dp), (new_opt, new_dp)):
        for i, slot in enumerate(dparallel.slots):
            states[slot.name] = {"master": slot.master, "exp_avg": optimizer.exp_avg[i], "exp_avg_sq": optimizer.exp_avg_sq[i]}
    fused = states["experts.w13"]
    out["states"] = [torch.equal(fused[kind].select(2, part), states[name][kind]) and fused[kind].numel() > 0
                     for kind in ("master", "exp_avg", "exp_avg_sq")
                     for part, name in enumerate(("experts.w1", "experts.w3"))]
    out["w2_states"] = all(torch.equal(states["experts.w2"][k], v) for k, v in states["experts.w2"].items())
    dp.remove()
    new_dp.remove()
    return out


def _older_experts_worker(rank, world, root):
    # dp=2: the experts' Adam state in ZeRO chunks over edp (dim 1, the model dim: 5 rows -> 3 + 2);
    # ep=2: each rank two of the four experts, their halves placed on the expert-parallel mesh.
    return {f"dp2_ep{ep}": _older_experts_case(rank, f"{root}/ep{ep}", 2, ep) for ep in (1, 2)}


@pytest.mark.slow
def test_a_checkpoint_with_separate_gate_and_up_experts_loads_into_the_fused_weight(tmp_path):
    """Saved by a model whose experts held gate and up as w1 and w3 (dp=2 with ZeRO-1 over the
    experts' data-parallel group, and ep=2), loaded into today's GroupedExperts at the same layout:
    w13 holds them as its two halves, and so do its fp32 master and both Adam moments on every rank."""
    for by_layout in run_distributed(_older_experts_worker, 2, str(tmp_path)):
        for layout, result in by_layout.items():
            assert all(result["weights"]) and all(result["states"]) and result["w2_states"], (layout, result)


def test_older_separate_gate_and_up_read_as_the_fused_weight_by_conversion_and_init(tmp_path):
    """The same older layout outside the trainer's resume: `tessera-convert to-hf` reads a trainer
    checkpoint through CheckpointWeights, and `checkpoint.init_from` a from-hf folder through
    core.state.pretrained; both present w1 and w3 as w13 and read it as their stack."""
    from safetensors.torch import save_file

    from core.state.pretrained import SINGLE_NAME, check_weights, load_weights
    from interop.convert import CheckpointWeights

    old = _holder(_TwoWeightExperts(4, 5, 6))
    want = torch.stack((old.experts.w1.detach(), old.experts.w3.detach()), dim=2)
    path = save_checkpoint(tmp_path / "ckpt", 1, old, None, None, ParallelMesh.build(), {})
    weights = CheckpointWeights(path)
    assert weights.names()["experts.w13"] == ((4, 5, 2, 6), torch.float32)
    assert not {"experts.w1", "experts.w3"} & set(weights.names())
    assert torch.equal(weights.read("experts.w13"), want) and torch.equal(weights.read("experts.w2"), old.experts.w2)

    folder = tmp_path / "import"
    folder.mkdir()
    save_file({name: p.detach() for name, p in old.named_parameters()}, str(folder / SINGLE_NAME))
    new = _holder(GroupedExperts(4, 5, 6))
    check_weights(folder, {name: tuple(p.shape) for name, p in new.named_parameters()})
    assert load_weights(folder, new, None, ParallelMesh.build()) == 2
    assert torch.equal(new.experts.w13, want) and torch.equal(new.experts.w2, old.experts.w2)
