"""Tessera's model computes what transformers computes, for each family it reads.

Reference: tiny random models built with transformers itself (LlamaForCausalLM with llama3 and
with yarn rope scaling, Qwen3ForCausalLM with qk-norm, attention biases and a head size other
than hidden/heads, Qwen3MoeForCausalLM with a dense layer from `mlp_only_layers` and
`decoder_sparse_step`, MixtralForCausalLM), eager attention, fp32 on the CPU. Their weights
are re-drawn large (normal, std 0.3; norm gains 1 + 0.3 N(0, 1); routers std 0.6) so the
output depends on every detail: with the default init every logit is about 0 and any model
gives a loss near ln V. The weights are copied into `core.train.model.GPT` (`tessera_state` below:
the names and layouts of transformers 5's in-memory modules, fused experts included).

The batch: three documents of different lengths packed into one row; transformers runs each
document alone (positions from 0), Tessera runs the packed row with `cu_seqlens` and the
documents' position ids. Compared: the logits of every token (abs 1e-4, with logits up to
about 9) and the mean next-token cross-entropy within the documents (rel 1e-5). Both sides
are fp32 and differ only in summation order (attention kernels, per-expert loops); measured
(printed with -s): logits within 7e-6 (dense) to 3e-5 (Mixtral), losses within 1e-7. The
rotary frequencies and the yarn attention factor are bit-identical to transformers'.

Negative controls, each the same comparison with one feature turned off on Tessera's side
(the weights it still has copied): rope scaling off (llama3, yarn), qk-norm off, attention
biases dropped, the top-k renormalisation flipped (Qwen3-MoE with norm_topk_prob, Mixtral),
the dense layer of `mlp_only_layers` made an MoE layer (its weights then do not fit). Each
must miss by far more than the tolerance.

Tensor parallelism (`@pytest.mark.slow`, 2 processes, gloo): the Qwen3 model (qk-norm,
biases, head_dim override) split over tp=2 with and without sequence parallelism gives the
single-process loss (rel 1e-5) and, reassembled, the same gradients (rel 1e-5 of each
tensor's largest gradient; measured 4e-6), and the same loss as transformers.

Also here: the config keys these families need (`model.head_dim`, `[model.rope_scaling]`,
`model.moe.dense_layers`) refuse what the model cannot compute, with the key in the message.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from core.config import Config, ConfigError, ModelConfig, MoEConfig, RopeScalingConfig, load_config  # noqa: E402
from core.validation import validate  # noqa: E402
from core.layers import AttentionMeta, rope_frequencies  # noqa: E402
from core.train.loss import cross_entropy_sum  # noqa: E402
from core.mesh import ParallelMesh  # noqa: E402
from core.train.model import GPT  # noqa: E402
from core.parallel.data import zero_shard_dim  # noqa: E402
from core.parallel.tensor import apply_tp, sync_sequence_parallel_grads  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402

LOGITS_ATOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
LENGTHS = (13, 29, 22)  # three documents, 64 tokens
VOCAB = 96


# ------------------------------------------------------------------------------- the models
def _common(**extra) -> dict:
    return {**dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False),
            **extra}


def _llama3_rope() -> dict:
    # theta 100 and an original context of 32: wavelengths 6.3 (kept), 11 and 20 (blended),
    # 35 and up (divided by the factor); every branch of the llama3 rule is used.
    return {"rope_type": "llama3", "rope_theta": 100.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _yarn_rope() -> dict:
    # The ramp between extrapolated and interpolated frequencies spans dimensions 0..5 of 8.
    return {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0}


def _tessera_rope(hf: dict) -> RopeScalingConfig:
    keys = {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
            "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}
    return RopeScalingConfig(type=hf["rope_type"], **{k: v for k, v in hf.items() if k in keys})


CASES = {
    # name: (transformers class, its config, Tessera's model config)
    "llama3_rope": (
        "LlamaForCausalLM", _common(rope_parameters=_llama3_rope(), attention_bias=False),
        dict(rope_theta=100.0, rope_scaling=_tessera_rope(_llama3_rope())),
    ),
    "llama_yarn": (
        "LlamaForCausalLM", _common(rope_parameters=_yarn_rope()),
        dict(rope_theta=100.0, rope_scaling=_tessera_rope(_yarn_rope())),
    ),
    "qwen3": (  # head_dim 16 with hidden 48 / 4 heads = 12
        "Qwen3ForCausalLM", _common(rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, head_dim=16,
                                    attention_bias=True, use_sliding_window=False),
        dict(rope_theta=1000.0, head_dim=16, qk_norm=True, attention_bias=True),
    ),
    "qwen3_moe": (  # layer 1 dense (mlp_only_layers), layers 0 and 2 MoE; norm_topk_prob on
        "Qwen3MoeForCausalLM", _common(num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                                       num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                       use_sliding_window=False),
        dict(rope_theta=1000.0, qk_norm=True,
             moe=MoEConfig(num_experts=6, top_k=2, ffn_dim=24, normalize_topk=True, dense_layers=[1])),
    ),
    "qwen3_moe_step2": (  # decoder_sparse_step 2: layers 1 and 3 MoE; raw top-k probabilities
        "Qwen3MoeForCausalLM", _common(num_hidden_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                                       num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                       norm_topk_prob=False, decoder_sparse_step=2, use_sliding_window=False),
        dict(rope_theta=1000.0, qk_norm=True,
             moe=MoEConfig(num_experts=6, top_k=3, ffn_dim=24, normalize_topk=False, first_k_dense=1, moe_every=2)),
    ),
    "mixtral": (
        "MixtralForCausalLM", _common(rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                                      num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        dict(rope_theta=1000.0, moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=80, normalize_topk=True)),
    ),
}


def hf_model(name: str):
    """A transformers model of case `name` with large random weights (see the module doc)."""
    cls_name, hf_cfg, _ = CASES[name]
    cls = getattr(transformers, cls_name)
    config = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(**hf_cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = cls(config).float().eval()
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif pname.endswith("gate.weight"):  # routers: decisive choices
                p.copy_(0.6 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def tessera_config(name: str, **changes) -> ModelConfig:
    cls_name, hf_cfg, extra = CASES[name]
    keys = dict(vocab_size=hf_cfg["vocab_size"], dim=hf_cfg["hidden_size"], num_layers=hf_cfg["num_hidden_layers"],
                num_heads=hf_cfg["num_attention_heads"], num_kv_heads=hf_cfg["num_key_value_heads"],
                ffn_dim=hf_cfg["intermediate_size"], norm_eps=hf_cfg["rms_norm_eps"],
                tie_embeddings=hf_cfg["tie_word_embeddings"])
    m = ModelConfig(**{**keys, **extra, **changes})
    m.moe = dataclasses.replace(m.moe, aux_loss_coeff=0.0)  # the logits only; transformers adds none either
    validate(Config(model=m), 1)
    return m


_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_norm": "q_norm", "k_norm": "k_norm"}
_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def tessera_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tessera parameter names and layouts for a transformers 5 state dict of these families.

    Linear weights are [out, in] on both sides and rotary uses the same two halves of each
    head, so attention needs no permutation. Experts: transformers holds `gate_up_proj`
    [E, 2I, D] (gate rows first) and `down_proj` [E, D, I]; Tessera holds w13 [E, D, 2, I]
    (gate at [:, :, 0], up at [:, :, 1]) and w2 [E, I, D], so each is the transpose per expert."""
    out = {}
    for key, value in hf_state.items():
        parts = key.split(".")
        if key == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = value
        elif key == "model.norm.weight":
            out["norm.weight"] = value
        elif key == "lm_head.weight":
            out["output.weight"] = value
        elif parts[:2] == ["model", "layers"]:
            layer, rest = parts[2], parts[3:]
            prefix = f"layers.{layer}."
            if rest[0] in _NORMS:
                out[prefix + _NORMS[rest[0]] + ".weight"] = value
            elif rest[0] == "self_attn":
                out[prefix + "attention." + _ATTN[rest[1]] + "." + rest[2]] = value
            elif rest[:2] == ["mlp", "gate"]:
                out[prefix + "feed_forward.router.weight"] = value
            elif rest[:2] == ["mlp", "experts"] and rest[2] == "gate_up_proj":
                hidden = value.shape[1] // 2
                out[prefix + "feed_forward.experts.w13"] = value.transpose(1, 2).unflatten(2, (2, hidden)).contiguous()
            elif rest[:2] == ["mlp", "experts"] and rest[2] == "down_proj":
                out[prefix + "feed_forward.experts.w2"] = value.transpose(1, 2).contiguous()
            elif rest[0] == "mlp" and rest[1] in _MLP:
                out[prefix + "feed_forward." + _MLP[rest[1]] + ".weight"] = value
            else:
                raise KeyError(f"no Tessera place for {key}")
        else:
            raise KeyError(f"no Tessera place for {key}")
    return out


def load_tessera(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> GPT:
    """GPT with `state` copied in; parameters `state` lacks must be ones the config made extra."""
    model = GPT(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    expert_bias = [k for k in missing if k.endswith("router.expert_bias")]  # a buffer, zeros
    assert not unexpected and set(missing) == set(expert_bias), (missing, unexpected)
    return model.eval()


# -------------------------------------------------------------------------------- the batch
def batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    labels = torch.roll(tokens, -1).clone()
    labels[torch.tensor(LENGTHS).cumsum(0) - 1] = -100  # no label across a document end
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, positions, labels, AttentionMeta(cu_seqlens=cu, max_seqlen=max(LENGTHS), doc_lengths=LENGTHS)


@torch.no_grad()
def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Each document run alone (positions from 0), the logits concatenated."""
    return torch.cat([model(input_ids=doc[None]).logits[0] for doc in tokens.split(list(LENGTHS))])


@torch.no_grad()
def compare(model: GPT, reference: torch.Tensor) -> tuple[float, float]:
    """(max |logit difference|, relative loss difference) of `model` on the batch."""
    tokens, positions, labels, meta = batch()
    logits = model(tokens, positions, meta)
    loss = F.cross_entropy(logits, labels, ignore_index=-100)
    ref_loss = F.cross_entropy(reference, labels, ignore_index=-100)
    return (logits - reference).abs().max().item(), abs(loss.item() - ref_loss.item()) / ref_loss.item()


_reference_cache: dict[str, tuple] = {}


def reference(name: str):
    """(transformers model, its logits on the batch, Tessera state) of case `name`."""
    if name not in _reference_cache:
        model = hf_model(name)
        _reference_cache[name] = (model, hf_logits(model, batch()[0]), tessera_state(model.state_dict()))
    return _reference_cache[name]


# -------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_loss_match_transformers(name):
    _, logits, state = reference(name)
    assert logits.abs().max() > 5, "weights too small: the comparison would not see the details"
    tokens, _, labels, _ = batch()
    assert F.cross_entropy(logits, labels, ignore_index=-100) > math.log(VOCAB) + 1
    err, loss_err = compare(load_tessera(tessera_config(name), state), logits)
    print(f"{name}: max |logit diff| {err:.2e}, loss rel diff {loss_err:.2e}")
    assert err < LOGITS_ATOL and loss_err < LOSS_RTOL


@pytest.mark.parametrize("name", ["llama3_rope", "llama_yarn"])
def test_rope_frequencies_equal_transformers(name):
    model = reference(name)[0]
    rotary = model.model.rotary_emb
    inv_freq, scale = rope_frequencies(tessera_config(name))
    assert torch.equal(inv_freq, rotary.inv_freq.cpu()), "inv_freq must be bit-identical"
    assert scale == rotary.attention_scaling
    if name == "llama_yarn":
        assert scale == pytest.approx(0.1 * math.log(4.0) + 1.0)


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "truncate": False,
     "beta_fast": 16.0, "beta_slow": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.3},
])
def test_rope_init_functions_of_transformers(params):
    """Every scaling type at realistic sizes (head 128, theta 1e6) against ROPE_INIT_FUNCTIONS."""
    hf = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128, max_position_embeddings=131072,
                                  rope_parameters={"rope_theta": 1e6, **params})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf)
    cfg = ModelConfig(dim=1024, num_heads=8, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                      rope_scaling=_tessera_rope(params))
    validate(Config(model=cfg), 1)
    ours, our_scale = rope_frequencies(cfg)
    assert torch.equal(ours, inv_freq) and our_scale == scale


NEGATIVE = {
    # case: (what is turned off, changes to Tessera's config, state keys dropped)
    "rope scaling off (llama3)": ("llama3_rope", dict(rope_scaling=RopeScalingConfig()), ()),
    "rope scaling off (yarn)": ("llama_yarn", dict(rope_scaling=RopeScalingConfig()), ()),
    "yarn without its attention factor": ("llama_yarn", dict(rope_scaling=_tessera_rope({**_yarn_rope(), "attention_factor": 1.0})), ()),
    "llama3 read as linear": ("llama3_rope", dict(rope_scaling=RopeScalingConfig(type="linear", factor=4.0)), ()),
    "qk-norm off": ("qwen3", dict(qk_norm=False), ("q_norm", "k_norm")),
    "attention biases off": ("qwen3", dict(attention_bias=False), ("bias",)),
    "top-k renormalisation off (Qwen3-MoE)": ("qwen3_moe", dict(moe=MoEConfig(num_experts=6, top_k=2, ffn_dim=24, normalize_topk=False,
                                                                          dense_layers=[1])), ()),
    "top-k renormalisation on (Qwen3-MoE)": ("qwen3_moe_step2", dict(moe=MoEConfig(num_experts=6, top_k=3, ffn_dim=24, normalize_topk=True,
                                                                               first_k_dense=1, moe_every=2)), ()),
    "top-k renormalisation off (Mixtral)": ("mixtral", dict(moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=80, normalize_topk=False)), ()),
}


@pytest.mark.parametrize("what", list(NEGATIVE))
def test_negative_controls_miss(what):
    name, changes, dropped = NEGATIVE[what]
    _, logits, state = reference(name)
    state = {k: v for k, v in state.items() if not any(d in k.split(".") for d in dropped)}
    err, loss_err = compare(load_tessera(tessera_config(name, **changes), state), logits)
    print(f"{what}: max |logit diff| {err:.2e}, loss rel diff {loss_err:.2e}")
    assert err > 100 * LOGITS_ATOL and loss_err > 10 * LOSS_RTOL


def test_dense_layers_are_where_transformers_has_them():
    # Without dense_layers layer 1 of the Qwen3-MoE case would be an MoE layer: its dense
    # weights have no place there.
    state = reference("qwen3_moe")[2]
    cfg = tessera_config("qwen3_moe", moe=MoEConfig(num_experts=6, top_k=2, ffn_dim=24, normalize_topk=True))
    with pytest.raises(RuntimeError, match="feed_forward"):
        GPT(cfg).load_state_dict(state, strict=True)
    model = reference("qwen3_moe_step2")[0]
    hf_sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    ours = GPT(tessera_config("qwen3_moe_step2"))
    assert hf_sparse == [int(i) for i, layer in ours.layers.items() if hasattr(layer.feed_forward, "router")] == [1, 3]


# ---------------------------------------------------------------------- tensor parallelism
def _reassemble(param, group, world):
    grad = param.grad.contiguous()
    if param.tp_shard_dim is None:
        return grad
    parts = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(parts, grad, group=group)
    return torch.cat(parts, dim=param.tp_shard_dim)


def _tp_worker(rank, world, cfg: ModelConfig, state: dict, hf_loss: float):
    mesh = ParallelMesh.build(tp=world)
    group = mesh.group("tp")
    tokens, positions, labels, meta = batch()
    ref = load_tessera(cfg, state).train()
    ref_loss = F.cross_entropy(ref(tokens, positions, meta), labels, ignore_index=-100)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {"ref_vs_hf": abs(ref_loss.item() - hf_loss) / hf_loss}
    for sp in (False, True):
        model = apply_tp(load_tessera(cfg, state).train(), mesh, sequence_parallel=sp)
        loss_sum, count = cross_entropy_sum(model(tokens, positions, meta), labels, tp_group=group)
        (loss_sum / count).backward()
        sync_sequence_parallel_grads(model, mesh)
        out[f"loss sp={sp}"] = abs((loss_sum / count).item() - ref_loss.item()) / ref_loss.item()
        worst = 0.0
        for name, param in model.named_parameters():
            partial = getattr(param, "sequence_parallel_partial", False)
            if name.endswith(("q_norm.weight", "k_norm.weight", "wq.bias", "wk.bias", "wv.bias")):
                assert partial and param.tp_shard_dim is None, name  # whole, gradient summed over tp
                assert zero_shard_dim(param) == 0, name  # so ZeRO-1 can still split it over dp
            full = _reassemble(param, group, world)
            assert tuple(full.shape) == tuple(ref_grads[name].shape), name
            scale = ref_grads[name].abs().max().item()
            worst = max(worst, (full - ref_grads[name]).abs().max().item() / scale)
        out[f"grads sp={sp}"] = worst
    return out


@pytest.mark.slow
def test_tensor_parallel_qwen3_features_match_single_process_and_transformers():
    _, logits, state = reference("qwen3")
    labels = batch()[2]
    hf_loss = F.cross_entropy(logits, labels, ignore_index=-100).item()
    results = run_distributed(_tp_worker, 2, tessera_config("qwen3"), state, hf_loss)
    for r in results:
        print("tp=2 qwen3:", {k: f"{v:.2e}" for k, v in r.items()})
        assert max(r.values()) < GRAD_RTOL, r


# ------------------------------------------------------------------------ the config keys
@pytest.mark.parametrize("sets, words", [
    (["model.rope_scaling.type=\"yarn\"", "model.rope_scaling.factor=4.0"],
     "needs model.rope_scaling.original_max_position_embeddings > 0"),
    (["model.rope_scaling.type=\"llama3\"", "model.rope_scaling.original_max_position_embeddings=8192",
      "model.rope_scaling.factor=0.5"], "factor=0.5 must be >= 1"),
    (["model.rope_scaling.factor=8.0"], "has no effect with model.rope_scaling.type='none'"),
    (["model.rope_scaling.type=\"llama3\"", "model.rope_scaling.original_max_position_embeddings=8192",
      "model.rope_scaling.factor=8.0", "model.rope_scaling.high_freq_factor=1.0"], "must exceed model.rope_scaling.low_freq_factor"),
    (["model.rope_scaling.type=\"linear\"", "model.rope_scaling.factor=2.0", "model.rope_scaling.attention_factor=1.2"],
     "is used by model.rope_scaling.type='yarn' only"),
    (["model.head_dim=15"], "model.head_dim=15 must be even"),
    (["model.head_dim=-2"], "model.head_dim=-2 must be >= 0"),
    (["model.dim=62"], "model.dim=62 must be divisible by model.num_heads=4"),
    (["model.dim=60"], "60 / 4 = 15 must be even"),
    (["model.moe.num_experts=4", "model.moe.dense_layers=[0, 5]"], "must name distinct layers in [0, model.num_layers=2)"),
    (["model.moe.num_experts=4", "model.moe.dense_layers=[0, 1]"], "leaves no MoE layer"),
    (["model.moe.dense_layers=[true]"], "must be a list of whole numbers"),
])
def test_config_refuses_what_the_model_cannot_compute(sets, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate(load_config(None, sets), 1)


def test_head_dim_zero_means_dim_over_heads_and_overrides_divisibility():
    assert ModelConfig(dim=64, num_heads=4).attention_head_dim == 16  # built in code, no validate
    cfg = validate(load_config(None, ["model.dim=60", "model.head_dim=8", "model.moe.num_experts=4",
                                      "model.moe.dense_layers=[1]", "model.num_layers=3"]), 1).model
    model = GPT(cfg)
    assert model.layers["0"].attention.wq.weight.shape == (4 * 8, 60)
    assert model.layers["0"].attention.wo.weight.shape == (60, 4 * 8)
    assert [hasattr(b.feed_forward, "router") for b in model.layers.values()] == [True, False, True]
