"""Fine-grained recomputation and activation offload leave the training bit for bit unchanged.

Reference: the same Trainer (one process, CPU, fp32) without recomputation, on the same
synthetic micro-batches (documents of several lengths), two optimizer steps of two
micro-batches. Every recompute set and offload set must give identical losses, gradient norms
and final weights (tolerance 0: the recomputed values are the forward's, bit for bit), on the
tiny dense and the tiny MoE model. Also: what is dropped is really dropped (fewer bytes saved
for the backward), offloaded bytes are counted, and bad names stop at config time."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, load_config
from core.validation import validate
from core.parallel.recompute import ActivationOffload, apply_recompute
from core.train.model import build_model
from core.train.trainer import Trainer
from tests.support.batches import micro_batch

ROOT = Path(__file__).resolve().parents[1]
SETS = [
    ([], []),
    (["norms"], []),
    (["swiglu"], []),
    (["moe_experts"], []),
    (["attention_core"], []),
    (["attention"], []),
    (["mlp"], []),
    (["block"], []),
    (["norms", "swiglu", "attention_core"], []),
    ([], ["block"]),
    (["attention_core"], ["mlp"]),
    (["norms", "swiglu"], ["attention_core", "moe_experts"]),
]


def _train(name: str, recompute: list[str], offload: list[str], device: str = "cpu", *extra: str):
    config = load_config(ROOT / "launch" / "configs" / f"{name}.toml",
                         [f"train.device={device}", "train.micro_batch_size=2", "train.global_batch_size=4",
                          "train.seq_len=128", "parallel.ep=1", f"train.recompute_modules={recompute!r}",
                          f"train.offload_modules={offload!r}", *extra])
    trainer = Trainer(config)
    losses = []
    for step in range(2):
        micro = [micro_batch(10 * step + i, config.model.vocab_size, device=device) for i in range(2)]
        result = trainer.step(micro)
        losses.append((float(result.loss_sum), float(result.grad_norm)))
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return losses, weights, trainer.model.activation_offload


@functools.cache
def _reference(name: str):
    """(losses, weights) of `name` without recomputation: the reference of every CPU test here."""
    losses, weights, _ = _train(name, [], [])
    return losses, weights


@pytest.mark.slow  # 24 trainers built and stepped: about a minute on 2 cores
@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_recompute_and_offload_leave_training_identical(name):
    reference, ref_weights = _reference(name)
    for recompute, offload in SETS[1:]:
        losses, weights, offloader = _train(name, recompute, offload)
        assert losses == reference, (recompute, offload)
        for key, value in ref_weights.items():
            assert torch.equal(weights[key], value), (recompute, offload, key)
        if offload:
            assert offloader.stats["bytes"] > 0, offload


@pytest.mark.slow  # inductor compiles two tiny trainers on the CPU
def test_compiled_norms_and_swiglu_recompute_leave_training_unchanged():
    """Compiled, `norms` and `swiglu` are checkpoints inside the blocks' graphs (the partitioner
    recomputes them): the losses and weights follow the compiled run without them, to fp32
    rounding (the recomputing kernels fuse differently)."""
    reference, ref_weights, _ = _train("tiny_dense", [], [], "cpu", "train.compile=true")
    losses, weights, _ = _train("tiny_dense", ["norms", "swiglu"], [], "cpu", "train.compile=true")
    assert [x for pair in losses for x in pair] == pytest.approx([x for pair in reference for x in pair], rel=1e-5)
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, recompute, offload", [
    ("tiny_dense", [], ["attention", "mlp"]),
    ("tiny_moe", ["norms", "swiglu"], ["attention_core"]),
])
def test_offload_through_pinned_host_memory_leaves_training_identical_on_gpu(name, recompute, offload):
    # The GPU path: pinned host copies on a side stream (dense, transposed and gapped saved tensors;
    # the copies back must wait for the kernels that still read memory the allocator reuses).
    reference, ref_weights, _ = _train(name, recompute, [], device="cuda")
    losses, weights, offloader = _train(name, recompute, offload, device="cuda")
    assert losses == reference
    assert all(torch.equal(weights[k], v) for k, v in ref_weights.items())
    assert offloader.stats["bytes"] > 0


def _saved_bytes(model, micro) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward after one forward (hooks
    installed by the recompute step nest inside, so what they keep counts as its recipe)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(micro.tokens, micro.position_ids, micro.meta).sum().backward()
    return sum(seen.values())


def test_dropped_outputs_are_not_saved():
    """norms + swiglu: the consumers (wq/wk/wv, w2) keep a recipe instead of the norm's output and
    the product, and the modules' own saved tensors go with their checkpoints."""
    config = load_config(ROOT / "launch" / "configs" / "tiny_dense.toml", [])
    micro = micro_batch(0, config.model.vocab_size)
    plain = _saved_bytes(build_model(config.model, seed=0), micro)
    model = apply_recompute(build_model(config.model, seed=0), modules=["norms", "swiglu"])
    assert _saved_bytes(model, micro) < plain
    offloader = ActivationOffload(min_bytes=0)
    model = apply_recompute(build_model(config.model, seed=0), offload=["block"], offloader=offloader)
    model(micro.tokens, micro.position_ids, micro.meta).sum().backward()
    assert offloader.stats["tensors"] > 0 and offloader.stats["bytes"] > 0


@pytest.mark.slow  # three trainers built and stepped
def test_recompute_in_the_first_layers_only_leaves_training_identical():
    """train.recompute_num_layers=2 of 4: the first two blocks recompute their feed-forward, the
    others keep theirs; losses, norms and weights as without any recomputation."""
    reference, ref_weights = _reference("tiny_dense")
    losses, weights, _ = _train("tiny_dense", ["mlp"], [], "cpu", "train.recompute_num_layers=2")
    assert losses == reference
    for key, value in ref_weights.items():
        assert torch.equal(weights[key], value), key
    config = load_config(ROOT / "launch" / "configs" / "tiny_dense.toml", [])
    model = apply_recompute(build_model(config.model, seed=0), modules=["mlp"], num_layers=2)
    assert [getattr(b, "checkpoint_feed_forward", False) for b in model.layers.values()] == [True, True, False, False]
    micro = micro_batch(0, config.model.vocab_size)
    saved = [_saved_bytes(apply_recompute(build_model(config.model, seed=0), modules=["mlp"], num_layers=n), micro)
             for n in (0, 2)] + [_saved_bytes(build_model(config.model, seed=0), micro)]
    assert saved[0] < saved[1] < saved[2], saved  # all blocks recompute < two of four < none


@pytest.mark.parametrize("sets, message", [
    ({"train.recompute_modules": ["nrom"]}, "unknown module 'nrom'"),
    ({"train.recompute_modules": ["mlp", "mlp"]}, "names a module twice"),
    ({"train.recompute_modules": ["mlp"], "train.offload_modules": ["swiglu"]}, "overlaps the recomputed 'mlp'"),
    ({"train.recompute": "full", "train.offload_modules": ["attention"]}, "overlaps the recomputed 'block'"),
    ({"train.offload_modules": ["block"], "train.compile": True}, "train.compile cannot trace"),
    ({"train.recompute_modules": ["mlp"], "train.recompute_num_layers": -1}, "must be >= 0"),
    ({"train.recompute_num_layers": 2}, "limits a recomputation that is not set"),
])
def test_bad_module_sets_stop_at_config_time(sets, message):
    config = load_config(ROOT / "launch" / "configs" / "tiny_dense.toml", [f"{k}={v!r}".replace("True", "true")
                                                                           for k, v in sets.items()])
    with pytest.raises(ConfigError, match=message):
        validate(config, 1)
