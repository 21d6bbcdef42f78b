"""Optimizer offload (`train.optimizer_offload`) against the device optimizer.

Reference: the same run with the optimizer state on the device (offload off), through
`tessera-train` at 1 process (fp32 and bf16 params), dp=2 with ZeRO-1, tp=2 with sequence
parallelism (its norm gains' gradients are summed over tp after the reduction, so their host
copies are refreshed) and pp=2 with a tied embedding (summed over the stages likewise).

Same arithmetic: the device computes the same reduced gradients either way and the same clip
factor from them; the host runs AdamW on the same fp32 state. The one difference is the
kernel: the host runs torch's fused CPU AdamW, the CPU device path the foreach ops, which can
differ in the last bit of an fp32 master or moment (the fused kernel divides by the clip factor's
inverse, the foreach path multiplies by it, and the two order the update's products apart).
Measured over SMALL's 4 steps: losses equal or within 1.1e-7 relative (bf16 params: a one-bit
master difference can flip a weight's rounding). Tolerance: 1e-6 relative on every loss.
Checkpoints: a run saved with offload resumes without it (and the reverse) from the same bits:
the saved state is compared tensor by tensor, exactly, and the resumed losses within 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.config import ConfigError, load_config
from core.mesh import ParallelMesh
from core.parallel.offload import check_host_memory, host_memory_available
from core.planner.memory import estimate_memory
from core.planner.state import state_bytes
from core.state.checkpoint import load_checkpoint, save_checkpoint
from core.validation import validate
from tests.support.cli import ROOT, assert_one_line
from tests.support.distributed import run_distributed
from tests.support.runs import NO_SAVE, losses, run_train
from tests.support.toy import make_trainer, train_steps

RTOL = 1e-6
OFFLOAD = "train.optimizer_offload=true"

LAYOUTS = {  # name: (processes, overrides)
    "bf16": (1, ["train.precision=bf16"]),
    "dp2-zero1": (2, ["parallel.dp=2", "parallel.distributed_optimizer=true"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2-tied": (2, ["parallel.pp=2", "model.tie_embeddings=true"]),
}


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (step, got, want)


def test_offload_losses_equal_the_device_optimizers_at_one_process(tmp_path, dataset, reference):
    run_train(tmp_path / "run", dataset, 1, OFFLOAD)
    _assert_close(losses(tmp_path / "run"), reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_offload_losses_equal_the_device_optimizers(tmp_path, dataset, name):
    nproc, overrides = LAYOUTS[name]
    run_train(tmp_path / "device", dataset, nproc, *overrides, NO_SAVE)
    run_train(tmp_path / "host", dataset, nproc, *overrides, OFFLOAD)
    _assert_close(losses(tmp_path / "host"), losses(tmp_path / "device"))


@pytest.mark.slow
@pytest.mark.parametrize("first,then,save", [(True, False, "false"), (False, True, "false"), (True, True, "true")],
                         ids=["offload-then-device", "device-then-offload", "offload-async-save"])
def test_a_checkpoint_resumes_across_offload(tmp_path, dataset, reference, first, then, save):
    # Saved after step 2 at dp=2 with ZeRO-1 (blocking, or the asynchronous save's host copies
    # of the host state), resumed with the other optimizer placement or the same: steps 3-4
    # equal the uninterrupted single process.
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, 2, "parallel.dp=2", f"train.optimizer_offload={str(first).lower()}", "train.stop_at_step=2",
              f"checkpoint.async_save={save}")
    run_train(run_dir, dataset, 2, "parallel.dp=2", f"train.optimizer_offload={str(then).lower()}", resume=True)
    got = losses(run_dir)
    for step in (3, 4):
        assert got[step] == pytest.approx(reference[step], rel=RTOL), (step, got, reference)


# ------------------------------------------------------------------ the saved state, exactly
def _state(model, dp, opt) -> dict:
    out = {f"param.{n}": p.detach().float().numpy().copy() for n, p in model.named_parameters()}
    for i, s in enumerate(dp.slots):
        out[f"master.{s.name}"] = s.master.numpy().copy()
        out[f"exp_avg.{s.name}"] = opt.exp_avg[i].numpy().copy()
        out[f"exp_avg_sq.{s.name}"] = opt.exp_avg_sq[i].numpy().copy()
    out["step"] = opt.step_count
    return out


def _save_and_load_across(rank, world, root):
    mesh = ParallelMesh.build(dp=2)
    out = {}
    for saved_offload in (True, False):
        model, dp, opt, sched = make_trainer(mesh, param_dtype=torch.bfloat16, offload=saved_offload)
        train_steps(model, dp, opt, sched, mesh, 2, clip=0.5, defer_clip=True)
        path = save_checkpoint(f"{root}/{saved_offload}", 2, model, opt, sched, mesh)
        before = _state(model, dp, opt)
        dp.remove()
        model, dp, opt, sched = make_trainer(mesh, param_dtype=torch.bfloat16, offload=not saved_offload)
        load_checkpoint(path, model, opt, sched, mesh)
        after = _state(model, dp, opt)
        dp.remove()
        out[saved_offload] = [k for k in before if not np.array_equal(before[k], after[k])]
    return out


@pytest.mark.slow
def test_checkpointed_state_is_the_same_bits_with_and_without_offload(tmp_path):
    # bf16 params, ZeRO-1 over dp=2: masters, moments, step count and the params rebuilt from
    # the masters are bit for bit what was saved, whichever side saved and which loaded.
    for out in run_distributed(_save_and_load_across, 2, str(tmp_path)):
        assert out == {True: [], False: []}, out


# ------------------------------------------------------------------ host memory
def test_a_run_whose_offload_exceeds_host_memory_stops_at_start(tmp_path, dataset):
    proc = run_train(tmp_path / "run", dataset, 1, OFFLOAD, "train.optimizer_offload_host_gb=0.001", check=False)
    line = assert_one_line(proc, "train.optimizer_offload needs", "1.0 MB is available",
                           "train.optimizer_offload_host_gb=0.001", "that fits")
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), line


def test_the_check_reads_memavailable_over_the_ranks_per_node():
    available = host_memory_available()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    with pytest.raises(ConfigError, match=r"MemAvailable .* over 1 rank\(s\) per node"):
        check_host_memory(available + 2**30, 10**9, ranks_per_node=1)
    check_host_memory(available // 8, 10**9, ranks_per_node=4)  # a quarter each: fits
    with pytest.raises(ConfigError, match=r"over 4 rank\(s\) per node"):
        check_host_memory(available // 2, 10**9, ranks_per_node=4)


def test_offload_rules():
    for keys, words in ((["parallel.split_master_weights=true", "train.precision=bf16"], "nothing to split"),
                        (["train.optimizer_offload=false", "train.optimizer_offload_host_gb=4"], "set train.optimizer_offload=true")):
        with pytest.raises(ConfigError, match=words):
            validate(load_config(ROOT / "launch/configs/tiny_dense.toml", [OFFLOAD, *keys]), 1)


# ------------------------------------------------------------------ the planner
def test_the_planner_moves_the_optimizer_state_to_the_host():
    base = ["train.precision=bf16", "parallel.tp=2", "train.device=cuda"]
    off = validate(load_config(ROOT / "launch/configs/tiny_dense.toml", base), 4)
    on = validate(load_config(ROOT / "launch/configs/tiny_dense.toml", base + [OFFLOAD]), 4)
    s_off, s_on = state_bytes(off), state_bytes(on)
    assert s_off.optimizer == s_off.chunk_numel * 12 and s_on.optimizer == 0  # bf16 params: fp32 masters + moments
    assert s_on.host > s_off.chunk_numel * 12 and s_off.host == 0
    m_off, m_on = estimate_memory(off, rank=0), estimate_memory(on, rank=0)
    assert m_off.peak_allocated - m_on.peak_allocated == s_off.optimizer
    assert m_on.breakdown()["host_optimizer"] == pytest.approx(s_on.host / 2**30)


# ------------------------------------------------------------------ the GPU path
@pytest.mark.gpu
def test_gpu_offload_streams_through_pinned_buffers(tmp_path, dataset):
    # The side-stream copies and pinned buffers on a GPU, against the device optimizer (its
    # one-pass Triton AdamW there, which multiplies by the clip factor where the CPU kernel divides
    # by its inverse): bf16 params, where a one-bit master difference flips a weight's rounding
    # now and then; 1e-5 relative, ten times the CPU's bound, until measured.
    run_train(tmp_path / "device", dataset, 1, "train.device=cuda", "train.precision=bf16")
    run_train(tmp_path / "host", dataset, 1, "train.device=cuda", "train.precision=bf16", OFFLOAD)
    got, want = losses(tmp_path / "host"), losses(tmp_path / "device")
    assert got.keys() == want.keys()
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), (step, got, want)


@pytest.mark.gpu
def test_gpu_offload_buffers_are_pinned_and_the_state_is_on_the_host():
    model, dp, opt, sched = make_trainer(ParallelMesh.build(), param_dtype=torch.bfloat16, device="cuda", offload=True)
    train_steps(model, dp, opt, sched, ParallelMesh.build(), 2, clip=0.5, defer_clip=True)
    assert all(t.is_pinned() for t in dp.host.grads)
    assert all(s.master.device.type == "cpu" for s in dp.slots)
    assert all(t.device.type == "cpu" for t in opt.exp_avg + opt.exp_avg_sq)
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())


def test_data_parallel_checks_its_own_buffers_before_allocating():
    # The library's own check (apply_data_parallel used without tessera-train), by the slots.
    with pytest.raises(ConfigError, match="train.optimizer_offload needs"):
        make_trainer(ParallelMesh.build(), offload=True, host_limit_gb=1e-6)
