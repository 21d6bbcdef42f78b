"""model.dense_backend = "te": the blocks' linear layers on Transformer Engine.

On any machine: the settings' checks, the clear refusal where TE cannot run, and data
parallelism's side of TE's gradient-accumulation fusion (Megatron's main_grad protocol).
On a GPU with TE installed: TE's linears against torch's, the "te" backend's training
against the "torch" backend's (bf16, dense and MoE), each FP8 recipe's loss against bf16,
and checkpoints moving between the backends.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from core.precision import te_backend, te_fused
from core.config import ConfigError, ModelConfig
from core.validation import validate
from core.layers import AttentionMeta
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.parallel.data import DataParallel, apply_data_parallel
from tests.support.cli import ROOT
from tests.support.configs import config_with
from tests.support.runs import CONFIG, MOE_CONFIG, losses, run_train, tail_mean

TE_MISSING = te_backend.unavailable_reason()
needs_te = pytest.mark.skipif(TE_MISSING is not None, reason=f"Transformer Engine: {TE_MISSING}")
RTOL_BF16 = 2e-2


@pytest.mark.parametrize("settings, message", [
    ({"train__precision": "bf16", "train__fp8_recipe": "tensorwise"}, "applies to train.precision='fp8' only"),
    ({"train__precision": "fp8", "train__fp8_recipe": "delayed"}, "set model.dense_backend='te'"),
    ({"model__dense_backend": "te", "train__recompute_modules": ["norms"]}, "cannot run with model.dense_backend='te'"),
])
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(config_with(**settings), 1)


def test_te_settings_that_work_pass():
    validate(config_with(model__dense_backend="te", train__precision="fp8", train__fp8_recipe="delayed",
                         train__recompute_modules=["attention_core"]), 1)


@pytest.mark.skipif(TE_MISSING is None, reason="Transformer Engine runs here")
def test_te_backend_where_it_cannot_run_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "core.train.cli", "--config", str(CONFIG), "--set", "model.dense_backend=te",
                           "--set", f"train.run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.dense_backend='te' needs Transformer Engine" in lines[0], proc.stderr
    assert "use model.dense_backend='torch'" in lines[0]
    assert not (tmp_path / "run").exists()


class _AddsIntoMainGrad(torch.autograd.Function):
    """y = x W^T whose backward adds dW into W.main_grad and flags it, returning a placeholder
    for W's gradient: what TE's linear does with fuse_wgrad_accumulation (the op TE runs on GPUs).
    W may be a parameter or the joined weight core.precision.te_fused.joined_weight hands TE's fused modules."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # TE keeps the weight object itself to flag it (a saved tensor may come back as another)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ctx.weight.main_grad.add_((dy.t() @ x).float())
        ctx.weight.grad_added_to_main_grad = True
        return dy @ weight, torch.empty_like(weight)  # uninitialised, as TE's is


class _Fused(nn.Linear):
    def forward(self, x):
        return _AddsIntoMainGrad.apply(x, self.weight)


def _main_grads(fused: bool, micro_batches: int, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    if fused:
        for i in (0, 1):
            old = model[i]
            model[i] = _Fused(old.in_features, old.out_features, bias=False)
            model[i].weight = old.weight
            te_backend.mark_accumulates_main_grad(model[i].weight)
    dp = apply_data_parallel(model, ParallelMesh.build(device_type="cpu"), gradient_accumulation_fusion=True)
    out = []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        dp.zero_grad()
        for m in range(micro_batches):
            context = dp.no_sync() if m < micro_batches - 1 else torch.enable_grad()
            with context:
                model(torch.randn(5, 8, generator=gen)).square().sum().backward()
        dp.finish_grad_sync()
        out.append(torch.cat([g.reshape(-1).clone() for g in dp.local_grads()]))
        with torch.no_grad():  # a step, so the next one starts from other weights
            for slot in dp.slots:
                slot.param.sub_(0.01 * slot.main_grad.to(slot.param.dtype))
    assert dp.stats["fused_grads"] == (2 * micro_batches * steps if fused else 0)
    return out


def test_data_parallel_serves_the_main_grad_protocol():
    # Three steps of three micro-batches: main grads zeroed at each step's start, accumulated
    # by the op itself, identical to the hook's own accumulation of returned gradients.
    want, got = _main_grads(False, 3, 3), _main_grads(True, 3, 3)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_main_grad_protocol_needs_fusion_on():
    layer = nn.Linear(4, 4, bias=False)
    te_backend.mark_accumulates_main_grad(layer.weight)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True"):
        apply_data_parallel(nn.Sequential(layer), ParallelMesh.build(device_type="cpu"),
                            gradient_accumulation_fusion=False)


class _JoinedQKV(nn.Module):
    """Three projections of one input through one joined weight (with fusion), or one by one."""

    def __init__(self, joined: bool):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(8, n, bias=False) for n in (16, 4, 4))
        self.out = nn.Linear(24, 3, bias=False)
        self.joined = joined
        if joined:
            te_fused.mark_joined([self.wq.weight, self.wk.weight, self.wv.weight])
            for m in (self.wq, self.wk, self.wv):
                te_backend.mark_accumulates_main_grad(m.weight)

    def forward(self, x):
        if self.joined:
            weight = te_fused.joined_weight([self.wq.weight, self.wk.weight, self.wv.weight], fuse_wgrad=True)
            qkv = _AddsIntoMainGrad.apply(x, weight)
        else:
            qkv = torch.cat([self.wq(x), self.wk(x), self.wv(x)], -1)
        return self.out(qkv.tanh())


def _joined_main_grads(joined: bool, param_dtype: torch.dtype) -> tuple[list[torch.Tensor], DataParallel]:
    torch.manual_seed(0)
    model = _JoinedQKV(joined)
    dp = apply_data_parallel(model, ParallelMesh.build(device_type="cpu"), gradient_accumulation_fusion=True,
                             param_dtype=param_dtype, bucket_mb=1e-4)  # ~100 bytes: a bucket per unit
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        dp.zero_grad()
        for m in range(3):
            with dp.no_sync() if m < 2 else torch.enable_grad():
                model(torch.randn(5, 8, generator=gen).to(param_dtype)).float().square().sum().backward()
        dp.finish_grad_sync()
        out.append(torch.cat([g.reshape(-1).clone() for g in dp.local_grads()]))
        with torch.no_grad():
            for slot in dp.slots:
                slot.param.sub_(0.01 * slot.main_grad.to(slot.param.dtype))
    return out, dp


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_joined_weight_adds_into_the_separate_parameters_main_grads(param_dtype):
    # q, k, v as one weight over the three parameters (data parallelism's bf16 cast gave each
    # new storage; joined_weight moves them back to back), TE-style fused accumulation into the
    # joined main grad: the same gradients, steps and weights as three separate linears.
    want, _ = _joined_main_grads(False, param_dtype)
    got, dp = _joined_main_grads(True, param_dtype)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert dp.stats["fused_grads"] == 3 * 3 * 2
    slots = {slot.name: slot for slot in dp.slots}
    q, k, v = (slots[f"w{n}.weight"] for n in "qkv")
    assert q.bucket is k.bucket is v.bucket  # one unit, though the cap would split them
    assert k.offset == q.offset + q.param.numel() and v.offset == k.offset + k.param.numel()
    assert k.param.data_ptr() == q.param.data_ptr() + q.param.numel() * q.param.element_size()


def test_joined_weight_without_adjacent_main_grads_copies_back():
    # Outside data parallelism's layout the joined main grad is a copy, written back after the
    # backward: the parameters' main grads end as if each had its own.
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(2, 3))
    for p in (a, b):
        p.main_grad = torch.ones(p.shape)
    x = torch.randn(5, 3)
    _AddsIntoMainGrad.apply(x, te_fused.joined_weight([a, b], fuse_wgrad=True)).sum().backward()
    want = torch.ones(6, 5).matmul(x) + 1  # dy = 1: dW = 1^T x, onto the 1 already there
    torch.testing.assert_close(torch.cat([a.main_grad, b.main_grad]), want)
    assert a.grad_added_to_main_grad and b.grad_added_to_main_grad


# ------------------------------------------------------------------------------- GPU
@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize("recipe, rtol", [(None, 1e-2), ("tensorwise", 0.12), ("delayed", 0.12), ("blockwise", 0.12)])
def test_te_linear_matches_torch_linear(recipe, rtol):
    torch.manual_seed(0)
    ref = nn.Linear(256, 384, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # 200: padded to 208 in FP8
    dy = torch.randn(200, 384, device="cuda", dtype=torch.bfloat16)
    y_ref = ref(x)
    y_ref.backward(dy)
    dx_ref, dw_ref = x.grad.clone(), ref.weight.grad.clone()
    x.grad, ref.weight.grad = None, None
    layer = te_backend.TeLinear(ref, te_backend.build_recipe(recipe), fuse_wgrad=False)
    assert dict(layer.state_dict()).keys() == {"weight", "bias"}
    for _ in range(3):  # delayed scaling's scales come from the amax of earlier calls
        x.grad, ref.weight.grad = None, None
        y = layer(x)
        y.backward(dy)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(y, y_ref) < rtol and rel(x.grad, dx_ref) < rtol and rel(ref.weight.grad, dw_ref) < rtol


@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, "tensorwise", "delayed", "blockwise"])
def test_fused_norm_modules_match_the_blocks_own_code(recipe):
    # Two dense blocks, te with the norms joined (te.LayerNormLinear for the attention norm and
    # q/k/v, te.LayerNormMLP for the FFN norm and FFN) against the torch backend: the logits and
    # every parameter's gradient, by name, within bf16 noise; in FP8 no further from the torch
    # backend than te's one-linear-per-projection path in the same recipe (x1.5, FP8's own error).
    cfg = ModelConfig(vocab_size=512, dim=256, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=512)
    ref = build_model(cfg, seed=0).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, 512, (200,), device="cuda")  # 200 rows: padded to 208 in FP8
    positions = torch.cat([torch.arange(120), torch.arange(80)]).cuda()
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 120, 200], dtype=torch.int32, device="cuda"), max_seqlen=120)

    def run(model):
        for _ in range(3):  # delayed scaling's scales come from the amax of earlier calls
            model.zero_grad()
            out = model(tokens, positions, meta)
            out.float().square().mean().backward()
        return [out] + [p.grad for p in model.parameters()]

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    want = run(ref)
    errors = {}
    for fused in (True, False):
        model = copy.deepcopy(ref)
        plan = te_backend.apply_te(model, recipe, fuse_wgrad=False, norm_fusion=fused)
        joined = sorted(name for name, how in plan.items() if how == "te-fused")
        assert joined == (sorted(f"layers.{i}.{n}" for i in range(2) for n in (
            "attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"))
            if fused else [])
        assert model.state_dict().keys() == ref.state_dict().keys()
        errors[fused] = [rel(g, w) for g, w in zip(run(model), want)]
    names = ["logits"] + [name for name, _ in ref.named_parameters()]
    for name, err, err_linears in zip(names, errors[True], errors[False]):
        assert err < (2e-2 if recipe is None else max(1.5 * err_linears, 2e-2)), (name, err, err_linears)


@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize("recipe, rtol", [(None, 2e-2), ("delayed", 0.15)])
def test_fused_norm_modules_add_into_data_parallel_main_grads(recipe, rtol):
    # TE's fused weight-gradient accumulation through the joined weights, under data
    # parallelism's main grads (bf16 params, two micro-batches): every main grad, by name,
    # equals the gradient of the torch backend's model.
    cfg = ModelConfig(vocab_size=512, dim=256, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=512)
    ref = build_model(cfg, seed=0).cuda()
    model = copy.deepcopy(ref)
    te_backend.apply_te(model, recipe, fuse_wgrad=True)
    dp = apply_data_parallel(model, ParallelMesh.build(device_type="cuda"), gradient_accumulation_fusion=True,
                             param_dtype=torch.bfloat16)
    ref = ref.to(torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 208), device="cuda")
    positions = torch.arange(208, device="cuda")
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 208], dtype=torch.int32, device="cuda"), max_seqlen=208)
    for mb in range(2):
        ref(tokens[mb], positions, meta).float().square().mean().backward()
    for _ in range(2):  # the second step's grads: delayed scaling has seen the first's amaxes
        dp.zero_grad()
        for mb in range(2):
            with dp.no_sync() if mb == 0 else torch.enable_grad():
                model(tokens[mb], positions, meta).float().square().mean().backward()
        dp.finish_grad_sync()
    assert dp.stats["fused_grads"] > 0
    grads = dict(ref.named_parameters())
    for slot in dp.slots:
        want = grads[slot.name].grad.float()
        assert ((slot.main_grad - want).norm() / want.norm()).item() < rtol, slot.name


GPU = ["train.device=cuda", "train.max_steps=200", "train.seq_len=256", "train.micro_batch_size=2",
       "train.global_batch_size=8", "train.log_interval=50"]


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory, train_dataset):
    if TE_MISSING is not None:
        pytest.skip(f"Transformer Engine: {TE_MISSING}")
    out = {}
    for name, config in (("dense", CONFIG), ("moe", MOE_CONFIG)):
        run_dir = tmp_path_factory.mktemp(f"torch-{name}")
        run_train(run_dir, train_dataset, 1, *GPU, "parallel.ep=1", config=config)
        out[name] = losses(run_dir)
    return out


def _assert_trains_alike(got: dict[int, float], want: dict[int, float], tail_rtol: float = 0.01) -> None:
    """Every step's loss within bf16 noise, and the last 20 steps' mean within `tail_rtol`."""
    assert got.keys() == want.keys()
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=3 * RTOL_BF16), (step, got[step], loss)
    assert tail_mean(got) == pytest.approx(tail_mean(want), rel=tail_rtol)


@needs_te
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name, norm_fusion", [("dense", True), ("moe", True), ("dense", False)])
def test_te_backend_trains_like_the_torch_backend(tmp_path, dataset, torch_runs, name, norm_fusion):
    # 200 bf16 steps: each step's loss within bf16 noise of the torch backend's; the last 20
    # steps' mean within 1%, or 2% with the norms joined to TE's modules (the default): TE's
    # RMSNorm rounds once from fp32 where the block's rounds the normalised input, then the
    # product, and on this small, memorised dataset any change of rounding moves the tail by
    # about 1% (measured on an H200: dense +1.1%, MoE -1.4%; bf16 eager against compiled: 0.9%),
    # while steps 2-4 agree to 1e-4.
    run_train(tmp_path / "te", dataset, 1, *GPU, "parallel.ep=1", "model.dense_backend=te",
              f"model.te_norm_fusion={str(norm_fusion).lower()}", config=CONFIG if name == "dense" else MOE_CONFIG)
    _assert_trains_alike(losses(tmp_path / "te"), torch_runs[name], tail_rtol=0.02 if norm_fusion else 0.01)


@needs_te
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_te_backend_under_tensor_parallelism_trains_like_the_torch_backend(tmp_path, dataset):
    # tp=2 with sequence parallelism: Tessera's all-gather / reduce-scatter around TE's local
    # GEMMs (column- and row-parallel shards) and TE's fused wgrad into the sharded main grads,
    # against the torch backend in the same layout (tp=2 against one GPU: test_gpu_train.py).
    # 200 bf16 steps, as test_te_backend_trains_like_the_torch_backend.
    tp2 = [*GPU, "parallel.ep=1", "parallel.tp=2"]
    run_train(tmp_path / "torch", dataset, 2, *tp2)
    run_train(tmp_path / "te", dataset, 2, *tp2, "model.dense_backend=te")
    _assert_trains_alike(losses(tmp_path / "te"), losses(tmp_path / "torch"))


@needs_te
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_te_delayed_fp8_under_tensor_parallelism_trains_like_one_gpu(tmp_path, dataset):
    # The delayed recipe keeps its amax history per rank: at tp=2 each shard scales on its own
    # amax, at tp=1 on the whole tensor's, so the two quantise differently; the last 20 steps'
    # mean loss within 2%.
    fp8 = [*GPU, "parallel.ep=1", "model.dense_backend=te", "train.precision=fp8", "train.fp8_recipe=delayed"]
    run_train(tmp_path / "tp1", dataset, 1, *fp8)
    run_train(tmp_path / "tp2", dataset, 2, *fp8, "parallel.tp=2")
    want, got = losses(tmp_path / "tp1"), losses(tmp_path / "tp2")
    assert got.keys() == want.keys()
    assert tail_mean(got) == pytest.approx(tail_mean(want), rel=0.02), (tail_mean(got), tail_mean(want))


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, fresh_text):
    if TE_MISSING is not None:
        pytest.skip(f"Transformer Engine: {TE_MISSING}")
    run_dir = tmp_path_factory.mktemp("te-bf16")
    run_train(run_dir, fresh_text, 1, *FP8_RUN)
    return losses(run_dir)


FP8_RUN = [*GPU, "train.max_steps=500", "model.dense_backend=te", "train.compile=true"]


@needs_te
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("recipe, norm_fusion", [("tensorwise", True), ("delayed", True), ("blockwise", True),
                                                 ("tensorwise", False)])
def test_fp8_recipes_learn_like_bf16(tmp_path, fresh_text, bf16_run, recipe, norm_fusion):
    # 500 steps of each TE recipe against bf16 (both compiled), same data: the last 50 steps'
    # mean loss within 1%; 2% for tensorwise, whose single runs spread wider: against the same
    # bf16 run on an H200, tensorwise ended +1.46% with the norms joined and -1.31% without
    # (delayed, joined: within 1%).
    run_train(tmp_path / "fp8", fresh_text, 1, *FP8_RUN, "train.precision=fp8", f"train.fp8_recipe={recipe}",
              f"model.te_norm_fusion={str(norm_fusion).lower()}")
    got = losses(tmp_path / "fp8")
    assert sorted(got) == list(range(1, 501))
    assert tail_mean(got, 50) == pytest.approx(tail_mean(bf16_run, 50), rel=0.02 if recipe == "tensorwise" else 0.01), \
        (tail_mean(got, 50), tail_mean(bf16_run, 50))


@needs_te
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("first, then", [("torch", "te"), ("te", "torch")])
def test_checkpoints_move_between_backends(tmp_path, dataset, first, then):
    # Save after step 10 under one backend, resume under the other: steps 11-20 equal the
    # uninterrupted run of the first backend within bf16 noise.
    common = [*GPU, "train.max_steps=20", "checkpoint.interval=10"]
    run_train(tmp_path / "whole", dataset, 1, *common, f"model.dense_backend={first}")
    run_dir = tmp_path / "moved"
    run_train(run_dir, dataset, 1, *common, f"model.dense_backend={first}", "train.stop_at_step=10")
    run_train(run_dir, dataset, 1, *common, f"model.dense_backend={then}", resume=True)
    want, got = losses(tmp_path / "whole"), losses(run_dir)
    for step in range(11, 21):
        assert got[step] == pytest.approx(want[step], rel=RTOL_BF16), (step, got[step], want[step])
