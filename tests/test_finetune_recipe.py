"""End to end: `launch/finetune_long.sh` on CPU, from a tiny random Hugging Face Llama (built by
transformers, with a trained tiny tokenizer and a chat template) and a JSONL of conversations to
an exported Hugging Face folder, through shards with loss masks, the import, a yarn-extended
fine-tune under dynamic context parallelism (4 processes) with validation, and the export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from core.config import load_config
from core.validation import validate
from core.config import ModelConfig
from dataservice.tokenizer import train_tiny_tokenizer
from tests.support.cli import ROOT
from tests.support.sft import HEADER_TEMPLATE, SPECIALS, conversations

SCRIPT = ROOT / "launch" / "finetune_long.sh"


def tiny_hf_llama(folder: Path, moe: bool = False, deepseek: bool = False) -> Path:
    """A tiny random Llama (or, with `moe`, Qwen3-MoE: 4 experts, top-2, layer 0 dense; with
    `deepseek`, DeepSeek-V3: MLA with a query latent, 8 sigmoid-routed experts, top-2 within the
    best 2 of 4 groups, a shared expert, layer 0 dense) with a trained tiny tokenizer and a chat template."""
    transformers = pytest.importorskip("transformers")
    import torch

    tok = train_tiny_tokenizer(folder, specials=SPECIALS, vocab_size=320)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": HEADER_TEMPLATE}))
    vocab = json.loads(tok.read_text())["model"]["vocab"]
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if deepseek:
        config = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True)
        transformers.DeepseekV3ForCausalLM(config).save_pretrained(folder)
    elif moe:
        config = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
                                             output_router_logits=False)
        transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    else:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).save_pretrained(folder)
    return folder


def _env() -> dict:
    """The script on this interpreter's environment, whose commands are on PATH (nothing installed)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return dict(os.environ, OMP_NUM_THREADS="1", TESSERA_NO_VENV="1", PATH=path)


@pytest.mark.slow
def test_recipe_from_hf_checkpoint_to_exported_long_context_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    tiny_hf_llama(tmp_path / "hf")
    data = conversations(tmp_path / "conversations.jsonl", 240, seed=3)
    out = tmp_path / "out"
    env = _env()
    # Called from the folder that holds the inputs, with relative paths (the recipe: the repository's).
    proc = subprocess.run(["bash", str(SCRIPT), "hf", "conversations.jsonl", "out", "--recipe",
                           "launch/configs/finetune_tiny.toml", "--nproc-per-node", "4", "--val-every", "10"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # Shards rendered by the model's own template, with masks; the held-out split is separate.
    manifest = json.loads((out / "data" / "train" / "manifest.json").read_text())
    assert manifest["chat_template"]["kind"] == "template" and manifest["loss_mask"]["target_tokens"] > 0
    assert json.loads((out / "data" / "val" / "manifest.json").read_text())["counts"]["documents"] == 24
    # The run: the recipe's context (4x the model's 64 positions by yarn), validation falling.
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [4, 8, 12]
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    assert (out / "run" / "loss.png").is_file()
    # The export loads in transformers with every weight, and carries the extended context.
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.rope_scaling["rope_type"] == "yarn" and model.config.rope_scaling["factor"] == 4.0
    assert model.config.max_position_embeddings == 256
    # Bad input: one line, exit 2.
    bad = subprocess.run(["bash", "launch/finetune_long.sh", str(tmp_path), str(data), str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "has no config.json" in bad.stderr, bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("family, hf_class", [("qwen3_moe", "Qwen3MoeForCausalLM"),
                                              ("deepseek_v3", "DeepseekV3ForCausalLM")])
def test_recipe_fine_tunes_an_imported_moe_with_expert_parallelism_under_dynamic_cp(tmp_path, family, hf_class):
    """The recipe (dynamic CP over dp=2 x cp=2, its 4 experts over pairs of the 4 ranks: ep=2) on
    a tiny random Qwen3-MoE, and on a tiny random DeepSeek-V3 (multi-head latent attention split
    by the dynamic plan, group-limited sigmoid routing with its correction bias): the run ends,
    validation falls, every step's MoE loads count every document token (and Qwen3-MoE's records
    its balancing loss and all-to-all time), and the export loads in transformers as its own
    class with every weight."""
    transformers = pytest.importorskip("transformers")
    tiny_hf_llama(tmp_path / "hf", **({"moe": True} if family == "qwen3_moe" else {"deepseek": True}))
    conversations(tmp_path / "conversations.jsonl", 240, seed=3)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "hf", "conversations.jsonl", "out", "--recipe",
                           "launch/configs/finetune_tiny.toml", "--nproc-per-node", "4", "--val-every", "10", "--",
                           "--set", "parallel.ep=2", "--set", "train.hang_timeout_s=300"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    config = tomllib.loads((out / "finetune.toml").read_text())
    assert config["parallel"]["dynamic_cp"] is True
    if family == "qwen3_moe":
        assert config["model"]["moe"]["num_experts"] == 4
    else:
        assert config["model"]["attention"] == "mla"
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    for r in train:  # layer 1 is the MoE layer; every document token routed top-2
        tokens = round(r["tokens_per_s"] * r["step_s"])
        assert sum(r["moe/layer1/tokens_per_expert"]) == 2 * tokens, r
        if family == "qwen3_moe":
            assert r["moe/layer1/aux_loss"] > 0 and 0 < r["moe/all_to_all_s"] < r["step_s"], r
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [4, 8, 12]
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert type(model).__name__ == hf_class
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_relative_paths_are_read_from_where_the_script_is_called(tmp_path):
    # The script works in the repository; HF_DIR here is relative to the caller's folder, which
    # has config.json (and no tokenizer.json: the script stops at that check, before any work).
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "chats.jsonl").write_text("")
    bad = subprocess.run(["bash", str(SCRIPT), "hf", "chats.jsonl", "out"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert f"'{tmp_path / 'hf'}' has no tokenizer.json" in bad.stderr, bad.stderr
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    bad = subprocess.run(["bash", str(SCRIPT), "hf", "chats.jsonl", "out", "--recipe", "launch/configs/nothing.toml"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and f"recipe '{tmp_path / 'launch/configs/nothing.toml'}' is not a file" in bad.stderr
    assert not (tmp_path / "out").exists()  # nothing written before the checks pass


def test_the_8b_recipe_is_a_valid_8_gpu_layout():
    """The 8B recipe merged onto a Llama-3-8B-shaped model passes the trainer's checks on 8 ranks."""
    recipe = tomllib.loads((ROOT / "launch" / "configs" / "llama3_8b_longctx.toml").read_text())
    model = ModelConfig(vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                        rope_theta=500000.0)
    items = [f"model.{k}={v}" for k, v in vars(model).items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    scaling = recipe["model"]["rope_scaling"]
    items += ["model.rope_scaling.type=yarn", f"model.rope_scaling.factor={scaling['factor']}",
              "model.rope_scaling.original_max_position_embeddings=8192", "data.address=127.0.0.1:1",
              "eval.address=127.0.0.1:1"]
    for section, values in recipe.items():
        if section != "model":
            items += [f"{section}.{k}={json.dumps(v)}" for k, v in values.items()]
    config = load_config(None, items)
    validate(config, 8)
    assert (config.parallel.tp, config.parallel.cp, config.parallel.dp) == (2, 4, 1)
    assert config.train.seq_len == 64 * 1024


@pytest.mark.parametrize("name, recipe, nproc", [
    ("8b-1gpu", "llama3_8b_long_1gpu.toml", 1), ("8b-8gpu", "llama3_8b_long_8gpu.toml", 8),
    ("8b-64k", "llama3_8b_longctx.toml", 8)])
def test_named_recipes_are_picked_with_their_gpu_count(name, recipe, nproc, tmp_path):
    """--recipe NAME picks the file and its process count; --dry-run stops before any step;
    --nproc-per-node still wins; both long recipes validate at their world size (tests/test_config.py)."""
    (tmp_path / "hf").mkdir()
    for file in ("config.json", "tokenizer.json"):
        (tmp_path / "hf" / file).write_text("{}")
    (tmp_path / "c.jsonl").write_text("{}\n")
    args = ["bash", str(SCRIPT), "hf", "c.jsonl", "out", "--recipe", name, "--dry-run"]
    done = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"recipe: {ROOT / 'launch' / 'configs' / recipe}" and lines[1] == f"processes: {nproc}", lines
    assert not (tmp_path / "out").exists()  # nothing ran
    done = subprocess.run(args + ["--nproc-per-node", "2", "--", "--set", "train.max_steps=3"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert "processes: 2" in done.stdout and "--set train.max_steps=3" in done.stdout, done.stdout
    bad = subprocess.run(args[:-3] + ["--recipe", "8b-9gpu", "--dry-run"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "8b-9gpu' is not a file" in bad.stderr, bad.stderr
