"""FP8 weight cache (core/precision/weight_cache.py): quantise each weight once per optimizer step.

Proof by the real trainer path (`Trainer.step`: bf16 params, fp32 masters, FP8 GEMMs emulated
on CPU): with several micro-batches per step the cached run is bit-identical to the uncached
one over several optimizer steps, while the cache answered most quantisations; and a cache
that is not cleared after the optimizer step gives a different run (so the comparison sees
stale weights). Each model has a cache of its own: two trainers in one process do not share
it. Then the cache's own rules: what it refuses to cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from bench.fp8_training import packed
from core.config import Config, ModelConfig, MoEConfig
from core.precision.plan import resolve_precision_plan
from core.precision.weight_cache import Fp8WeightCache, cache_of
from core.train.data import StepInputs
from core.kernels import fp8 as kfp8
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.train.parallelize import parallelize
from core.train.trainer import Trainer

ACCUM, STEPS = 3, 3


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batches(vocab: int, steps: int, accum: int, device: str, seq: int = 64):
    gen = torch.Generator().manual_seed(3)
    return [packed(torch.randint(0, vocab, (2, seq + 1), generator=gen), device) for _ in range(steps * accum)]


def _trainer(cache: bool, device: str = "cpu", compile_blocks: bool = False) -> Trainer:
    moe = MoEConfig(num_experts=4, top_k=2, ffn_dim=128, num_shared_experts=1, first_k_dense=1)
    cfg = ModelConfig(vocab_size=256, dim=128, num_layers=2, num_heads=4, num_kv_heads=4, ffn_dim=384, moe=moe)
    config = Config(model=cfg)
    t = config.train
    t.precision, t.lr, t.warmup_steps, t.fp8_weight_cache, t.device = "fp8", 1e-2, 1, cache, device
    t.micro_batch_size, t.global_batch_size, t.seq_len = 2, 2 * ACCUM, 64
    t.compile = compile_blocks
    torch._dynamo.reset()
    return Trainer(config)


def _steps(trainer: Trainer, device: str = "cpu") -> list[float]:
    """STEPS optimizer steps of ACCUM micro-batches through the trainer's own step; the losses."""
    batches = iter(_batches(trainer.config.model.vocab_size, STEPS, ACCUM, device))
    losses = []
    for _ in range(STEPS):
        micro = []
        for _ in range(ACCUM):
            tokens, labels, positions, meta = next(batches)
            micro.append(StepInputs(tokens, labels, positions, meta, num_tokens=float(tokens.numel()),
                                    num_labels=float((labels != -100).sum())))
        result = trainer.step(micro)
        losses.append(float(result.loss_sum) / result.global_labels)
    return losses


def _train(cache: bool, clear_after_step: bool = True, device: str = "cpu",
           compile_blocks: bool = False) -> tuple[list[float], list[torch.Tensor], dict]:
    """(losses, final parameters, the weight cache's stats or {} without one) of a fresh run."""
    trainer = _trainer(cache, device, compile_blocks)
    weight_cache = trainer.grads.weight_cache
    if not clear_after_step:
        trainer.grads.dp.on_new_weights.remove(weight_cache.clear)
    losses = _steps(trainer, device)
    stats = dict(weight_cache.stats) if weight_cache is not None else {}
    return losses, [p.detach().clone() for p in trainer.model.parameters()], stats


# 16 FP8 weights (2 x 4 attention, 3 dense FFN, 3 shared expert, the experts' w13 (as its
# [E, dim, 2F] view) and w2) x 2 layouts (forward, dgrad): quantised on each step's first
# micro-batch, reused on the rest.
CACHED = {"misses": STEPS * 16 * 2, "hits": STEPS * 16 * 2 * (ACCUM - 1)}


def test_cached_weights_train_exactly_like_uncached():
    ref_losses, ref_params, ref_stats = _train(cache=False)
    assert ref_stats == {}  # the plan keeps no cache: none is made
    losses, params, stats = _train(cache=True)
    # The same quantisation of the same weights: bit-identical, not merely close.
    assert losses == ref_losses
    for p, ref in zip(params, ref_params):
        assert torch.equal(p, ref)
    assert stats == CACHED


def test_two_models_in_one_process_keep_their_own_caches():
    # The first trainer's cache stays its own when a second one is built beside it (a cache
    # shared by the process would then track the second model's parameters only, and the
    # first would quantise every weight on every micro-batch); its hits are its own.
    first, second = _trainer(cache=True), _trainer(cache=True)
    assert first.grads.weight_cache is not second.grads.weight_cache
    losses = _steps(first)
    assert first.grads.weight_cache.stats == CACHED
    assert second.grads.weight_cache.stats == {"hits": 0, "misses": 0}
    assert _steps(second) == losses  # the same seed and batches: the same run
    assert second.grads.weight_cache.stats == CACHED and first.grads.weight_cache.stats == CACHED


@pytest.mark.slow
def test_cached_weights_with_compiled_blocks_on_cpu():
    # Compiled blocks hand the FP8 ops the model's cache as a constant handle and the
    # parameters as graph inputs: every weight is still found in the model's cache, and the run
    # is the uncached one bit for bit (inductor on CPU, the kernels' exact fallbacks).
    ref_losses, ref_params, _ = _train(cache=False, compile_blocks=True)
    losses, params, stats = _train(cache=True, compile_blocks=True)
    assert stats == CACHED
    assert losses == ref_losses and all(torch.equal(p, ref) for p, ref in zip(params, ref_params))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cached_weights_on_the_gpu_with_compiled_blocks():
    # The kernels' quantisers, compiled blocks (their FP8 linears get the parameters as graph
    # inputs) and the shared experts on a side stream: every weight is still found in the cache.
    ref_losses, ref_params, _ = _train(cache=False, device="cuda", compile_blocks=True)
    losses, params, stats = _train(cache=True, device="cuda", compile_blocks=True)
    assert stats == CACHED
    # Routing's scatter-adds may order their sums differently from run to run on the GPU.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    for p, ref in zip(params, ref_params):
        torch.testing.assert_close(p.float(), ref.float(), rtol=1e-2, atol=1e-3)


def test_a_cache_kept_past_the_optimizer_step_changes_the_run():
    # The negative control: without the clear after the weight update, the next step's GEMMs use
    # the previous step's weights, and the run leaves the uncached one.
    ref_losses, _, _ = _train(cache=False)
    stale_losses, _, _ = _train(cache=True, clear_after_step=False)
    assert stale_losses[0] == ref_losses[0]
    assert stale_losses[1:] != ref_losses[1:]


def test_one_micro_batch_per_step_does_not_cache():
    cfg = ModelConfig(vocab_size=256, dim=128, num_layers=1, num_heads=4, num_kv_heads=4, ffn_dim=256)
    config = Config(model=cfg)
    config.train.precision, config.parallel.dp = "fp8", 1
    config.train.micro_batch_size = config.train.global_batch_size = 2
    cpu = torch.device("cpu")
    plan = resolve_precision_plan(config, cpu)
    assert not plan.weight_cache
    _, _, _, grads = parallelize(build_model(cfg, seed=0), ParallelMesh.build(device_type="cpu"), config, cpu, plan)
    assert grads.weight_cache is None


def test_cache_rules():
    cache = Fp8WeightCache()
    calls = []

    def quantiser(w, transpose):
        calls.append(transpose)
        return kfp8.quantize_128x128(w, transpose)

    w = torch.nn.Parameter(torch.randn(256, 128, dtype=torch.bfloat16))
    other = torch.randn(256, 128, dtype=torch.bfloat16)
    assert not cache.enabled
    cache.quantize(w, False, quantiser)
    cache.quantize(w, False, quantiser)
    assert len(calls) == 2  # nothing tracked: nothing cached

    cache.track([w])
    first = cache.quantize(w, False, quantiser)
    again = cache.quantize(w, False, quantiser)
    assert again[0] is first[0] and len(calls) == 3
    cache.quantize(w, True, quantiser)  # the other layout is its own entry
    assert len(calls) == 4
    assert cache.cached_bytes() == 2 * (w.numel() + 2 * 4)  # e4m3 bytes + one fp32 scale per block

    cache.quantize(other, False, quantiser)  # not a tracked parameter
    cache.quantize(w.detach()[:128], False, quantiser)  # a view of a different shape
    assert len(calls) == 6

    alias = w.detach()  # an alias of the parameter (as compiled graphs pass it): same storage, cached
    assert cache.quantize(alias, False, quantiser)[0] is first[0] and len(calls) == 6

    whole = w.view(2, 128, 128)  # all of it in another shape (as the experts' w13 runs): its own entry
    reshaped = cache.quantize(whole, False, quantiser)
    assert len(calls) == 7 and cache.quantize(whole, False, quantiser)[0] is reshaped[0] and len(calls) == 7
    assert reshaped[0].shape == (2, 128, 128) and cache.quantize(w, False, quantiser)[0] is first[0]

    with torch.no_grad():
        w.mul_(2)  # an in-place update bumps the version counter: the entry is stale
    fresh = cache.quantize(w, False, quantiser)
    assert len(calls) == 8 and torch.equal(fresh[1], first[1] * 2)

    w.data.mul_(2)  # .data writes are invisible to the counter: the writer must clear()
    assert cache.quantize(w, False, quantiser)[0] is fresh[0]
    cache.clear()
    assert torch.equal(cache.quantize(w, False, quantiser)[1], first[1] * 4) and len(calls) == 9
    assert cache.stats == {"hits": 5, "misses": 5}, cache.stats

    del w, first, again, fresh, alias, whole, reshaped  # the parameter dies: its address may be reused by anything
    newcomer = torch.randn(256, 128, dtype=torch.bfloat16)
    cache.quantize(newcomer, False, quantiser)
    cache.quantize(newcomer, False, quantiser)
    assert len(calls) == 11 and cache.stats["hits"] == 5


def test_the_ops_find_a_cache_by_its_handle_while_it_lives():
    cache = Fp8WeightCache()
    handle = cache.handle
    assert cache_of(handle) is cache and cache_of(0) is None
    twin = copy.deepcopy(cache)  # a copied model gets an empty cache of its own
    assert twin.handle != handle and cache_of(twin.handle) is twin and not twin.enabled
    del cache
    assert cache_of(handle) is None  # dropped with its model: the number names nothing
