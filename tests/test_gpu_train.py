"""On GPUs (NCCL, bf16): tp=2, dp=2 and tp=2 x dp=2 per-step losses equal the single-GPU run.

Reference: the same config on one GPU. bf16 params and activations (fp32 master weights
and grads in the optimizer): each layout rounds partial sums in a different order, so
losses agree to bf16 precision compounded over a few steps: 2e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_train import dataset, losses, run_train  # noqa: F401  (the fixture is reused)

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count()
RTOL_BF16 = 2e-2


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory, dataset):  # noqa: F811
    if GPUS < 1:
        pytest.skip("needs a CUDA GPU")
    run_dir = tmp_path_factory.mktemp("gpu-ref")
    run_train(run_dir, dataset, 1, "train.device=cuda")
    return losses(run_dir)


@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2), (2, 2)])
def test_gpu_layouts_match_single_gpu(tmp_path, dataset, gpu_reference, tp, dp):  # noqa: F811
    if GPUS < tp * dp:
        pytest.skip(f"needs {tp * dp} GPUs, have {GPUS}")
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, tp * dp, f"parallel.tp={tp}", "train.device=cuda")
    got = losses(run_dir)
    for step, loss in gpu_reference.items():
        assert got[step] == pytest.approx(loss, rel=RTOL_BF16), (step, got, gpu_reference)
