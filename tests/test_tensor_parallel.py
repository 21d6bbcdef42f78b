"""Tensor (+ sequence) parallelism equals the single-process model; the vocab-parallel loss equals
F.cross_entropy; the autograd collectives have the gradients their definitions imply.

Reference for the model tests: `build_model(cfg, seed)` in one process, run on the same packed
batch, loss = F.cross_entropy(mean over labelled tokens), backward. The TP run (gloo, CPU)
must give the same loss and, after reassembling every gradient from its shards (all-gather
along `tp_shard_dim`; sequence-parallel partial gradients after
`sync_sequence_parallel_grads`), the same gradients.

Tolerance: everything is fp32; TP only changes the order of summations (split matmul
reductions summed by all-reduce / reduce-scatter, the log-sum-exp combined across vocab
shards), which moves results by a few fp32 ulps. We allow 1e-5 relative error, with an
absolute floor of 1e-6 of the largest reference gradient of that tensor (entries near zero
have no meaningful relative error). Measured errors are about 1e-7 relative.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.config import ModelConfig
from core.train.loss import cross_entropy_sum
from core.mesh import ParallelMesh
from core.layers import AttentionMeta
from core.train.model import build_model
from core.parallel import comm
from core.parallel.tensor import apply_tp, sync_sequence_parallel_grads
from tests.support.distributed import run_distributed

RTOL = 1e-5

CONFIGS = {  # GQA with num_kv_heads == tp, so each rank holds exactly one key/value head
    2: dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64),
    4: dict(vocab_size=128, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, ffn_dim=96),
}


def packed_batch(vocab: int, lengths=(7, 13, 3, 15, 6), pad: int = 4, seed: int = 7):
    """Documents of uneven lengths packed into one row, then `pad` padding tokens; labels are
    the next token inside each document and -100 at document ends and on padding."""
    g = torch.Generator().manual_seed(seed)
    seg = list(lengths) + ([pad] if pad else [])
    total = sum(seg)
    tokens = torch.randint(0, vocab, (total,), generator=g)
    tokens[total - pad:] = 0
    positions = torch.cat([torch.arange(n) for n in seg])
    labels = torch.roll(tokens, -1).clone()
    ends = torch.tensor(seg).cumsum(0) - 1
    labels[ends] = -100
    labels[total - pad:] = -100
    cu = torch.tensor([0] + torch.tensor(seg).cumsum(0).tolist(), dtype=torch.int32)
    return tokens, positions, labels, AttentionMeta(cu_seqlens=cu, max_seqlen=max(seg))


def _assert_close(actual, expected, name):
    floor = 1e-6 * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=floor, msg=lambda m: f"{name}: {m}")


def _reassemble(param, group, world):
    """The full gradient from every rank's shard (or the replicated one)."""
    grad = param.grad.contiguous()
    if param.tp_shard_dim is None:
        return grad
    parts = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(parts, grad, group=group)
    return torch.cat(parts, dim=param.tp_shard_dim)


def _tp_parity_worker(rank, world, device="cpu", lengths=(7, 13, 3, 15, 6), pad=4, overrides=None):
    torch.manual_seed(0)
    mesh = ParallelMesh.build(tp=world)
    group = mesh.group("tp")
    worst = {}
    for tied, sp in itertools.product((False, True), (False, True)):
        cfg = ModelConfig(**{**CONFIGS[world], **(overrides or {})}, tie_embeddings=tied)
        tokens, positions, labels, meta = packed_batch(cfg.vocab_size, lengths, pad)
        tokens, positions, labels = tokens.to(device), positions.to(device), labels.to(device)
        meta.cu_seqlens = meta.cu_seqlens.to(device)

        ref = build_model(cfg, seed=3).to(device)
        ref_loss = F.cross_entropy(ref(tokens, positions, meta), labels, ignore_index=-100)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}

        model = apply_tp(build_model(cfg, seed=3).to(device), mesh, sequence_parallel=sp)
        logits = model(tokens, positions, meta)
        assert logits.shape == (tokens.numel(), cfg.vocab_size // world), "logits must stay vocab-sharded"
        loss_sum, count = cross_entropy_sum(logits, labels, tp_group=group)
        assert count.item() == (labels != -100).sum().item()
        (loss_sum / count).backward()
        torch.testing.assert_close(loss_sum / count, ref_loss.detach(), rtol=RTOL, atol=0)

        norm_grad = model.norm.weight.grad.clone()
        sync_sequence_parallel_grads(model, mesh)
        if sp:  # before the sync each rank held only its tokens' share of the norm gradient
            assert not torch.allclose(norm_grad, ref_grads["norm.weight"], rtol=1e-3)
        assert (model.tok_embeddings.weight is model.output.weight) == tied

        names = [n for n, _ in model.named_parameters()]
        assert sorted(names) == sorted(ref_grads), "parameter names must match the plain model's"
        err = 0.0
        for name, param in model.named_parameters():
            assert getattr(param, "sequence_parallel_partial", False) == (sp and name.endswith("norm.weight")), name
            full = _reassemble(param, group, world)
            assert tuple(full.shape) == param.tp_full_shape == tuple(ref_grads[name].shape), name
            _assert_close(full, ref_grads[name], f"tied={tied} sp={sp} {name}")
            scale = ref_grads[name].abs().max().item()
            err = max(err, (full - ref_grads[name]).abs().max().item() / scale)
        worst[(tied, sp)] = err

    if world == 4 and device == "cpu":  # layouts that cannot work say why
        bad = ModelConfig(**{**CONFIGS[4], "num_kv_heads": 2})
        with pytest.raises(ValueError, match="2 key/value heads cannot be split over tp=4"):
            apply_tp(build_model(bad, seed=3), mesh)
        model = apply_tp(build_model(ModelConfig(**CONFIGS[4]), seed=3), mesh, sequence_parallel=True)
        tokens, positions, _, meta = packed_batch(128, pad=2)  # 46 tokens
        with pytest.raises(ValueError, match="46 tokens, not divisible by the group size 4"):
            model(tokens, positions, meta)
        with pytest.raises(ValueError, match="applied twice"):
            apply_tp(model, mesh)
    return worst


def _world2_worker(rank, world):
    """One spawn of 2 processes serves the tp=2 parity test and the loss/collectives test
    (process start-up dominates their cost); each part seeds its own data."""
    return {"tp": _tp_parity_worker(rank, world), "ce": _ce_and_comm_worker(rank, world)}


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2_worker, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_process(world, request):
    if world == 2:
        results = [r["tp"] for r in request.getfixturevalue("world2")]
    else:
        results = run_distributed(_tp_parity_worker, world)
    worst = max(max(r.values()) for r in results)
    print(f"tp={world}: worst gradient error relative to max |grad| = {worst:.2e}")
    assert worst < RTOL


def _ce_and_comm_worker(rank, world):
    group = dist.new_group(list(range(world)))
    # Vocab-parallel cross-entropy against F.cross_entropy on the full logits.
    g = torch.Generator().manual_seed(11)
    T, V = 37, 96
    full = torch.randn(T, V, generator=g) * 4
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::5] = -100
    ref = full.clone().requires_grad_()
    ref_sum = F.cross_entropy(ref, labels, ignore_index=-100, reduction="sum")
    (ref_sum * 0.37).backward()
    chunk = V // world
    for dtype in (torch.float32, torch.bfloat16):
        shard = full[:, rank * chunk:(rank + 1) * chunk].to(dtype).clone().requires_grad_()
        loss_sum, count = cross_entropy_sum(shard, labels, tp_group=group)
        assert loss_sum.dtype == torch.float32 and count.item() == (labels != -100).sum().item()
        (loss_sum * 0.37).backward()
        assert shard.grad.dtype == dtype
        if dtype == torch.float32:
            expected_sum, expected_grad = ref_sum.detach(), ref.grad[:, rank * chunk:(rank + 1) * chunk]
            torch.testing.assert_close(loss_sum, expected_sum, rtol=1e-6, atol=0)
            torch.testing.assert_close(shard.grad, expected_grad, rtol=1e-5, atol=1e-7)
        else:  # fp32 math on bf16 inputs: equals F.cross_entropy on the upcast logits
            up = full.to(torch.bfloat16).float().requires_grad_()
            up_sum = F.cross_entropy(up, labels, ignore_index=-100, reduction="sum")
            (up_sum * 0.37).backward()
            torch.testing.assert_close(loss_sum, up_sum.detach(), rtol=1e-6, atol=0)
            expected_grad = up.grad[:, rank * chunk:(rank + 1) * chunk]
            # The gradient is rounded to bf16 once at the end: within one bf16 ulp (2^-8).
            torch.testing.assert_close(shard.grad.float(), expected_grad, rtol=2**-8, atol=1e-7)

    # Collectives: with per-rank losses L_r = sum(y_r * w_r), each backward must give the
    # gradient of sum_r L_r (for the replicated-output ops, w is the same on every rank).
    x = (torch.arange(8.0).view(4, 2) + 10 * rank).requires_grad_()
    w = torch.arange(16.0).view(8, 2) * (rank + 1)
    w_all = [torch.arange(16.0).view(8, 2) * (r + 1) for r in range(world)]
    xs = [torch.arange(8.0).view(4, 2) + 10 * r for r in range(world)]

    y = comm.all_gather_tokens(x, group)
    assert torch.equal(y, torch.cat(xs))
    (y * w).sum().backward()
    assert torch.equal(x.grad, sum(wr for wr in w_all)[rank * 4:(rank + 1) * 4])

    x.grad = None
    y = comm.reduce_scatter_tokens(x, group)
    assert torch.equal(y, sum(xs)[rank * 2:(rank + 1) * 2])
    (y * w[:2]).sum().backward()
    assert torch.equal(x.grad, torch.cat([wr[:2] for wr in w_all]))

    x.grad = None
    y = comm.split_tokens(x, group)
    assert torch.equal(y, x.detach()[rank * 2:(rank + 1) * 2])
    (y * w[:2]).sum().backward()
    assert torch.equal(x.grad, torch.cat([wr[:2] for wr in w_all]))

    x.grad = None
    (comm.copy_to_group(x, group) * w[:4]).sum().backward()
    assert torch.equal(x.grad, sum(wr[:4] for wr in w_all))

    x.grad = None
    y = comm.reduce_from_group(x, group)
    assert torch.equal(y, sum(xs))
    (y * w_all[0][:4]).sum().backward()
    assert torch.equal(x.grad, w_all[0][:4])

    x.grad = None
    y = comm.all_gather_tokens(x, group, reduce_grad=False)
    (y * w_all[0]).sum().backward()
    assert torch.equal(x.grad, w_all[0][rank * 4:(rank + 1) * 4])

    # The all-reduce fallback (only for backends without reduce-scatter) gives the same result.
    native = comm.reduce_scatter_dim0(x.detach(), group)
    comm._no_reduce_scatter.add("gloo")
    try:
        assert torch.equal(comm.reduce_scatter_dim0(x.detach(), group), native)
    finally:
        comm._no_reduce_scatter.discard("gloo")
    return True


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_and_collectives(world2):
    assert [r["ce"] for r in world2] == [True, True]


def test_cross_entropy_sum_single_process():
    torch.manual_seed(0)
    logits = (torch.randn(20, 50) * 3).requires_grad_()
    labels = torch.randint(0, 50, (20,))
    labels[[0, 7, 19]] = -100
    loss_sum, count = cross_entropy_sum(logits, labels)
    assert count.dtype == torch.int64 and count.item() == 17
    ref = logits.detach().clone().requires_grad_()
    ref_sum = F.cross_entropy(ref, labels, ignore_index=-100, reduction="sum")
    loss_sum.backward()
    ref_sum.backward()
    torch.testing.assert_close(loss_sum, ref_sum.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-7)
    assert logits.grad[[0, 7, 19]].abs().sum() == 0

    with pytest.raises(ValueError, match=r"labels must be in \[0, 50\) or -100; found 50"):
        cross_entropy_sum(logits, torch.full((20,), 50))
    with pytest.raises(ValueError, match="expects logits \\[T, V\\] and labels \\[T\\]"):
        cross_entropy_sum(logits, labels[:5])
    again, _ = cross_entropy_sum(logits, labels)
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        again.backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_cross_entropy_sum_matches_eager_on_gpu():
    # train.compile's loss path: torch.compile'd F.cross_entropy on bf16 logits, fp32 math.
    torch.manual_seed(0)
    logits = (torch.randn(4096, 1000, device="cuda") * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 1000, (4096,), device="cuda")
    labels[::7] = -100
    ref = logits.detach().clone().requires_grad_()
    got, count = cross_entropy_sum(logits, labels, compiled=True)
    want, _ = cross_entropy_sum(ref, labels)
    got.backward()
    want.backward()
    assert count.item() == int((labels != -100).sum())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(logits.grad.float(), ref.grad.float(), rtol=1e-2, atol=1e-6)


def _gpu_worker(rank, world):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the parity check
    torch.backends.cudnn.allow_tf32 = False
    # Equal-length documents and no GQA: core.attention's CUDA paths have an fp32 kernel only
    # for that case (FlashAttention varlen needs 16-bit inputs; the fp32-capable SDPA kernel
    # takes no GQA). Labels are still -100 at each document end.
    worst = _tp_parity_worker(rank, world, "cuda", lengths=(12, 12, 12, 12), pad=0, overrides={"num_kv_heads": 4})
    return worst, sorted(comm._no_reduce_scatter)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_nccl_matches_single_process():
    for worst, fallbacks in run_distributed(_gpu_worker, 2, backend="nccl"):
        print(f"nccl tp=2: worst gradient error relative to max |grad| = {max(worst.values()):.2e}")
        assert fallbacks == [], "NCCL must use its native reduce-scatter"
