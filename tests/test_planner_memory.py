"""The planner's parameter, gradient and optimizer bytes per rank equal the trainer's tensors.

Reference: the tensors `core.train.parallelize.parallelize` allocates on each rank (bf16 parameters,
fp32 main-grad buckets and ZeRO-1 reduce-scatter targets, AdamW moments and fp32 masters), for
every legal layout (`core.planner.layouts`) of the tiny dense and MoE configs on 4 gloo ranks
(tp, pp with both schedules, cp, dp, ep, etp; one layout built of the splits of each dp*cp, whose
state the planner shows equal), fp32, ZeRO off, sizes that chunk unevenly and a tied embedding
over the pipeline, bf16 moments (train.optimizer_moments_dtype), and on one process; with optimizer
offload, the host's masters, moments and gradient and weight buffers. Tolerance: none, the counts
are exact.

The activation model against autograd: the bytes each block leaves alive after a bf16 forward on
the CPU (every storage an op creates, tracked until freed), for every recompute kind: exact for
the dense blocks, the head and the loss; MoE blocks within 1% (balanced routing assumed; the
CPU's per-expert loop saves slices of the SwiGLU product, so `swiglu` is left to the GPU check);
the peak of the eager norm's backward temporaries; and a compiled block (inductor on the CPU, its
linears adding their weight gradients into the main grads as in bf16 training) against the
tensors its compiled forward saves.
Peak memory and step time against the GPU: `bench/planner_check.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from core.config import load_config
from core.validation import validate
from core.layers import AttentionMeta, FeedForward, rms_norm
from core.train.loss import cross_entropy_sum, fused_output_cross_entropy_sum
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.parallel.data import apply_data_parallel
from core.parallel.recompute import apply_recompute
from core.parallel.wgrad import fuse_weight_grads
from core.precision.plan import resolve_precision_plan
from core.train.parallelize import compile_blocks, parallelize
from core.planner.layouts import describe, layouts
from core.planner.memory import (EAGER_NORM_BACKWARD_FP32, block_activations, estimate_memory, head_activations,
                                 rope_tables)
from core.planner.state import state_bytes
from moe.experts import GroupedExperts
from tests.support.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["train.device=cpu", "train.micro_batch_size=1", "train.global_batch_size=8"]


def _config(name: str, precision: str = "bf16", extra=()):
    return load_config(ROOT / "launch" / "configs" / f"{name}.toml", OVERRIDES + [f"train.precision={precision}", *extra])


def _measured(config) -> dict:
    """The bytes of this rank's tensors, read off the objects parallelize returns."""
    p = config.parallel
    mesh = ParallelMesh.build(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, device_type="cpu")
    cpu = torch.device("cpu")
    _, optimizer, _, grads = parallelize(build_model(config.model, seed=0), mesh, config, cpu,
                                         resolve_precision_plan(config, cpu))
    dp = grads.dp
    params = {id(s.param): s.param.numel() * s.param.element_size() for s in dp.slots}
    if dp.host is not None:  # optimizer offload: the optimizer's tensors are the host's
        host = optimizer.exp_avg + optimizer.exp_avg_sq + [s.master for s in dp.slots] + dp.host.grads
        return {
            "params": sum(params.values()),
            "grads": sum(b.grad_buffer.numel() * 4 for b in dp.buckets),
            "grad_shards": sum(b.shard_buffer.numel() * 4 for b in dp.buckets if b.sharded),
            "moments": 0, "masters": 0, "host": sum(t.numel() * t.element_size() for t in host),
        }
    return {
        "params": sum(params.values()),
        "grads": sum(b.grad_buffer.numel() * 4 for b in dp.buckets),
        "grad_shards": sum(b.shard_buffer.numel() * 4 for b in dp.buckets if b.sharded),
        "moments": sum(t.numel() * t.element_size() for t in optimizer.exp_avg + optimizer.exp_avg_sq),
        "masters": sum(s.master_low.numel() * 2 if s.master_low is not None else s.master.numel() * 4
                       for s in dp.slots if not s.master_is_param),
        "host": 0,
    }


def _predicted(config, rank: int) -> dict:
    s = state_bytes(config, rank)
    return {"params": s.params, "grads": s.grads, "grad_shards": s.grad_shards, "moments": s.moments,
            "masters": s.masters, "host": s.host}


UNEVEN = ["model.vocab_size=266", "model.ffn_dim=354"]  # ZeRO chunks of 67, 67, 67, 65 rows


def _state_classes(found: list) -> list:
    """One layout per class of equal state: a rank's state depends on dp and cp only through
    dp*cp (its index in the dp_cp and edp groups is the same however dp*cp splits), so of the
    splits of each (tp, pp, schedule, dp*cp, ep, etp) the middle one is built."""
    classes: dict[tuple, list] = {}
    for c in found:
        p = c.parallel
        classes.setdefault((p.tp, p.pp, p.pp_virtual_stages, p.dp * p.cp, p.ep, p.etp), []).append(c)
    return [group[len(group) // 2] for group in classes.values()]


def _check_world(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    wrong, seen = [], 0
    for name in ("tiny_dense", "tiny_moe"):
        found = list(layouts(_config(name), world, gpus_per_node=world))
        for c in found:  # the claim behind the classes, for every layout and rank
            rep = next(r for r in _state_classes(found) if (r.parallel.tp, r.parallel.pp, r.parallel.pp_virtual_stages,
                       r.parallel.dp * r.parallel.cp, r.parallel.ep, r.parallel.etp) == (
                       c.parallel.tp, c.parallel.pp, c.parallel.pp_virtual_stages, c.parallel.dp * c.parallel.cp,
                       c.parallel.ep, c.parallel.etp))
            if _predicted(c, rank) != _predicted(rep, rank):
                wrong.append(f"{name} {describe(c)} rank {rank}: state differs from {describe(rep)}'s")
        cases = [(c, "bf16") for c in _state_classes(found)]
        cases += [(validate(_config(name, "fp32"), world), "fp32"),
                  (validate(_config(name, "bf16", ["parallel.distributed_optimizer=false"]), world), "bf16 no ZeRO")]
        if name == "tiny_dense":
            cases += [(validate(_config(name, "bf16", UNEVEN + keys), world), "uneven")
                      for keys in ([], ["parallel.tp=2"], ["parallel.pp=2"])]
            cases += [(validate(_config(name, "bf16", ["model.tie_embeddings=true"] + keys), world), "tied")
                      for keys in ([], ["parallel.pp=2"])]
            cases += [(validate(_config(name, precision, UNEVEN + ["train.optimizer_offload=true"] + keys), world),
                       "offload") for precision, keys in (("bf16", ["parallel.tp=2"]), ("fp32", []),
                                                          ("bf16", ["parallel.distributed_optimizer=false"]))]
            cases += [(validate(_config(name, "bf16", UNEVEN + ["train.optimizer_moments_dtype=bf16"] + keys), world),
                       "bf16 moments") for keys in ([], ["train.optimizer_offload=true"])]
        for config, what in cases:
            seen += 1
            measured, predicted = _measured(config), _predicted(config, rank)
            if measured != predicted:
                wrong.append(f"{name} {describe(config)} {what} rank {rank}: measured {measured} predicted {predicted}")
    return wrong + [f"layouts {seen}"]


@pytest.mark.slow  # 4 gloo processes, every class of layouts of two configs built once
def test_state_bytes_exact_on_four_ranks():
    results = run_distributed(_check_world, 4, timeout=300)
    wrong = [line for r in results for line in r if not line.startswith("layouts")]
    assert not wrong, "\n".join(wrong[:20])
    assert int(results[0][-1].split()[1]) == 7 + 16 + 2 * 2 + 5 + 3 + 2  # every class was built and compared


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-split", "bf16-offload", "bf16-moments",
                                       "bf16-offload-moments"])
def test_state_bytes_exact_on_one_process(name, precision):
    split = ["parallel.split_master_weights=true"] if precision == "bf16-split" else []
    split += ["train.optimizer_offload=true"] if "offload" in precision else []
    split += ["train.optimizer_moments_dtype=bf16"] if "moments" in precision else []
    config = validate(_config(name, precision.split("-")[0], ["parallel.ep=1", *split]), 1)
    assert _measured(config) == _predicted(config, 0)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_state_bytes_exact_with_multi_token_prediction(name):
    # The MTP modules (their blocks MoE blocks in tiny_moe) sit on the last stage.
    config = validate(_config(name, "bf16", ["parallel.ep=1", "model.mtp_layers=2"]), 1)
    assert _measured(config) == _predicted(config, 0)
    assert _predicted(config, 0)["params"] > _predicted(validate(_config(name, "bf16", ["parallel.ep=1"]), 1), 0)["params"]


class _Storages(TorchDispatchMode):
    """Every storage an op creates, tagged with the part of the model that was running."""

    def __init__(self, params):
        super().__init__()
        self.where, self.made, self.refs = "other", [], {}
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key, old = storage.data_ptr(), self.refs.get(storage.data_ptr())
                if key not in self.params and (old is None or old.expired()):  # views share one storage
                    self.refs[key] = StorageWeakRef(storage)
                    self.made.append((self.where, self.refs[key], storage.nbytes()))
        return out

    def alive(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for where, ref, size in self.made:
            if not ref.expired():
                out[where] = out.get(where, 0) + size
        return out


class _PeakStorages(_Storages):
    """_Storages that also keeps the largest sum of the live storages after any op."""

    def __init__(self):
        super().__init__([])
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, sum(self.alive().values()))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_norm_backward_temporaries_peak_where_the_planner_counts(dtype):
    tokens, dim = 1024, 192
    x = torch.randn(tokens, dim, dtype=dtype, requires_grad=True)
    weight = torch.ones(dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, dim, dtype=dtype)
    out = rms_norm(x, weight, 1e-5)
    track = _PeakStorages()
    with track:
        out.backward(grad)
    rows = tokens * dim * 4
    assert EAGER_NORM_BACKWARD_FP32 * rows <= track.peak < EAGER_NORM_BACKWARD_FP32 * rows + 16 * tokens, track.peak


def _saved_bytes(config, recompute: tuple[str, ...]) -> dict[str, int]:
    """Bytes alive after the forward and the loss of one micro-batch, by block, on the CPU."""
    model = build_model(config.model, seed=0).to(torch.bfloat16)  # as the trainer casts for bf16
    chunk = config.train.mlp_chunk_tokens
    for module in model.modules():  # train.mlp_chunk_tokens, as core.train.parallelize sets it
        if isinstance(module, FeedForward):
            module.chunk_tokens = chunk
        elif isinstance(module, GroupedExperts):
            module.chunk_rows = chunk * config.model.moe.top_k
    apply_recompute(model, "none", list(recompute), [])
    n = config.train.seq_len
    tokens = torch.randint(0, config.model.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
    track = _Storages(model.parameters())
    for i, block in model.layers.items():
        block.register_forward_pre_hook(lambda *_, i=i: setattr(track, "where", f"layer{i}"))
    model.norm.register_forward_pre_hook(lambda *_: setattr(track, "where", "head"))
    with track:
        loss, _ = cross_entropy_sum(model(tokens, torch.arange(n), meta), torch.roll(tokens, -1))
    alive = track.alive()
    del loss
    return alive


RECOMPUTE_SETS = [(), ("norms",), ("swiglu",), ("attention_core",), ("attention",), ("mlp",), ("block",),
                  ("norms", "swiglu")]


def test_activation_model_equals_autograd_saved_tensors():
    dense = validate(_config("tiny_dense", "bf16", ["train.seq_len=256"]), 1)
    moe = validate(_config("tiny_moe", "bf16", ["train.seq_len=256", "parallel.ep=1"]), 1)
    for recompute in RECOMPUTE_SETS:
        alive = _saved_bytes(dense, recompute)
        assert alive["layer1"] == block_activations(dense, 1, set(recompute), set()).device, recompute
        if not recompute:  # the checkpoints of the other sets keep the embedding's output too
            assert alive["other"] - rope_tables(dense) < 1024, alive  # + positions as floats
            assert 0 <= alive["head"] - head_activations(dense) < 64, alive  # + the loss sums (scalars)
        if "swiglu" not in recompute:
            got, want = _saved_bytes(moe, recompute)["layer1"], block_activations(moe, 1, set(recompute), set()).device
            assert abs(got - want) <= 0.01 * want, (recompute, got, want)


@pytest.mark.parametrize("recompute", [(), ("attention_core",), ("norms",)])
def test_tiled_mlp_activations_equal_autograd_saved_tensors(recompute):
    """train.mlp_chunk_tokens: the tiled SwiGLU keeps its input alone, whatever the chunk."""
    config = validate(_config("tiny_dense", "bf16", ["train.seq_len=256", "train.mlp_chunk_tokens=64"]), 1)
    assert _saved_bytes(config, recompute)["layer1"] == block_activations(config, 1, set(recompute), set()).device
    plain = validate(_config("tiny_dense", "bf16", ["train.seq_len=256"]), 1)
    assert block_activations(plain, 1, set(recompute), set()).device > block_activations(config, 1, set(recompute), set()).device
    # The routed experts keep their rows alone, the shared expert its input.
    keys = ["train.seq_len=256", "parallel.ep=1"]
    moe = validate(_config("tiny_moe", "bf16", keys + ["train.mlp_chunk_tokens=64"]), 1)
    got, want = _saved_bytes(moe, recompute)["layer1"], block_activations(moe, 1, set(recompute), set()).device
    assert abs(got - want) <= 0.01 * want, (recompute, got, want)
    untiled = block_activations(validate(_config("tiny_moe", "bf16", keys), 1), 1, set(recompute), set()).device
    assert untiled > 1.5 * want, (untiled, want)


def test_recompute_in_the_first_layers_counts_per_block():
    """train.recompute_num_layers: the estimate's activations are those of the first N blocks
    recomputing plus the other blocks' plain ones (4 blocks; N past the end: all recompute)."""
    def activations(extra, world=1):
        config = validate(_config("tiny_dense", "bf16", ["train.seq_len=256", *extra]), world)
        return estimate_memory(config, 0).activations, config

    plain, config = activations([])
    full, _ = activations(["train.recompute_modules=['mlp']"])
    part, _ = activations(["train.recompute_modules=['mlp']", "train.recompute_num_layers=1"])
    saved = block_activations(config, 1, set(), set()).device - block_activations(config, 1, {"mlp"}, set()).device
    assert saved > 0 and plain - part == saved and part - full == 3 * saved  # 4 blocks, one recomputes
    everything, _ = activations(["train.recompute_modules=['mlp']", "train.recompute_num_layers=9"])
    assert everything == full


def test_fused_loss_head_activations_equal_autograd_saved_tensors():
    # The fused head runs the final norm inside its chunks and keeps the norm's input gradient
    # [T, dim] (and the gain's [dim]) where the plain one keeps the norm's fp32 copies, the head's
    # input and the loss's [T, V] tensors; what the chunks create in between is freed before the
    # forward ends.
    config = validate(_config("tiny_dense", "bf16", ["train.seq_len=256", "train.fused_loss=true"]), 1)
    model = build_model(config.model, seed=0).to(torch.bfloat16)
    dp = apply_data_parallel(model, ParallelMesh.build(), distributed_optimizer=False, param_dtype=torch.bfloat16)
    n = config.train.seq_len
    tokens = torch.randint(0, config.model.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
    scale = torch.tensor(1.0 / n)
    # The main grads are state: the head's weight gradient is added into them in place.
    track = _Storages([*model.parameters(), *(bucket.grad_buffer for bucket in dp.buckets)])
    with track:
        hidden = model.hidden_states(tokens, torch.arange(n), meta, normed=False)
        track.where = "head"
        loss = fused_output_cross_entropy_sum(hidden, model.output.weight, torch.roll(tokens, -1), scale,
                                              norm=model.norm)
        del hidden  # the last block's output: the trainer keeps no reference either
    alive = track.alive()
    del loss
    assert 0 <= alive["head"] - head_activations(config) < 64, (alive, head_activations(config))  # + the loss sum
    plain = validate(_config("tiny_dense", "bf16", ["train.seq_len=256"]), 1)
    assert head_activations(plain) - head_activations(config) >= n * config.model.vocab_size * 4
    # The fp32 copies of the whole hidden state are gone: per token the head keeps 2 * dim bytes.
    assert head_activations(config) - 4 * config.model.dim == n * config.model.dim * 2


@pytest.mark.slow  # inductor compiles the blocks on the CPU (~30 s a set)
@pytest.mark.parametrize("recompute", [(), ("mlp", "norms")], ids=["none", "mlp+norms"])
def test_compiled_block_activations_equal_what_inductor_saves(recompute):
    config = validate(_config("tiny_dense", "bf16", ["train.seq_len=192", "train.compile=true",
                                                     f"train.recompute_modules={list(recompute)!r}"]), 1)
    model = apply_recompute(build_model(config.model, seed=0).to(torch.bfloat16), modules=recompute, compiled=True)
    compile_blocks([model], one_graph_per_break="norms" in recompute)
    fuse_weight_grads([model])  # as the trainer does: the linears are custom ops the partitioner may recompute
    for p in model.parameters():
        if getattr(p, "accumulates_main_grad", False):
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    n = config.train.seq_len
    tokens = torch.randint(0, config.model.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
    params = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, getattr(p, "main_grad", p))}
    saved: dict[int, int] = {}
    model.layers["1"].register_forward_pre_hook(lambda *_: saved.clear())  # what block 1 saves, once per storage

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def run_block_1(module, args, output):
        nonlocal total
        total = sum(saved.values())

    total = 0
    model.layers["1"].register_forward_hook(run_block_1)
    with saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(n), meta).float().sum().backward()
    assert total == block_activations(config, 1, set(recompute), set()).device + rope_tables(config)  # + cos/sin


def test_each_recompute_kind_saves_activation_memory():
    config = validate(_config("tiny_moe", "bf16", ["parallel.ep=1", "train.seq_len=4096"]), 1)
    plain = {i: block_activations(config, i, set(), set()).device for i in (0, 1)}  # dense, MoE
    for kind in ("norms", "swiglu", "attention", "mlp", "block"):
        for i in (0, 1):
            assert block_activations(config, i, {kind}, set()).device < plain[i], (kind, i)
    assert block_activations(config, 1, {"moe_experts"}, set()).device < plain[1]
    moved = block_activations(config, 1, set(), {"block"})
    assert moved.device == 0 and moved.offloaded == plain[1]
    assert estimate_memory(config).peak_allocated > state_bytes(config).total


# Value heads as wide as the query/key heads here: the CPU's SDPA saves what FlashAttention does
# (out and the log-sum-exp) only for one head size; with two it takes the math path, which keeps
# the probabilities. The GPU kernels keep out and lse for either.
MLA = ["model.attention=mla", "model.kv_lora_rank=64", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=16",
       "model.v_head_dim=48"]


@pytest.mark.parametrize("q_lora_rank", [0, 48])
def test_mla_activation_model_equals_autograd_saved_tensors(q_lora_rank):
    """Multi-head latent attention: the latents, their norms and the core's q, k, v of two head sizes,
    and what `mla_up` keeps instead (the latents and the output), exact as for grouped-query attention."""
    config = validate(_config("tiny_dense", "bf16", ["train.seq_len=256", *MLA, f"model.q_lora_rank={q_lora_rank}"]), 1)
    kept = {}
    for recompute in [(), ("norms",), ("attention_core",), ("mla_up",), ("attention",)]:
        kept[recompute] = _saved_bytes(config, recompute)["layer1"]
        assert kept[recompute] == block_activations(config, 1, set(recompute), set()).device, recompute
    assert kept[("mla_up",)] < kept[("attention_core",)] < kept[()]


@pytest.mark.parametrize("q_lora_rank", [0, 48])
def test_mla_state_bytes_and_parameter_count_exact(q_lora_rank):
    """The planner's parameters of an MLA MoE model (the latent projections, norms and two head
    sizes) equal the built model's, and so do its state bytes; the tp=2 shapes are the
    in-process TP test's (tests/test_mla_parallel.py), which reassembles every shard."""
    from core.planner.state import local_params
    from core.train.model import count_params

    keys = ["parallel.ep=1", "model.attention_bias=true", *MLA, f"model.q_lora_rank={q_lora_rank}"]
    config = validate(_config("tiny_moe", "fp32", keys), 1)
    model = build_model(config.model, seed=0)
    specs = {s.name: s.shape for s in local_params(config)}
    assert specs == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert sum(torch.Size(shape).numel() for shape in specs.values()) == count_params(model)[0]
    assert _measured(config) == _predicted(config, 0)
