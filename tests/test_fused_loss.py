"""The output head and the loss fused over token chunks (`core.train.loss.fused_output_cross_entropy_sum`),
with the final norm folded into the chunks (each chunk: norm, head, loss and their gradients).

Reference: the same model's logits, then `cross_entropy_sum`, with the same data-parallel
hooks and fp32 main grads. On CPU in fp32 the loss and every main grad agree to rounding
(1e-5 relative: only the order of the sums differs); against the fused loss with the norm run
outside on the whole sequence, the folded one is bit for bit the same (the norm's row passes are
the same ops on the same rows) except the norm's gain, whose gradient is summed chunk by chunk
(1e-6 of its largest element). In bf16 the gain's gradient is summed in fp32 where autograd rounds each
product to bf16 first, so it agrees to bf16 rounding (2e-2 of its largest element); everything
else stays bit for bit. At tp=2 (with and without sequence parallelism, with MTP) and pp=2 (a
tied head; MTP) on gloo processes, the trainer's loss and every parameter's gradient follow the
single-process unfused trainer (tensor parallelism splits the matmul and vocab sums: 1e-4). A
CLI training run with `train.fused_loss` on follows the plain run step for step. On a GPU in
bf16, compiled: the same loss and gradients within bf16 rounding, and the loss's peak memory less
than half the unfused one's.
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from core.train import loss as loss_module
from core.config import ConfigError, ModelConfig, load_config
from core.validation import validate
from core.layers import AttentionMeta, RMSNorm
from core.train.loss import cross_entropy_sum, fused_output_cross_entropy_sum
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.parallel.data import apply_data_parallel
from tests.support.distributed import run_distributed
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


def _train_grads(tie: bool, mode: str, micro, dtype=torch.float32) -> tuple[list[float], dict[str, torch.Tensor]]:
    """mode: "plain" (logits, then the loss), "fused" (the final norm on the whole sequence, then
    the fused head and loss) or "folded" (the norm inside the fused loss's chunks)."""
    model = build_model(CFG.__class__(**{**CFG.__dict__, "tie_embeddings": tie}), seed=0).to(dtype)
    dp = apply_data_parallel(model, ParallelMesh.build(), distributed_optimizer=False, param_dtype=dtype)
    count = sum(int((labels != -100).sum()) for *_, labels in micro)
    parts = []
    for i, (tokens, positions, meta, labels) in enumerate(micro):
        with dp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
            scale = torch.tensor(1.0 / count)
            if mode == "plain":
                part, _ = cross_entropy_sum(model(tokens, positions, meta), labels)
            else:
                folded = mode == "folded"
                part = fused_output_cross_entropy_sum(model.hidden_states(tokens, positions, meta, normed=not folded),
                                                      model.output.weight, labels, scale,
                                                      norm=model.norm if folded else None)
            (part / count).backward()
        parts.append(part.item())
    dp.finish_grad_sync()
    return parts, {slot.name: slot.shard_grad.float() for slot in dp.slots}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fused_head_and_loss_match_logits_then_loss(monkeypatch, tie):
    # 7 tokens a chunk over 40-token micro-batches: five full chunks and a partial one
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_ELEMENTS", 7 * CFG.vocab_size)
    micro = _micro_batches(2, 40, CFG.vocab_size)
    want_loss, want = _train_grads(tie, "plain", micro)
    outside_loss, outside = _train_grads(tie, "fused", micro)
    got_loss, got = _train_grads(tie, "folded", micro)
    assert got_loss == pytest.approx(want_loss, rel=1e-6) and got_loss == outside_loss
    assert got.keys() == want.keys() and any(g.abs().sum() > 0 for g in got.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
        if name == "norm.weight":  # summed chunk by chunk: only the order differs
            floor = 1e-6 * outside[name].abs().max().item()
            torch.testing.assert_close(got[name], outside[name], rtol=1e-6, atol=floor, msg=name)
        else:
            assert torch.equal(got[name], outside[name]), name


def test_folded_norm_in_bf16_is_the_fused_loss_bit_for_bit_but_the_gain(monkeypatch):
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_ELEMENTS", 7 * CFG.vocab_size)
    micro = _micro_batches(2, 40, CFG.vocab_size)
    want_loss, want = _train_grads(False, "fused", micro, torch.bfloat16)
    got_loss, got = _train_grads(False, "folded", micro, torch.bfloat16)
    assert got_loss == want_loss
    for name in want:
        if name != "norm.weight":
            assert torch.equal(got[name], want[name]), name
    # The gain's gradient: autograd rounds each token's product to bf16 before its sum, the fold
    # sums the exact products in fp32; a chunk left out or counted twice is off by far more.
    gain, ref = got["norm.weight"], want["norm.weight"]
    torch.testing.assert_close(gain, ref, rtol=0, atol=2e-2 * ref.abs().max().item())


def _head_saved_bytes(tokens: int, folded: bool) -> int:
    """Bytes of the tensors autograd keeps, after the forward, from the final norm and the fused
    head and loss of a bf16 model (each storage once)."""
    config = ModelConfig(vocab_size=96, dim=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=64)
    model = build_model(config, seed=0).to(torch.bfloat16)
    apply_data_parallel(model, ParallelMesh.build(), distributed_optimizer=False, param_dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMeta(torch.tensor([0, tokens], dtype=torch.int32), tokens)
    hidden = model.hidden_states(ids, torch.arange(tokens), meta, normed=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(weakref.ref(t))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        head_in = hidden if folded else model.norm(hidden)
        loss = fused_output_cross_entropy_sum(head_in, model.output.weight, torch.roll(ids, -1),
                                              torch.tensor(1.0 / tokens), norm=model.norm if folded else None)
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in saved) if t is not None}
    del loss
    return sum(alive.values())


def test_folded_norm_keeps_no_fp32_copy_of_the_hidden_state():
    # Per token: the folded head keeps the hidden state's bf16 gradient [T, dim] (2 * dim bytes);
    # the eager norm outside it adds its two fp32 copies, its rsqrt and its bf16 normalised rows.
    dim, short, long = 64, 1024, 4096
    folded = (_head_saved_bytes(long, True) - _head_saved_bytes(short, True)) / (long - short)
    outside = (_head_saved_bytes(long, False) - _head_saved_bytes(short, False)) / (long - short)
    assert folded == 2 * dim, folded
    assert outside == 2 * dim + 8 * dim + 4 + 2 * dim, outside


def test_fused_loss_needs_a_main_grad_and_matching_shapes():
    weight = nn.Parameter(torch.randn(10, 4))
    with pytest.raises(ValueError, match="needs a weight whose gradient goes to a fp32 main grad"):
        fused_output_cross_entropy_sum(torch.randn(3, 4), weight, torch.zeros(3, dtype=torch.long), torch.tensor(1.0))
    apply_data_parallel(nn.ParameterList([weight]), ParallelMesh.build(), distributed_optimizer=False)
    with pytest.raises(ValueError, match=r"expects hidden \[T, d\], weight \[V, d\] and labels \[T\]"):
        fused_output_cross_entropy_sum(torch.randn(3, 5), weight, torch.zeros(3, dtype=torch.long), torch.tensor(1.0))


@pytest.mark.slow  # inductor compiles the chunk's loss and norm on the CPU (~20 s)
def test_compiled_chunks_with_the_folded_norm_match_the_eager_ones(monkeypatch):
    """What train.compile runs on a GPU (`compiled` is for CUDA tensors only, so the function is
    called directly here): inductor's chunk loss and norm against the eager ones, bf16. Tolerance:
    one bf16 rounding of the largest element (inductor keeps the norm's fp32 rows unrounded)."""
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_ELEMENTS", 40 * 64)  # 40-token chunks of 96 tokens
    torch.manual_seed(0)
    norm, head = RMSNorm(32, 1e-5), nn.Linear(32, 64, bias=False)
    dp = apply_data_parallel(nn.ModuleList([norm, head]).to(torch.bfloat16), ParallelMesh.build(),
                             distributed_optimizer=False, param_dtype=torch.bfloat16)
    hidden, labels = torch.randn(96, 32, dtype=torch.bfloat16), torch.randint(0, 64, (96,))
    labels[::7] = -100

    def run(compiled: bool):
        h = hidden.clone().requires_grad_()
        loss = loss_module._FusedOutputCrossEntropy.apply(h, head.weight, labels, torch.tensor(1 / 96), torch.bfloat16,
                                                          compiled, None, norm.weight, norm.eps, None)
        (loss / 96).backward()
        dp.finish_grad_sync()
        grads = [h.grad.float()] + [s.shard_grad.clone() for s in dp.slots]
        dp.zero_grad()
        return loss.item(), grads

    got_loss, got = run(True)
    want_loss, want = run(False)
    assert got_loss == pytest.approx(want_loss, rel=1e-3)
    for g, w in zip(got, want):
        assert w.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=0, atol=2 ** -7 * w.abs().max().item())


# ---- the trainer's fused loss at tp=2 and pp=2 against the single-process unfused trainer ----

SMALL_MODEL = ["model.dim=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=64",
               "train.device=cpu", "train.precision=fp32", "train.seq_len=32", "train.micro_batch_size=2",
               "train.global_batch_size=4", "parallel.distributed_optimizer=false"]
TRAINER_CASES = {  # name: (layout, model)
    "tp2-sp-mtp": (["parallel.tp=2"], ["model.mtp_layers=1"]),  # the head's input gathered; an MTP depth's norm too
    "tp2": (["parallel.tp=2", "parallel.sequence_parallel=false"], []),  # the norm's gain summed by the loss
    "pp2-tied": (["parallel.pp=2"], ["model.tie_embeddings=true"]),  # the last stage's norm; the head is the embedding
    "pp2-mtp": (["parallel.pp=2"], ["model.mtp_layers=1"]),  # the last stage's norms, main and MTP
}


def _trainer_step_grads(model: list[str], layout: list[str], fused: bool, chunk_elements: int = 20 * 132):
    """One step's forward and backward of `Trainer` (no optimizer step) on two fixed micro-batches:
    (loss sums, {parameter: (gradient, tp_shard_dim, tp rank)})."""
    from core import placement
    from core.train.data import mtp_inputs
    from core.train.trainer import Trainer
    from tests.support.batches import micro_batch
    from tests.support.cli import ROOT

    config = load_config(ROOT / "launch" / "configs" / "tiny_dense.toml",
                         [*SMALL_MODEL, *model, *layout, f"train.fused_loss={str(fused).lower()}"])
    threads, elements = torch.get_num_threads(), loss_module.FUSED_CHUNK_ELEMENTS
    torch.set_num_threads(1)  # as the gloo workers: the thread count changes how CPU sums split
    loss_module.FUSED_CHUNK_ELEMENTS = chunk_elements  # several chunks of each micro-batch, the last partial
    try:
        trainer = Trainer(config)
        depths = config.model.mtp_layers
        micro = []
        for seed in range(2):
            m = micro_batch(seed, config.model.vocab_size, seq=32)
            if depths:
                m.mtp_tokens, m.mtp_labels = mtp_inputs(m.tokens, m.labels, m.meta.cu_seqlens, depths)
                m.mtp_num_labels = tuple(float((m.mtp_labels[k] != -100).sum()) for k in range(depths))
            micro.append(m)
        # The fused loss runs the final norms' math itself: their modules must not run.
        calls = []
        chunks = trainer.grads.pipeline.chunks if trainer.grads.pipeline is not None else [trainer.model]
        for norm in (n for c in chunks if c.norm is not None for n in c.head_norms()):
            norm.register_forward_hook(lambda *_: calls.append(1))
        labels = float(sum(m.num_labels for m in micro))
        mtp_labels = [float(sum(m.mtp_num_labels[k] for m in micro)) for k in range(depths)]
        if trainer.grads.pipeline is not None:
            loss, extra, _ = trainer._pipeline_forward_backward(micro, labels, mtp_labels)
        else:
            loss, extra = trainer._forward_backward(micro, labels, mtp_labels)
        trainer.grads.dp.finish_grad_sync()
    finally:
        torch.set_num_threads(threads)
        loss_module.FUSED_CHUNK_ELEMENTS = elements
    tp_rank = trainer.mesh.coordinate("tp")
    grads = {s.name: (s.shard_grad.detach().numpy().copy(), placement.tp_shard_dim(s.param), tp_rank)
             for s in trainer.grads.dp.slots}
    return [float(loss), *extra.tolist()], grads, len(calls)


def _trainer_cases(rank, world):
    return {name: _trainer_step_grads(model, layout, True) for name, (layout, model) in TRAINER_CASES.items()}


@pytest.fixture(scope="module")
def trainer_runs():
    """One launch of 2 gloo processes runs every layout: process start-up dominates the cost."""
    return run_distributed(_trainer_cases, 2)


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_fused_loss_at_tp_and_pp_gives_the_single_process_gradients(trainer_runs, name):
    """Reference: the single-process trainer with `train.fused_loss=false` (the final norm on the
    whole sequence, the whole logits). Tolerance 1e-4 relative, 1e-6 of the largest gradient:
    tensor parallelism splits the matmul and vocab sums, the chunks the head's (measured: at most
    7e-7 of a parameter's largest gradient); a norm gain summed twice or not at all over tp is
    off by half of it or more."""
    layout, model = TRAINER_CASES[name]
    want_losses, want, norm_calls = _trainer_step_grads(model, [], False)
    assert norm_calls == 2 * (1 + ("model.mtp_layers=1" in model))  # each micro-batch, each depth
    tp = 2 if "parallel.tp=2" in layout else 1
    covered = set()
    for got_losses, grads, norm_calls in (per_rank[name] for per_rank in trainer_runs):
        assert norm_calls == 0  # folded into the loss's chunks
        assert got_losses == pytest.approx(want_losses, rel=1e-6), (got_losses, want_losses)
        for pname, (grad, shard_dim, tp_rank) in grads.items():
            full = torch.from_numpy(want[pname if pname in want else "tok_embeddings.weight"][0])
            if shard_dim is not None and tp > 1:
                size = full.shape[shard_dim] // tp
                full = full.narrow(shard_dim, tp_rank * size, size)
            floor = 1e-6 * full.abs().max().item()
            torch.testing.assert_close(torch.from_numpy(grad), full, rtol=1e-4, atol=floor, msg=f"{name} {pname}")
            covered.add(pname)
    # Every parameter on some rank (a tied head's last-stage copy stands for the embedding).
    assert covered - {"output.weight"} == set(want) - {"output.weight"} and "output.weight" in covered
    assert all(abs(g[0]).sum() > 0 for g in want.values())


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_folded_norm_matches_the_norm_outside_and_keeps_no_fp32_copy():
    """Compiled (what train.compile runs): the norm inside the chunks against the eager norm on the
    whole sequence before the fused head, bf16 (tolerance: bf16 rounding, the compiled norm keeps
    its fp32 rows unrounded); after the forward the folded head holds the bf16 input gradient
    [T, dim] and the norm outside adds its two fp32 copies and its bf16 output."""
    torch.manual_seed(0)
    tokens, dim, vocab = 16384, 1024, 32000
    norm, head = RMSNorm(dim, 1e-5), nn.Linear(dim, vocab, bias=False)
    nn.init.normal_(head.weight, std=0.02)
    dp = apply_data_parallel(nn.ModuleList([norm, head]).to("cuda", torch.bfloat16), ParallelMesh.build(device_type="cuda"),
                             distributed_optimizer=False, param_dtype=torch.bfloat16)
    hidden = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[::9] = -100
    count = int((labels != -100).sum())

    def run(folded: bool):
        h = hidden.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        part = fused_output_cross_entropy_sum(h if folded else norm(h), head.weight, labels,
                                              torch.tensor(1.0 / count, device="cuda"), compiled=True,
                                              norm=norm if folded else None)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        (part / count).backward()
        dp.finish_grad_sync()
        grads = [h.grad.float()] + [s.shard_grad.clone() for s in dp.slots]
        dp.zero_grad()
        return float(part), grads, kept

    for _ in range(2):  # the second round runs compiled code, not the compiler
        got_loss, got, got_kept = run(True)
        want_loss, want, want_kept = run(False)
    assert got_loss == pytest.approx(want_loss, rel=1e-4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=2 ** -7 * w.abs().max().item())
    row = tokens * dim
    assert got_kept < 2 * row + (1 << 20), got_kept  # the input gradient (+ the gain's and the loss)
    assert want_kept > (2 + 8 + 2) * row, want_kept
