"""The output head and the loss fused over token chunks (`core.train.loss.fused_output_cross_entropy_sum`).

Reference: the same model's logits, then `cross_entropy_sum`, with the same data-parallel
hooks and fp32 main grads. On CPU in fp32 the loss and every main grad agree to rounding
(1e-5 relative: only the order of the sums differs); a CLI training run with `train.fused_loss`
on follows the plain run step for step. On a GPU in bf16, compiled: the same loss and
gradients within bf16 rounding, and the loss's peak memory less than half the unfused one's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.train import loss as loss_module
from core.config import ConfigError, ModelConfig, load_config
from core.validation import validate
from core.layers import AttentionMeta
from core.train.loss import cross_entropy_sum, fused_output_cross_entropy_sum
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.parallel.data import apply_data_parallel
from tests.support.runs import RTOL, losses, run_train

CFG = ModelConfig(vocab_size=96, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)


def _micro_batches(count: int, tokens: int, vocab: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (tokens + 1,), generator=gen)
        labels = ids[1:].clone()
        labels[torch.randperm(tokens, generator=gen)[:5]] = -100
        cu = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32)
        positions = torch.cat([torch.arange(tokens // 3), torch.arange(tokens - tokens // 3)])
        out.append((ids[:-1], positions, AttentionMeta(cu, tokens - tokens // 3), labels))
    return out


def _train_grads(tie: bool, fused: bool, micro) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(CFG.__class__(**{**CFG.__dict__, "tie_embeddings": tie}), seed=0)
    dp = apply_data_parallel(model, ParallelMesh.build(), distributed_optimizer=False)
    count = sum(int((labels != -100).sum()) for *_, labels in micro)
    parts = []
    for i, (tokens, positions, meta, labels) in enumerate(micro):
        with dp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
            if fused:
                scale = torch.tensor(1.0 / count)
                part = fused_output_cross_entropy_sum(model.hidden_states(tokens, positions, meta),
                                                      model.output.weight, labels, scale)
            else:
                part, _ = cross_entropy_sum(model(tokens, positions, meta), labels)
            (part / count).backward()
        parts.append(part.item())
    dp.finish_grad_sync()
    return parts, {slot.name: slot.shard_grad.clone() for slot in dp.slots}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fused_head_and_loss_match_logits_then_loss(monkeypatch, tie):
    # 7 tokens a chunk over 40-token micro-batches: five full chunks and a partial one
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_ELEMENTS", 7 * CFG.vocab_size)
    micro = _micro_batches(2, 40, CFG.vocab_size)
    got_loss, got = _train_grads(tie, True, micro)
    want_loss, want = _train_grads(tie, False, micro)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert got.keys() == want.keys() and any(g.abs().sum() > 0 for g in got.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_fused_loss_needs_a_main_grad_and_matching_shapes():
    weight = nn.Parameter(torch.randn(10, 4))
    with pytest.raises(ValueError, match="needs a weight whose gradient goes to a fp32 main grad"):
        fused_output_cross_entropy_sum(torch.randn(3, 4), weight, torch.zeros(3, dtype=torch.long), torch.tensor(1.0))
    apply_data_parallel(nn.ParameterList([weight]), ParallelMesh.build(), distributed_optimizer=False)
    with pytest.raises(ValueError, match=r"expects hidden \[T, d\], weight \[V, d\] and labels \[T\]"):
        fused_output_cross_entropy_sum(torch.randn(3, 5), weight, torch.zeros(3, dtype=torch.long), torch.tensor(1.0))


@pytest.mark.slow
def test_training_with_the_fused_loss_follows_the_plain_run(tmp_path, dataset, reference):
    run_train(tmp_path / "run", dataset, 1, "train.fused_loss=true")
    got = losses(tmp_path / "run")
    assert got.keys() == reference.keys() and len(got) == 4
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-5), (step, got, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.tp=2"],  # vocab-parallel chunks, sequence parallel (the head's input all-gathered)
    ["parallel.tp=2", "parallel.sequence_parallel=false"],  # the head's input replicated
    ["parallel.pp=2"],  # the last stage stops at its norm and the loss applies the head
], ids=["tp2-sp", "tp2", "pp2"])
def test_fused_loss_at_tp_and_pp_follows_the_single_process(tmp_path, dataset, reference, layout):
    """Reference: the single-process unfused run of the same data (RTOL: reduction order only)."""
    run_train(tmp_path / "run", dataset, 2, "train.fused_loss=true", *layout)
    got = losses(tmp_path / "run")
    assert got.keys() == reference.keys() and len(got) == 4
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=RTOL), (step, got, reference)


@pytest.mark.slow
def test_fused_loss_with_a_tied_head_across_stages(tmp_path, dataset):
    """Tied embedding and head on the first and last stage: the head's gradient, written straight
    into its main grad by the fused loss, is summed with the embedding's as the unfused run's is."""
    tied = ["model.tie_embeddings=true"]
    run_train(tmp_path / "one", dataset, 1, *tied)
    run_train(tmp_path / "pp", dataset, 2, "train.fused_loss=true", "parallel.pp=2", *tied)
    want, got = losses(tmp_path / "one"), losses(tmp_path / "pp")
    assert got.keys() == want.keys() and len(got) == 4
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=RTOL), (step, got, want)


@pytest.mark.parametrize("settings, message", [
    (["model.dense_backend=te"], "train.fused_loss=true needs model.dense_backend"),
    (["parallel.gradient_accumulation_fusion=false"], "it needs parallel.gradient_accumulation_fusion=true"),
])
def test_fused_loss_refuses_layouts_it_cannot_run(settings, message):
    config = load_config(None, ["train.fused_loss=true", *settings])
    with pytest.raises(ConfigError, match=message):
        validate(config, world_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_loss_matches_and_holds_less_memory():
    torch.manual_seed(0)
    tokens, dim, vocab = 8192, 1024, 32000
    head = nn.Linear(dim, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    nn.init.normal_(head.weight, std=0.02)
    dp = apply_data_parallel(nn.ModuleList([head]), ParallelMesh.build(device_type="cuda"), distributed_optimizer=False,
                            param_dtype=torch.bfloat16)
    hidden = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[::9] = -100
    count = int((labels != -100).sum())

    def run(fused: bool):
        h = hidden.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if fused:
            part = fused_output_cross_entropy_sum(h, head.weight, labels, torch.tensor(1.0 / count, device="cuda"),
                                                  compiled=True)
        else:
            part, _ = cross_entropy_sum(head(h), labels, compiled=True)
        (part / count).backward()
        dp.finish_grad_sync()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grad = dp.slots[0].shard_grad.clone()
        dp.zero_grad()
        return float(part), h.grad.float(), grad, peak

    for _ in range(2):  # the second round runs compiled code, not the compiler
        got_loss, got_h, got_w, got_peak = run(True)
        want_loss, want_h, want_w, want_peak = run(False)
    ref = F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum").item()
    assert got_loss == pytest.approx(ref, rel=1e-5) and want_loss == pytest.approx(ref, rel=1e-5)
    torch.testing.assert_close(got_h, want_h, rtol=2e-2, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=1e-6)
    logits_bytes = tokens * vocab * 2
    assert want_peak > 1.5 * logits_bytes, want_peak  # the unfused loss holds the logits and their gradient
    assert got_peak < 0.5 * want_peak, (got_peak, want_peak)  # one 2048-token chunk of each
