"""Block linears whose weight gradient adds into the fp32 main grad inside the (compiled) backward.

Reference: the same bf16 training with `parallel.gradient_accumulation_fusion=false`, where each
micro-batch's bf16 weight gradient is added into the main grad by data parallelism's hook. On
the CPU both round the weight gradient to bf16 before the fp32 add, so the losses agree to
fp32 rounding (1e-6 relative), eager and compiled; on a GPU the fused GEMM adds in fp32 without
that rounding: losses within 1e-3 relative over 6 steps.
"""

from __future__ import annotations

import pytest
import torch

from core.config import load_config
from core.trainer import Trainer
from tests.test_recompute import _micro
from tests.test_train import ROOT, dataset, losses, run_train  # noqa: F401  (fixture reused)


def _train(fused: bool, device: str, compile_: bool, steps: int, config_name: str = "tiny_dense"):
    config = load_config(ROOT / "launch" / "configs" / f"{config_name}.toml", [
        f"train.device={device}", "train.precision=bf16", "train.micro_batch_size=2", "train.global_batch_size=6",
        "train.seq_len=64", "parallel.ep=1", f"train.compile={str(compile_).lower()}",
        f"parallel.gradient_accumulation_fusion={str(fused).lower()}"])
    trainer = Trainer(config)
    losses = []
    for step in range(steps):
        micro = [_micro(10 * step + i, config.model.vocab_size, seq=64, device=device) for i in range(3)]
        losses.append(float(trainer.step(micro).loss_sum))
    return losses, trainer.grads.dp.stats["fused_grads"]


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_fused_weight_gradients_train_like_the_hook(compile_):
    want, plain_fused = _train(False, "cpu", compile_, 3)
    got, fused = _train(True, "cpu", compile_, 3)
    assert got == pytest.approx(want, rel=1e-6), (got, want)
    assert plain_fused == 0 and fused >= 3 * 3 * 2 * 7  # 3 steps x 3 micro-batches x 2 blocks x 7 linears


@pytest.mark.slow
def test_fused_weight_gradients_over_two_data_parallel_ranks(tmp_path, dataset):  # noqa: F811
    # ZeRO-1 over gloo: the fused weights' main grads are zeroed per step, reduced and sharded
    # like the others; the run follows the one where the hook adds the bf16 gradients.
    bf16 = ["train.precision=bf16", "parallel.dp=2"]
    run_train(tmp_path / "fused", dataset, 2, *bf16)
    run_train(tmp_path / "plain", dataset, 2, *bf16, "parallel.gradient_accumulation_fusion=false")
    got, want = losses(tmp_path / "fused"), losses(tmp_path / "plain")
    assert got.keys() == want.keys() and len(got) == 4
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config_name", ["tiny_dense", "tiny_moe"])
def test_gpu_fused_weight_gradients_train_like_the_hook(config_name):
    want, _ = _train(False, "cuda", True, 6, config_name)
    got, fused = _train(True, "cuda", True, 6, config_name)
    assert got == pytest.approx(want, rel=1e-3), (got, want)
    assert fused > 0
