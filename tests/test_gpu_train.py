"""On GPUs (NCCL, bf16): tp=2, dp=2, cp=2, pp=2, tp=2 x dp=2 and (MoE) ep=2 per-step losses equal
the single-GPU run.

Reference: the same config on one GPU. bf16 params and activations (fp32 master weights
and grads in the optimizer): each layout rounds partial sums in a different order, so
losses agree to bf16 precision compounded over a few steps: 2e-2 relative.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.runs import MOE_CONFIG, losses, run_train

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count()
RTOL_BF16 = 2e-2


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory, train_dataset):  # the `dataset` (tests/conftest.py), module-wide
    if GPUS < 1:
        pytest.skip("needs a CUDA GPU")
    run_dir = tmp_path_factory.mktemp("gpu-ref")
    run_train(run_dir, train_dataset, 1, "train.device=cuda")
    return losses(run_dir)


# name: (GPUs, overrides); the rest of the GPUs are data-parallel ranks.
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "dp2": (2, []),
    "cp2": (2, ["parallel.cp=2"]),  # ring attention on FlashAttention varlen blocks over NCCL
    "pp2": (2, ["parallel.pp=2"]),  # 1F1B, p2p activations over NCCL
    "tp2xdp2": (4, ["parallel.tp=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_gpu_layouts_match_single_gpu(tmp_path, dataset, gpu_reference, name):
    gpus, overrides = LAYOUTS[name]
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} GPUs, have {GPUS}")
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, gpus, *overrides, "train.device=cuda")
    got = losses(run_dir)
    assert got.keys() == gpu_reference.keys()
    for step, loss in gpu_reference.items():
        assert got[step] == pytest.approx(loss, rel=RTOL_BF16), (step, got, gpu_reference)


@pytest.mark.slow
def test_gpu_expert_parallel_matches_single_gpu(tmp_path, dataset):
    # tiny_moe at ep=2 over dp=2 (NCCL uneven all-to-alls) against all 8 experts on one GPU;
    # moe/all_to_all_s comes from CUDA events on the collectives' stream here.
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, have {GPUS}")
    ref_dir, ep_dir = tmp_path / "ref", tmp_path / "ep2"
    run_train(ref_dir, dataset, 1, "train.device=cuda", "parallel.ep=1", config=MOE_CONFIG)
    run_train(ep_dir, dataset, 2, "train.device=cuda", "parallel.ep=2", config=MOE_CONFIG)
    want, got = losses(ref_dir), losses(ep_dir)
    assert got.keys() == want.keys()
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=RTOL_BF16), (step, got, want)
    for record in map(json.loads, (ep_dir / "metrics.jsonl").read_text().splitlines()):
        assert 0 < record["moe/all_to_all_s"] < record["step_s"], record


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_compiled_moe_matches_eager(tmp_path, dataset, precision, monkeypatch):
    # train.compile with MoE layers (inductor): router, aux losses' inputs and shared experts
    # compiled, dispatch + experts eager; every packed batch has new document boundaries and
    # routing, which must not recompile (a recompile per step ran for minutes, 2026-11-23).
    if GPUS < 1:
        pytest.skip("needs a CUDA GPU")
    # 12 steps with per-sequence balancing and the bias update; dims of 128 for FP8's blocks.
    common = ["train.device=cuda", f"train.precision={precision}", "train.max_steps=12", "model.dim=128",
              "model.moe.ffn_dim=128", "model.moe.aux_loss_per_sequence=true", "model.moe.bias_update_rate=0.001",
              "parallel.ep=1"]
    eager_dir, compiled_dir = tmp_path / "eager", tmp_path / "compiled"
    run_train(eager_dir, dataset, 1, *common, config=MOE_CONFIG)
    monkeypatch.setenv("TORCH_LOGS", "recompiles")
    proc = run_train(compiled_dir, dataset, 1, *common, "train.compile=true", config=MOE_CONFIG)
    # One expected: the block code seen first with a dense, then a MoE feed-forward (on CPU with
    # aot_eager: exactly that one over 12 steps). Recompiling per batch would log >= 11.
    recompiles = proc.stderr.count("Recompiling function")
    assert recompiles <= 3, proc.stderr[-6000:]
    want, got = losses(eager_dir), losses(compiled_dir)
    assert sorted(got) == list(range(1, 13))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=RTOL_BF16), (step, got, want)
