"""bf16 AdamW moments (`train.optimizer_moments_dtype = "bf16"`) against fp32 arithmetic.

- One step of every path (torch's foreach ops, its fused kernel, optimizer offload's host step,
  and under Triton's interpreter the one-pass kernel with fp32 and split masters) against
  torch's AdamW arithmetic in float64 on the same inputs (the moments widened from bf16), the
  new moments rounded to bf16 once (`tests.support.moments`). Tolerance: moments within one bf16
  unit in the last place (the path computes in fp32 and rounds once, the reference rounds the
  exact value once: the two roundings can differ by one step where fp32's error crosses a
  rounding boundary); measured: the torch paths equal bit for bit, the Triton kernel on all but
  ~2e-5 of the elements. fp32 masters within 1e-5 relative (measured 2e-6). The torch paths run
  with their default piece (`MOMENT_CHUNK`) and with pieces of 20 elements, which cut tensors by
  rows and rows by elements.
- The rounding on ties, signs, tiny and non-finite values equals torch's fp32 -> bf16 cast bit
  for bit (the kernel rounds on the bits: the interpreter's own cast truncates).
- Training: `tessera-train` on the tiny dense config for 60 steps with bf16 moments ends within
  1% of fp32 moments' loss (mean of the last 10 steps) without being the same run (the losses
  differ), and its checkpoint holds bf16 moments beside fp32 masters.
- ZeRO-1 at dp=2 with optimizer offload (torchrun, gloo) against the single process, both with
  bf16 moments: the layouts' tolerance, 2e-4 relative (tests/support/runs.py: the reduction order
  differs, and a one-bit gradient difference can flip a moment's rounding).
- Checkpoints across the dtype, at dp=2 with ZeRO-1 and across offload: fp32 moments load into a
  bf16 run rounded to nearest even, bit for bit `saved.to(bfloat16)`; bf16 moments into an fp32
  run exactly; masters unchanged; one log line says so.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import core.train.optim as optim
from core.config import ConfigError, load_config
from core.mesh import ParallelMesh
from core.planner.memory import estimate_memory
from core.planner.state import state_bytes
from core.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from core.state.safe_metadata import read_dcp_metadata
from core.validation import validate
from tests.support.cli import ROOT, child_env
from tests.support.distributed import run_distributed
from tests.support.moments import compare, one_step
from tests.support.runs import RTOL, losses, run_train
from tests.support.toy import make_trainer, train_steps

BF16 = "train.optimizer_moments_dtype=bf16"


# ------------------------------------------------------------------ one step of each path
@pytest.mark.parametrize("chunk", [optim.MOMENT_CHUNK, 20], ids=["default-pieces", "20-element-pieces"])
@pytest.mark.parametrize("path", ["foreach", "fused", "host"])
def test_one_step_is_the_fp32_update_of_the_widened_moments_rounded_once(monkeypatch, path, chunk):
    monkeypatch.setattr(optim, "MOMENT_CHUNK", chunk)
    result = one_step(path)
    assert result["dtypes"] == {"torch.bfloat16"} and result["clipped"] and not result["ran_triton"]
    distance = compare(result)
    print(path, chunk, distance)
    assert distance["master_rel"] < 1e-5 and distance["moment_ulps"] <= 1, distance


KERNEL_ROUNDING = r'''
import torch
from core.kernels.adamw import AdamWTables, multi_tensor_adamw
from tests.support.moments import compare, one_step

for name in ("triton", "triton-split"):
    result = one_step(name)
    assert result["ran_triton"] and result["dtypes"] == {"torch.bfloat16"}, name
    distance = compare(result)
    print(name, distance)
    assert distance["master_rel"] < 1e-5 and distance["moment_ulps"] <= 1, distance
'''
ROUNDING_CHECK = r'''
import torch
from core.kernels.adamw import AdamWTables, multi_tensor_adamw
from tests.support.moments import ulps

device = DEVICE
# beta = 0: the new moments are the gradient term itself, rounded by the kernel
bf = torch.randn(4096).bfloat16().float()
bits = bf.view(torch.int32)
ties = torch.cat([(bits + 0x8000).view(torch.float32), (bits + 0x7FFF).view(torch.float32),
                  (bits + 0x8001).view(torch.float32)])  # exact ties (odd and even), just below, just above
special = torch.tensor([0.0, 1e-40, -1e-40, 3e38, -3e38, float("inf"), float("-inf")])  # -0: 0 + -0 is +0
g = torch.cat([ties, -ties, special, torch.tensor([float("nan")])]).to(device)
m, v = torch.zeros_like(g, dtype=torch.bfloat16), torch.zeros_like(g, dtype=torch.bfloat16)
multi_tensor_adamw(AdamWTables(), [torch.zeros_like(g)], [g.clone()], [m], [v], [None], [0.0], lr=0.0,
                   betas=(0.0, 0.0), eps=1e-8, step=1, grad_scale=None)
assert torch.equal(m[:-1].view(torch.int16), g[:-1].bfloat16().view(torch.int16))
assert torch.equal(v[:-1].view(torch.int16), (g * g)[:-1].bfloat16().view(torch.int16))
assert m[-1].isnan() and v[-1].isnan()
# Decaying moments: the fp32 update of the widened moments, rounded once (within one unit)
# (a GPU kernel contracts b*m + (1-b)*g into one FMA: where the two terms nearly cancel, that
# fp32 rounding difference is a few fp32 units of the terms, more than one bf16 unit of the sum)
g = torch.randn(1 << 20, device=device)
m, v = torch.randn_like(g).bfloat16(), torch.rand_like(g).bfloat16()
terms_m, terms_v = 0.9 * m.float().abs() + 0.1 * g.abs(), 0.95 * v.float() + 0.05 * g * g
want_m = (0.9 * m.float() + 0.1 * g).bfloat16()
want_v = (0.95 * v.float() + 0.05 * g * g).bfloat16()
multi_tensor_adamw(AdamWTables(), [torch.zeros_like(g)], [g.clone()], [m], [v], [None], [0.0], lr=0.0,
                   betas=(0.9, 0.95), eps=1e-8, step=1, grad_scale=None)
for got, want, terms in ((m, want_m, terms_m), (v, want_v, terms_v)):
    distance = ulps(got, want)
    unit = torch.ldexp(torch.ones_like(terms), torch.frexp(want.float())[1] - 8)  # one bf16 unit of want
    error = (got.float() - want.float()).abs()
    assert bool((error <= unit + 2**-21 * terms).all()), (error - unit - 2**-21 * terms).max()
    assert float((distance <= 1).float().mean()) > 0.9999 and float((distance == 0).float().mean()) > 0.99, \
        distance.float().mean()
print("kernel rounding equals torch's cast")
'''
KERNEL_ROUNDING += ROUNDING_CHECK.replace("DEVICE", repr("cpu"))


@pytest.mark.slow
def test_triton_kernel_with_bf16_moments_under_the_interpreter():
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", KERNEL_ROUNDING], cwd=ROOT, env=child_env(TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=300)
    print(run.stdout[-2000:])
    assert run.returncode == 0 and "kernel rounding equals torch's cast" in run.stdout, run.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_rounds_bf16_moments_like_torch_on_gpu():
    run = subprocess.run([sys.executable, "-c", ROUNDING_CHECK.replace("DEVICE", repr("cuda"))], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "kernel rounding equals torch's cast" in run.stdout, run.stderr[-4000:]


# ------------------------------------------------------------------ training
@pytest.mark.slow
def test_bf16_moments_train_within_one_percent_of_fp32_moments(tmp_path, dataset):
    steps = ["train.max_steps=60", "train.warmup_steps=5"]
    run_train(tmp_path / "fp32", dataset, 1, *steps)
    run_train(tmp_path / "bf16", dataset, 1, *steps, BF16)
    fp32, bf16 = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    tail = lambda run: sum(run[s] for s in range(51, 61)) / 10  # noqa: E731
    print(f"last 10 steps' mean loss: fp32 moments {tail(fp32):.5f}, bf16 {tail(bf16):.5f}")
    assert bf16 != fp32  # the option took effect
    assert tail(bf16) == pytest.approx(tail(fp32), rel=0.01)
    assert bf16[60] < bf16[1] - 2.0  # and both learned
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        saved = read_dcp_metadata(latest_checkpoint(tmp_path / name / "checkpoints")).state_dict_metadata
        kinds = {kind: {m.properties.dtype for k, m in saved.items() if k.startswith("optim.") and k.endswith(kind)}
                 for kind in (".master", ".exp_avg", ".exp_avg_sq")}
        assert kinds == {".master": {torch.float32}, ".exp_avg": {dtype}, ".exp_avg_sq": {dtype}}, (name, kinds)


@pytest.mark.slow
def test_bf16_moments_at_dp2_zero1_with_offload_equal_the_single_process(tmp_path, dataset):
    run_train(tmp_path / "one", dataset, 1, BF16)
    run_train(tmp_path / "dp2", dataset, 2, BF16, "parallel.dp=2", "parallel.distributed_optimizer=true",
              "train.optimizer_offload=true")
    got, want = losses(tmp_path / "dp2"), losses(tmp_path / "one")
    assert got.keys() == want.keys()
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (step, got, want)


# ------------------------------------------------------------------ checkpoints
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _across_dtypes(rank, world, root):
    mesh = ParallelMesh.build(dp=world)
    lines = _Lines()
    logger = logging.getLogger("core.state.checkpoint")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    out = {}
    for saved, loaded, offload in ((torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.float32, False)):
        model, dp, opt, sched = make_trainer(mesh, param_dtype=torch.bfloat16, moments_dtype=saved, offload=offload)
        train_steps(model, dp, opt, sched, mesh, 2, clip=0.5, defer_clip=True)
        path = save_checkpoint(f"{root}/{saved}", 2, model, opt, sched, mesh)
        before = [t.clone() for t in opt.exp_avg + opt.exp_avg_sq], [s.master.clone() for s in dp.slots]
        dp.remove()
        model, dp, opt, sched = make_trainer(mesh, param_dtype=torch.bfloat16, moments_dtype=loaded,
                                             offload=not offload)
        del lines.lines[:]
        load_checkpoint(path, model, opt, sched, mesh)
        moments, masters = opt.exp_avg + opt.exp_avg_sq, [s.master for s in dp.slots]
        out[str(loaded)] = dict(
            dtypes={str(t.dtype) for t in moments},
            moments_equal=all(torch.equal(a.to(loaded).view(torch.int16 if loaded == torch.bfloat16 else torch.int32),
                                          b.view(torch.int16 if loaded == torch.bfloat16 else torch.int32))
                              for a, b in zip(before[0], moments)),
            masters_equal=all(torch.equal(a, b) for a, b in zip(before[1], masters)),
            rounded=any(not torch.equal(a.float(), b.float()) for a, b in zip(before[0], moments)),
            lines=[line for line in lines.lines if "AdamW moments" in line])
        dp.remove()
    return out


@pytest.mark.slow
def test_a_checkpoint_resumes_with_the_other_moments_dtype_converted(tmp_path):
    results = run_distributed(_across_dtypes, 2, str(tmp_path))
    for rank, out in enumerate(results):
        bf16, fp32 = out["torch.bfloat16"], out["torch.float32"]
        assert bf16["dtypes"] == {"torch.bfloat16"} and fp32["dtypes"] == {"torch.float32"}
        assert bf16["moments_equal"] and fp32["moments_equal"] and bf16["masters_equal"] and fp32["masters_equal"]
        assert bf16["rounded"] and not fp32["rounded"]  # fp32 -> bf16 lost bits; bf16 -> fp32 none
        if rank == 0:
            assert len(bf16["lines"]) == 1 and "in fp32, this run keeps them in bf16" in bf16["lines"][0], bf16
            assert "rounded to nearest even" in bf16["lines"][0]
            assert len(fp32["lines"]) == 1 and "in bf16, this run keeps them in fp32" in fp32["lines"][0], fp32
        else:
            assert bf16["lines"] == fp32["lines"] == []


# ------------------------------------------------------------------ config, memory
def test_a_bad_moments_dtype_or_a_beta_bf16_cannot_follow_is_one_line():
    config = ROOT / "launch/configs/tiny_dense.toml"
    with pytest.raises(ConfigError, match=r"^train.optimizer_moments_dtype='fp16' must be 'fp32' or 'bf16'$"):
        validate(load_config(config, ["train.optimizer_moments_dtype=fp16"]), 1)
    with pytest.raises(ConfigError, match=r"train.beta2=0.999 with train.optimizer_moments_dtype='bf16'.*"
                                          r"use beta2 < 0.99609 or optimizer_moments_dtype='fp32'"):
        validate(load_config(config, [BF16, "train.beta2=0.999"]), 1)
    validate(load_config(config, ["train.beta2=0.999"]), 1)  # fp32 moments: any beta


def test_the_optimizer_counts_two_bytes_per_moment():
    model, dp, opt, _ = make_trainer(ParallelMesh.build(), moments_dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    assert opt.state_bytes() == 4 * numel  # fp32 params are the masters: the moments only
    assert make_trainer(ParallelMesh.build())[2].state_bytes() == 8 * numel


def test_the_planner_counts_two_bytes_per_moment_on_the_device_and_the_host():
    base = ["train.precision=bf16", "parallel.tp=2", "train.device=cuda"]
    path = ROOT / "launch/configs/tiny_dense.toml"
    for extra, where in (([], "device"), (["train.optimizer_offload=true"], "host")):
        fp32 = validate(load_config(path, base + extra), 4)
        bf16 = validate(load_config(path, base + extra + [BF16]), 4)
        a, b = state_bytes(fp32), state_bytes(bf16)
        if where == "device":
            assert (a.moments, b.moments) == (8 * a.chunk_numel, 4 * a.chunk_numel) and a.masters == b.masters
            assert estimate_memory(fp32, rank=0).peak_allocated - estimate_memory(bf16, rank=0).peak_allocated == \
                4 * a.chunk_numel
        else:  # fp32 master + moments, then the pinned buffer: 12 + 4 and 8 + 4 bytes per element
            assert a.host - b.host == 4 * a.chunk_numel and a.moments == b.moments == 0
