#!/usr/bin/env bash
# launch/finetune_long.sh on this machine's GPU with a ~1B Llama-shaped model (Llama 3.2 1B's
# layers, random weights built by transformers, trained at 8k positions, no download) extended to
# 32k with yarn x4, on synthetic long conversations (bench/sft_data.py): shards with loss masks,
# import, fine-tune at seq 32768 with validation, export. Then the same run on the same shards with
# the loss masks dropped (every token a target), to price the masks. From the repository root:
#   bash bench/finetune_long.sh [STEPS]
# Machines without a package index: TESSERA_NO_VENV=1 with the tessera-* commands on PATH.
set -euo pipefail
steps=${1:-16}
W=${TESSERA_BENCH_DIR:-/tmp/ftl}
rm -rf "$W"; mkdir -p "$W"

python -m bench.sft_data "$W/src" --conversations 600
python - "$W" <<'PY'
import shutil, sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from bench.convert import LLAMA_1B

work = Path(sys.argv[1])
vocab = Tokenizer.from_file(str(work / "src/tokenizer/tokenizer.json")).get_vocab_size()
shape = {k: v for k, v in LLAMA_1B.items() if k not in ("vocab_size", "rope_parameters", "max_position_embeddings")}
config = transformers.LlamaConfig(num_hidden_layers=16, vocab_size=vocab, max_position_embeddings=8192,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                  bos_token_id=1, eos_token_id=6, pad_token_id=0, **shape)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(work / "hf")
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(work / "src/tokenizer" / name, work / "hf" / name)
print(f"hf model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters, vocab {vocab}")
PY

cat > "$W/recipe.toml" <<EOF
[model.rope_scaling]
type = "yarn"
factor = 4.0
original_max_position_embeddings = 0

[parallel]
tp = 1
cp = 1

[train]
seq_len = 32768
micro_batch_size = 1
global_batch_size = 2
max_steps = $steps
lr = 1e-4
min_lr = 1e-5
warmup_steps = 4
weight_decay = 0.0
grad_clip = 1.0
precision = "bf16"
recompute_modules = ["mlp"]
compile = true
log_interval = 1
plot = false

[eval]
interval = $(( steps / 4 ))
steps = 2

[checkpoint]
interval = 0
keep = 1
EOF

bash launch/finetune_long.sh "$W/hf" "$W/src/conversations.jsonl" "$W/masked" --recipe "$W/recipe.toml" \
  --nproc-per-node 1 --val-every 20 2>&1 | grep -v -i warning | grep -E "^==|step +[0-9]|val|loss|error|Error" | tail -40

# The same conversations built without loss masks: tokens, documents and packing unchanged, every
# token a target.
tessera-data build "$W/masked/data/train.jsonl" --tokenizer "$W/hf/tokenizer.json" --output "$W/unmasked" \
  --no-loss-mask --quiet
tessera-train --config "$W/masked/finetune.toml" --set data.dataset="$W/unmasked" --set train.run_dir="$W/unmasked-run" \
  --set checkpoint.save_at_end=false 2>&1 | grep -v -i warning | grep -E "step +[0-9]|error|Error" | tail -5

python - "$W" <<'PY'
import json, statistics, sys
from pathlib import Path

work = Path(sys.argv[1])


def summary(run):
    records = [json.loads(line) for line in open(work / run / "metrics.jsonl")]
    train = [r for r in records if "loss" in r]
    warm = train[len(train) // 4:]  # past compilation and warm-up
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in warm),
            "mfu": statistics.median(r["mfu"] for r in warm),
            "step_s": statistics.median(r["step_s"] for r in warm),
            "mem_gb": max(r["mem_gb"] for r in train),
            "loss": [round(train[0]["loss"], 4), round(train[-1]["loss"], 4)],
            "val_loss": [round(r["val_loss"], 4) for r in records if "val_loss" in r],
            "val_by_position": next((r["val_loss_by_position"] for r in reversed(records) if "val_loss" in r), None)}


masked, unmasked = summary("masked/run"), summary("unmasked-run")
print(json.dumps({"masked": masked, "unmasked": unmasked,
                  "masked_over_unmasked_tokens_per_s": round(masked["tokens_per_s"] / unmasked["tokens_per_s"], 4)},
                 indent=1))
PY
