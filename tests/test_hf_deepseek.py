"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: V3/V3.1, Kimi K2, Moonlight) through `tessera-convert`.

Reference: transformers' own DeepseekV3ForCausalLM (eager attention, fp32, CPU), tiny and random,
with every feature the conversion has to get right live at once: multi-head latent attention
with and without the compressed query (q_lora_rank 16 / null), DeepSeek's interleaved rotary rows
(rope_interleave true, permuted on import) and the halves layout (false), yarn with mscale and
mscale_all_dim, sigmoid routing limited to the best 2 of 4 groups with a NON-ZERO correction
bias, routed_scaling_factor 2.5, one shared expert, a dense first layer. Weights are re-drawn
large (std 0.3, routers 0.6, norm gains 1 + 0.3 N(0, 1), bias 0.1 N(0, 1)) so that every detail
moves the logits and no routing score is near a tie.

- from-hf, then `checkpoint.init_from`'s loader into `core.train.model.GPT`: the logits of three
  packed documents (160 tokens) equal transformers' (each document alone) within 1e-4 (logits
  up to ~10; measured ~2e-5: fp32, only summation orders differ), the loss within 1e-5 relative,
  and every MoE layer chose exactly the same experts for every token.
- negative controls: the bias zeroed, the rotary rows left interleaved, the group limit dropped:
  each misses the logits by far more than the tolerance.
- FP8 releases: a checkpoint quantised here (float8_e4m3fn weights, fp32 `weight_scale_inv` per
  16x16 block, partial blocks at the edges) imports bitwise equal to the import of its
  dequantised reference (weight * scale computed block by block below).
- MTP layers: a checkpoint with DeepSeek's layer `num_hidden_layers` (enorm, hnorm, eh_proj,
  shared_head, the embedding copy, a decoder layer) imports; without `model.mtp_layers` they are
  left out with a line in the log, with it they round-trip bitwise.
- to-hf of models that were not imported: MLA -> DeepseekV3ForCausalLM, grouped-query attention
  with DeepSeek's routing -> Glm4MoeForCausalLM, transformers' logits equal Tessera's (atol 1e-4);
  softmax routing with shared experts (launch/configs/tiny_moe.toml) is refused in one line.

The training-side proofs (step-1 loss at 1 process and at tp/cp/pp/ep = 2, three steps then
to-hf, the bitwise HF round trip) are the DeepSeek cases of tests/test_hf_interop.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from core.config import ModelConfig, load_config  # noqa: E402
from core.layers import AttentionMeta  # noqa: E402
from core.mesh import ParallelMesh  # noqa: E402
from core.state.checkpoint import save_checkpoint  # noqa: E402
from core.state.pretrained import load_weights  # noqa: E402
from core.train.model import build_model  # noqa: E402
from core.validation import validate  # noqa: E402
from interop.convert import from_hf, to_hf  # noqa: E402
from interop.families import Unsupported, export_family, tensor_map  # noqa: E402
from moe.router import TopKRouter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOGITS_ATOL, LOSS_RTOL = 1e-4, 1e-5
LENGTHS = (40, 70, 50)
VOCAB = 96
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}


def _hf_config(q_lora_rank, interleave: bool, **extra):
    return transformers.DeepseekV3Config(**{**dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=interleave,
        rope_parameters=YARN), **extra})


CASES = {"v3": dict(q_lora_rank=16, interleave=True), "moonlight": dict(q_lora_rank=None, interleave=False),
         # top-2 of 2 of 4 groups: a group scores its best 2 experts, not top_k // topk_group = 1 of them
         "top2": dict(q_lora_rank=16, interleave=True, num_experts_per_tok=2)}


def hf_model(name: str):
    config = _hf_config(**CASES[name])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif pname.endswith("gate.weight"):
                p.copy_(0.6 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


_cache: dict[str, tuple] = {}


def imported(name: str, root: Path):
    """(transformers model, its logits and expert choices on the batch, the from-hf folder)."""
    if name not in _cache:
        model = hf_model(name)
        model.save_pretrained(root / f"hf-{name}")
        from_hf(root / f"hf-{name}", root / f"ts-{name}")
        logits, chosen = hf_forward(model)
        _cache[name] = model, logits, chosen, root / f"ts-{name}"
    return _cache[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepseek")


def batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    labels = torch.roll(tokens, -1).clone()
    labels[torch.tensor(LENGTHS).cumsum(0) - 1] = -100
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, positions, labels, AttentionMeta(cu_seqlens=cu, max_seqlen=max(LENGTHS), doc_lengths=LENGTHS)


def _collect(modules, pick):
    """Forward hooks that append pick(output) of each module to its own list."""
    seen: list[list[torch.Tensor]] = [[] for _ in modules]
    hooks = [m.register_forward_hook(lambda _m, _i, out, i=i: seen[i].append(pick(out))) for i, m in enumerate(modules)]
    return seen, hooks


@torch.no_grad()
def hf_forward(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of each document alone, concatenated, and each MoE layer's expert choices [T, k] (sorted)."""
    routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    seen, hooks = _collect(routers, lambda out: out[2])
    logits = torch.cat([model(input_ids=doc[None]).logits[0] for doc in batch()[0].split(list(LENGTHS))])
    for h in hooks:
        h.remove()
    return logits, [torch.cat(s).sort(-1).values for s in seen]


@torch.no_grad()
def tessera_forward(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tokens, positions, _, meta = batch()
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    seen, hooks = _collect(routers, lambda out: out.indices)
    logits = model.eval()(tokens, positions, meta)
    for h in hooks:
        h.remove()
    return logits, [s[0].sort(-1).values for s in seen]


def load_tessera(folder: Path, **changes):
    cfg = load_config(folder / "config.toml").model
    cfg = dataclasses.replace(cfg, **changes)
    model = build_model(cfg, seed=0)
    load_weights(folder, model, None, ParallelMesh.build())
    return model


def _loss(logits):
    return F.cross_entropy(logits, batch()[2], ignore_index=-100).item()


# ------------------------------------------------------------------------------ the forward
@pytest.mark.parametrize("name", list(CASES))
def test_logits_loss_and_routing_equal_transformers(root, name):
    _, ref, ref_chosen, ts = imported(name, root)
    assert ref.abs().max() > 5 and _loss(ref) > 1 + torch.log(torch.tensor(float(VOCAB))).item()
    model = load_tessera(ts)
    assert model.layers["1"].feed_forward.router.expert_bias.abs().min() > 0  # the bias was read
    logits, chosen = tessera_forward(model)
    err, loss_err = (logits - ref).abs().max().item(), abs(_loss(logits) - _loss(ref)) / _loss(ref)
    print(f"{name}: max |logit diff| {err:.2e}, loss rel diff {loss_err:.2e}")
    assert err < LOGITS_ATOL and loss_err < LOSS_RTOL
    assert len(chosen) == len(ref_chosen) == 2
    for ours, theirs in zip(chosen, ref_chosen):
        assert torch.equal(ours, theirs)


def _unpermute_rope(model, folder: Path):
    """Tessera's weights with the query and rotary-key rows put back in DeepSeek's pair order."""
    cfg = load_config(folder / "config.toml").model
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    links = [link for link in tensor_map("deepseek_v3", shapes, cfg, {"rope_interleave": True}) if link.interleaved]
    assert len(links) == 2 * cfg.num_layers
    params = dict(model.named_parameters())
    with torch.no_grad():
        for link in links:
            params[link.name].copy_(link.to_hf(params[link.name]))


def _drop_bias(model, _folder):
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.expert_bias.zero_()


NEGATIVE = {  # what is turned off: (case, change to the config, change to the loaded model)
    "correction bias zeroed": ("v3", {}, _drop_bias),
    "rotary rows left interleaved": ("v3", {}, _unpermute_rope),
    "group limit dropped": ("moonlight", {"n_groups": 1, "topk_groups": 1}, None),
    "groups scored by top_k // topk_groups experts": ("top2", {"group_score_experts": 0}, None),
}


@pytest.mark.parametrize("what", list(NEGATIVE))
def test_negative_controls_miss(root, what):
    name, moe_changes, edit = NEGATIVE[what]
    _, ref, ref_chosen, ts = imported(name, root)
    cfg = load_config(ts / "config.toml").model
    model = load_tessera(ts, moe=dataclasses.replace(cfg.moe, **moe_changes))
    if edit is not None:
        edit(model, ts)
    logits, chosen = tessera_forward(model)
    err = (logits - ref).abs().max().item()
    print(f"{what}: max |logit diff| {err:.2e}")
    assert err > 100 * LOGITS_ATOL
    if what != "rotary rows left interleaved":
        assert any(not torch.equal(a, b) for a, b in zip(chosen, ref_chosen))


# ------------------------------------------------------------------------------------- FP8
def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


def _quantise(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and fp32 scale_inv per block x block (the last blocks partial)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = q[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] = tile * scale[i, j]
    return out


def test_fp8_checkpoint_imports_dequantised(root, tmp_path):
    hf = root / "hf-v3"
    imported("v3", root)
    plain = _tensors(hf)
    quantised, reference, block = {}, {}, 16
    for key, value in plain.items():
        # DeepSeek's files: the decoder's linear weights in FP8, the router, norms, embedding and head not.
        if key.startswith("model.layers.") and value.dim() == 2 and not key.endswith("mlp.gate.weight"):
            q, scale = _quantise(value, block)
            quantised[key], quantised[key + "_scale_inv"] = q, scale
            reference[key] = _dequantise(q, scale, block)
        else:
            quantised[key] = reference[key] = value
    assert any(r.shape[0] % block for r in reference.values() if r.dim() == 2)  # partial blocks are used
    config = json.loads((hf / "config.json").read_text())
    for folder, weights, quant in ((tmp_path / "fp8", quantised, True), (tmp_path / "ref", reference, False)):
        folder.mkdir()
        save_file(weights, str(folder / "model.safetensors"))
        extra = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [block, block]}} if quant else {}
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        from_hf(folder, tmp_path / f"ts-{folder.name}")
    ours, want = _tensors(tmp_path / "ts-fp8"), _tensors(tmp_path / "ts-ref")
    assert sorted(ours) == sorted(want)
    for key in want:
        assert ours[key].dtype == want[key].dtype == torch.float32 and torch.equal(ours[key], want[key]), key
    moved = max((reference[k] - plain[k]).abs().max().item() for k in reference if k.endswith("q_b_proj.weight"))
    assert moved > 1e-4  # the quantisation is real: the dequantised weights are not the originals
    # The exported config.json of an FP8 import describes the weights it writes: no quantization_config.
    back = to_hf(tmp_path / "ts-fp8", tmp_path / "back")
    assert "quantization_config" not in json.loads((back / "config.json").read_text())


def test_fp8_weight_without_its_scales_is_refused(root, tmp_path, capsys):
    from interop.cli import main

    imported("v3", root)
    weights = _tensors(root / "hf-v3")
    key = "model.layers.1.self_attn.kv_b_proj.weight"
    weights[key] = weights[key].to(torch.float8_e4m3fn)
    (tmp_path / "hf").mkdir()
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    config = json.loads((root / "hf-v3" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{key}' has no '{key}_scale_inv'" in err[0], err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- MTP
def _with_mtp_layer(root: Path, target: Path) -> dict[str, torch.Tensor]:
    """The v3 checkpoint plus DeepSeek's MTP layer 3 (= num_hidden_layers): its own tensors, a
    decoder layer's (layer 2's, re-drawn), and the copies of the embedding and head."""
    imported("v3", root)
    weights = _tensors(root / "hf-v3")
    g = torch.Generator().manual_seed(11)
    mtp = {k.replace("model.layers.2.", "model.layers.3."): torch.randn(v.shape, generator=g).to(v.dtype)
           for k, v in weights.items() if k.startswith("model.layers.2.")}
    dim = weights["model.embed_tokens.weight"].shape[1]
    mtp.update({"model.layers.3.enorm.weight": torch.rand(dim, generator=g) + 0.5,
                "model.layers.3.hnorm.weight": torch.rand(dim, generator=g) + 0.5,
                "model.layers.3.eh_proj.weight": torch.randn(dim, 2 * dim, generator=g),
                "model.layers.3.shared_head.norm.weight": torch.rand(dim, generator=g) + 0.5,
                "model.layers.3.embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
                "model.layers.3.shared_head.head.weight": weights["lm_head.weight"].clone()})
    weights.update(mtp)
    target.mkdir()
    save_file(weights, str(target / "model.safetensors"))
    config = json.loads((root / "hf-v3" / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return weights


@pytest.mark.skipif(any(f.name == "mtp_layers" for f in dataclasses.fields(ModelConfig)),
                    reason="this Tessera has MTP modules: the round trip below covers them")
def test_mtp_layers_are_left_out_with_a_line_without_mtp_modules(root, tmp_path):
    _with_mtp_layer(root, tmp_path / "hf")
    lines: list[str] = []
    from_hf(tmp_path / "hf", tmp_path / "ts", log=lines.append)
    assert any("left out 1 multi-token prediction layer" in line for line in lines), lines
    assert not any(k.startswith("mtp.") or k.startswith("layers.3.") for k in _tensors(tmp_path / "ts"))


@pytest.mark.skipif(not any(f.name == "mtp_layers" for f in dataclasses.fields(ModelConfig)),
                    reason="needs Tessera's MTP modules (model.mtp_layers)")
def test_mtp_layers_round_trip_bitwise(root, tmp_path):
    before = _with_mtp_layer(root, tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ts")
    assert load_config(tmp_path / "ts" / "config.toml").model.mtp_layers == 1
    assert any(k.startswith("mtp.0.block.") for k in _tensors(tmp_path / "ts"))
    after = _tensors(to_hf(tmp_path / "ts", tmp_path / "back"))
    assert sorted(before) == sorted(after)
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key


# ------------------------------------------------------------ models that were not imported
SMALL = ["model.vocab_size=96", "model.dim=32", "model.num_heads=4", "model.ffn_dim=48", "model.num_layers=3",
         "model.moe.num_experts=8", "model.moe.top_k=4", "model.moe.ffn_dim=16", "model.moe.router=\"sigmoid\"",
         "model.moe.n_groups=4", "model.moe.topk_groups=2", "model.moe.num_shared_experts=1",
         "model.moe.first_k_dense=1", "model.moe.routed_scaling_factor=2.0", "model.moe.bias_update_rate=0.001"]
FRESH = {
    "mla-as-deepseek_v3": ("DeepseekV3ForCausalLM", [
        "model.attention=\"mla\"", "model.num_kv_heads=4", "model.q_lora_rank=16", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=12", "model.rope_scaling.type=\"yarn\"",
        "model.rope_scaling.factor=4.0", "model.rope_scaling.original_max_position_embeddings=16",
        "model.rope_scaling.mscale=0.707", "model.rope_scaling.mscale_all_dim=1.0"]),
    "gqa-as-glm4_moe": ("Glm4MoeForCausalLM", ["model.num_kv_heads=2", "model.qk_norm=true"]),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", list(FRESH))
def test_a_run_without_import_exports_as_deepseek_or_glm4_moe(tmp_path, name):
    arch, sets = FRESH[name]
    config = load_config(None, SMALL + sets)
    validate(config, 1)
    model = build_model(config.model, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("router.weight"):  # sigmoid scores away from 1.0, where they would tie
                param.copy_(0.3 * torch.randn(param.shape, generator=g))
            else:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=g) if param.dim() == 1 else param * 12)
        for m in model.modules():
            if isinstance(m, TopKRouter):  # as bias balancing leaves it: not zero
                m.expert_bias.copy_(0.1 * torch.randn(m.expert_bias.shape, generator=g))
    save_checkpoint(tmp_path / "ckpt", 1, model, None, None, ParallelMesh.build(), {"model": config.to_dict()["model"]})
    to_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                 attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf).__name__ == arch
    tokens = torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, 64], dtype=torch.int32), max_seqlen=64, doc_lengths=(64,))
    with torch.no_grad():
        ours = model.eval()(tokens, torch.arange(64), meta)
        theirs = hf.eval()(input_ids=tokens[None]).logits[0]
    assert ours.abs().max() > 3.0
    torch.testing.assert_close(theirs, ours, atol=LOGITS_ATOL, rtol=1e-5)


def test_which_hugging_face_family_each_moe_config_exports_as():
    deepseek_like = load_config(ROOT / "launch/configs/deepseek_like.toml").model  # GQA or MLA: both export
    assert export_family(deepseek_like) == ("deepseek_v3" if deepseek_like.attention == "mla" else "glm4_moe")
    gqa = load_config(None, SMALL + FRESH["gqa-as-glm4_moe"][1]).model
    assert export_family(gqa) == "glm4_moe"
    with pytest.raises(Unsupported, match="softmax routing with shared experts"):
        export_family(load_config(ROOT / "launch/configs/tiny_moe.toml").model)
    mla = load_config(None, SMALL + FRESH["mla-as-deepseek_v3"][1] + ["model.moe.router=\"softmax\""]).model
    with pytest.raises(Unsupported, match="DeepseekV3ForCausalLM cannot represent this model: softmax routing"):
        export_family(mla)
