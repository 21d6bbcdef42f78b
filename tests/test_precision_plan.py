"""The precision plan (core/precision/plan.py): every backend choice resolved once from the
config, and the parallelize steps building exactly what the plan says.

References: the table of core/precision/plan.py's docstring (which backend for which
settings), and the modules `parallelize` leaves in the model: FP8 layers of the plan's kind
holding the model's own weight cache, the experts' weight-gradient mode of
`train.fp8_expert_wgrad`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from core.config import Config, ConfigError, ModelConfig, MoEConfig
from core.mesh import ParallelMesh
from core.precision import blockwise
from core.precision.plan import resolve_precision_plan
from core.train.model import build_model
from core.train.parallelize import parallelize
from core.validation import validate

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _config(precision="fp8", recipe="blockwise", backend="torch", accum=1, cache=True, wgrad="fp8") -> Config:
    moe = MoEConfig(num_experts=4, top_k=2, ffn_dim=128, first_k_dense=1)
    config = Config(model=ModelConfig(vocab_size=256, dim=128, num_layers=2, num_heads=4, num_kv_heads=4,
                                      ffn_dim=256, moe=moe, dense_backend=backend))
    t = config.train
    t.precision, t.fp8_recipe, t.fp8_weight_cache, t.fp8_expert_wgrad = precision, recipe, cache, wgrad
    t.micro_batch_size, t.global_batch_size, config.parallel.dp = 2, 2 * accum, 1
    return config


@pytest.mark.parametrize("settings, device, want", [
    (dict(precision="auto"), CPU, ("fp32", "torch", None, "torch")),
    (dict(precision="auto"), CUDA, ("bf16", "torch", None, "torch")),
    (dict(precision="bf16"), CPU, ("bf16", "torch", None, "torch")),
    (dict(), CPU, ("fp8", "blockwise", "blockwise", "blockwise")),
    (dict(recipe="tensorwise"), CPU, ("fp8", "torchao", "tensorwise", "blockwise")),
    (dict(recipe="rowwise"), CPU, ("fp8", "torchao", "rowwise", "blockwise")),
    (dict(backend="te", recipe="delayed"), CUDA, ("fp8", "te", "delayed", "blockwise")),
    (dict(backend="te", precision="bf16"), CUDA, ("bf16", "te", None, "torch")),
])
def test_the_plan_names_one_backend_per_kind_of_layer(settings, device, want):
    plan = resolve_precision_plan(_config(**settings), device)
    assert (plan.precision, plan.linears, plan.linear_recipe, plan.experts) == want
    assert plan.head == "torch"
    assert plan.param_dtype == (torch.float32 if plan.precision == "fp32" else torch.bfloat16)


def test_the_weight_cache_needs_fp8_the_setting_and_several_micro_batches():
    assert resolve_precision_plan(_config(accum=3), CPU).weight_cache
    assert not resolve_precision_plan(_config(accum=1), CPU).weight_cache  # nothing to reuse
    assert not resolve_precision_plan(_config(accum=3, cache=False), CPU).weight_cache
    assert not resolve_precision_plan(_config(precision="bf16", accum=3), CPU).weight_cache


def test_fp8_only_settings_without_fp8_are_refused():
    with pytest.raises(ConfigError, match="train.fp8_expert_wgrad='bf16' applies to train.precision='fp8' only"):
        validate(_config(precision="bf16", wgrad="bf16"), 1)
    assert resolve_precision_plan(validate(_config(wgrad="bf16"), 1), CPU).expert_wgrad == "bf16"


def test_describe_says_what_runs_where():
    line = resolve_precision_plan(_config(accum=2, wgrad="bf16"), CPU).describe()
    assert line == ("fp8: block linears blockwise (blockwise), experts blockwise (wgrad bf16), output head torch, "
                    "fp8 weight cache on")


def _parallelized(config: Config):
    plan = resolve_precision_plan(config, CPU)
    model, _, _, grads = parallelize(build_model(config.model, seed=0), ParallelMesh.build(device_type="cpu"),
                                     config, CPU, plan)
    return model, grads


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_parallelize_builds_what_the_plan_says(wgrad):
    model, grads = _parallelized(_config(accum=2, wgrad=wgrad))
    experts = model.layers["1"].feed_forward.experts
    assert isinstance(experts.mm, blockwise.Fp8GroupedMM) and experts.mm.expert_wgrad == wgrad
    linear = model.layers["0"].attention.wq
    assert isinstance(linear, blockwise.Fp8Linear)
    # Every FP8 layer of the model quantises through the model's one cache, the one the step clears.
    assert grads.weight_cache is not None and linear.weight_cache is grads.weight_cache
    assert experts.mm.cache is grads.weight_cache and grads.weight_cache.clear in grads.dp.on_new_weights
    _, other_grads = _parallelized(_config(accum=2))
    assert other_grads.weight_cache is not grads.weight_cache


def test_a_bf16_plan_leaves_the_gemms_alone():
    model, grads = _parallelized(_config(precision="bf16"))
    assert type(model.layers["0"].attention.wq) is nn.Linear and grads.weight_cache is None
    assert not isinstance(model.layers["1"].feed_forward.experts.mm, blockwise.Fp8GroupedMM)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_a_torchao_plan_puts_the_linears_on_torchao_and_the_experts_on_blockwise():
    from torchao.float8.float8_linear import Float8Linear

    model, _ = _parallelized(_config(recipe="tensorwise"))
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    assert isinstance(model.layers["1"].feed_forward.experts.mm, blockwise.Fp8GroupedMM)
