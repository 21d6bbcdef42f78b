"""End to end: `launch/finetune_long.sh` on CPU, from a tiny random Hugging Face Llama (built by
transformers, with a trained tiny tokenizer and a chat template) and a JSONL of conversations to
an exported Hugging Face folder, through shards with loss masks, the import, a yarn-extended
fine-tune under dynamic context parallelism (4 processes) with validation, and the export.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from core.config import load_config, validate
from core.config import ModelConfig
from dataservice.tokenizer import train_tiny_tokenizer
from tests.support.cli import ROOT
from tests.support.sft import HEADER_TEMPLATE, SPECIALS, conversations


def tiny_hf_llama(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    import torch

    tok = train_tiny_tokenizer(folder, specials=SPECIALS, vocab_size=320)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": HEADER_TEMPLATE}))
    vocab = json.loads(tok.read_text())["model"]["vocab"]
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_recipe_from_hf_checkpoint_to_exported_long_context_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = tiny_hf_llama(tmp_path / "hf")
    data = conversations(tmp_path / "conversations.jsonl", 240, seed=3)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", TESSERA_VENV=os.environ.get("TESSERA_VENV", str(ROOT / ".venv")))
    proc = subprocess.run(["bash", "launch/finetune_long.sh", str(hf), str(data), str(out), "--recipe",
                           "launch/configs/finetune_tiny.toml", "--nproc-per-node", "4", "--val-every", "10"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
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
