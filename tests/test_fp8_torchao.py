"""train.fp8_recipe "tensorwise" / "rowwise" with the torch backend: torchao's Float8Linear.

On any machine: the settings' checks, and the clear refusal where torchao is missing. With
torchao (CPU: its exact emulation of the FP8 GEMMs): the swap keeps every parameter's name and
shape, the FP8 layers compute the bf16 layers' output within FP8 rounding, and a CPU training
run follows the bf16 run. On a GPU, compiled: each recipe's loss after 500 steps within 1% of
bf16's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from core.precision import torchao_fp8
from core.config import ConfigError, ModelConfig
from core.rules import TORCHAO_FP8_RECIPES
from core.validation import validate
from core.layers import AttentionMeta
from core.train.model import build_model
from tests.support.cli import ROOT
from tests.support.configs import config_with
from tests.support.runs import CONFIG, losses, run_train, tail_mean

TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not TORCHAO, reason="torchao is not installed")


@pytest.mark.parametrize("settings, world, message", [
    ({"model__dense_backend": "te", "train__precision": "fp8", "train__fp8_recipe": "rowwise"}, 1,
     "'rowwise' runs through torchao with model.dense_backend='torch'"),
    ({"train__precision": "fp8", "train__fp8_recipe": "tensorwise", "parallel__tp": 2}, 2,
     "runs at parallel.tp=1 only (now 2)"),
    ({"train__precision": "fp8", "train__fp8_recipe": "rowwise", "train__recompute_modules": ["norms"]}, 1,
     "cannot run with train.fp8_recipe='rowwise'"),
])
def test_settings_that_cannot_work_are_refused(settings, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(config_with(**settings), world)


@pytest.mark.skipif(TORCHAO, reason="torchao is installed here")
def test_torchao_recipe_without_torchao_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "core.train.cli", "--config", str(CONFIG), "--set", "train.precision=fp8",
                           "--set", "train.fp8_recipe=tensorwise", "--set", f"train.run_dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs torchao" in lines[0] and "blockwise" in lines[0], lines


def _tiny() -> ModelConfig:
    # wk/wv are 32 wide, a multiple of 16; the FFN's 88 is not: w1/w3 (out 88) and w2 (in 88) stay bf16
    return ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=88)


@needs_torchao
@pytest.mark.parametrize("recipe", TORCHAO_FP8_RECIPES)
def test_swap_keeps_names_and_shapes_and_computes_like_bf16(recipe):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    plain = build_model(_tiny(), seed=0).to(torch.bfloat16)
    fp8 = build_model(_tiny(), seed=0).to(torch.bfloat16)
    plan = torchao_fp8.apply_torchao_fp8(fp8, recipe, emulate=True)
    assert {k: v.shape for k, v in fp8.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    swapped = sorted(name for name, m in fp8.named_modules() if isinstance(m, Float8Linear))
    assert swapped == sorted(name for name, how in plan.items() if how == "fp8")
    assert len(swapped) == 2 * 4 and plan["layers.0.feed_forward.w1"] == "bf16"  # wq wk wv wo per layer
    assert not isinstance(fp8.output, Float8Linear)
    tokens, positions = torch.randint(0, 256, (64,)), torch.cat([torch.arange(32)] * 2)
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 32, 64], dtype=torch.int32), max_seqlen=32)
    want, got = plain(tokens, positions, meta).float(), fp8(tokens, positions, meta).float()
    err = float((got.detach() - want).norm() / want.norm())
    assert 0 < err < 0.05, err  # FP8 rounding: different, and close
    got.sum().backward()
    assert all(p.grad is not None for p in fp8.parameters() if p.requires_grad)


@needs_torchao
@pytest.mark.slow
def test_cpu_training_in_torchao_fp8_follows_bf16(tmp_path, dataset):
    # The trainer end to end (emulated FP8 GEMMs on CPU): 12 steps of each recipe against bf16,
    # same data; the block linears run in FP8 (the log says how many) and every step's loss stays
    # within 3% of bf16's.
    common = ["train.precision=bf16", "train.max_steps=12", "train.log_interval=1"]
    runs = {"bf16": common, **{recipe: [*common, "train.precision=fp8", f"train.fp8_recipe={recipe}"]
                               for recipe in TORCHAO_FP8_RECIPES}}
    # The runs are independent single processes (one thread each): side by side, one per core.
    with ThreadPoolExecutor(len(runs)) as pool:
        procs = dict(zip(runs, pool.map(lambda name: run_train(tmp_path / name, dataset, 1, *runs[name]), runs)))
    want = losses(tmp_path / "bf16")
    for recipe in TORCHAO_FP8_RECIPES:
        proc = procs[recipe]
        assert "block linear layers on torchao's Float8Linear" in proc.stdout + proc.stderr
        got = losses(tmp_path / recipe)
        assert got.keys() == want.keys() and got[12] < got[1] and got != want
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=0.03), (recipe, step, got[step], want[step])


GPU = ["train.device=cuda", "train.seq_len=256", "train.micro_batch_size=2", "train.global_batch_size=8",
       "train.log_interval=50", "train.max_steps=500", "train.compile=true"]


@needs_torchao
@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_fp8_recipes_learn_like_bf16(tmp_path, fresh_text):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_train(tmp_path / "bf16", fresh_text, 1, *GPU)
    want = losses(tmp_path / "bf16")
    for recipe in TORCHAO_FP8_RECIPES:
        run_train(tmp_path / recipe, fresh_text, 1, *GPU, "train.precision=fp8", f"train.fp8_recipe={recipe}")
        got = losses(tmp_path / recipe)
        assert sorted(got) == list(range(1, 501))
        assert tail_mean(got, 50) == pytest.approx(tail_mean(want, 50), rel=0.01), \
            (recipe, tail_mean(got, 50), tail_mean(want, 50))


def test_apply_refuses_what_it_cannot_swap():
    with pytest.raises(ValueError, match="must be one of tensorwise, rowwise"):
        torchao_fp8.apply_torchao_fp8(nn.Linear(16, 16), "delayed", emulate=True)
