#!/usr/bin/env bash
# Long-context fine-tuning of a released model, from a Hugging Face folder to a Hugging Face folder:
#   1. split the conversations into train / validation (every K-th record is held out),
#   2. build shards of both with the model's own tokenizer and chat template (loss on the answers only),
#   3. import the checkpoint (tessera-convert from-hf),
#   4. fine-tune at the recipe's longer context: its RoPE scaling, context parallelism with dynamic CP,
#      validation loss (and loss by position) at the recipe's interval,
#   5. export the result (tessera-convert to-hf) next to the run.
#
#   bash launch/finetune_long.sh HF_DIR CONVERSATIONS.jsonl OUT_DIR [--recipe FILE|NAME] [--nproc-per-node N]
#        [--val-every K] [--dry-run] [-- tessera-train arguments, e.g. --set train.max_steps=200]
#
# The recipe (default launch/configs/llama3_8b_longctx.toml) holds every section but [model]; the
# model comes from the import (a recipe's own [model] is only for planning it; its
# [model.rope_scaling] is taken). Named recipes, each with its GPU count as the default
# --nproc-per-node (docs/planner.md says how tessera-plan --longest chose them):
#   8b-64k   launch/configs/llama3_8b_longctx.toml    Llama-3-8B at 64k tokens, 8 GPUs, dynamic CP
#   8b-1gpu  launch/configs/llama3_8b_long_1gpu.toml  Llama-3.1-8B at 768k tokens on one 141 GB GPU, ~1 TB host
#   8b-8gpu  launch/configs/llama3_8b_long_8gpu.toml  Llama-3.1-8B at 2M tokens on 8 GPUs of 80 GB, ~1 TB host
# --dry-run checks the arguments and prints the recipe, the process count and the commands, then stops. A rope_scaling.original_max_position_embeddings of 0 in the recipe
# means "the context the model was trained at" (config.json's max_position_embeddings).
# OUT_DIR gets data/{train,val}, model/ (the import), finetune.toml (the merged config), run/
# (metrics.jsonl, loss.png, checkpoints) and hf/ (the export). A step that fails stops the recipe.
# Relative paths are read from where the script is called; a --recipe that is not found there is
# looked up in the repository (e.g. launch/configs/finetune_tiny.toml from anywhere).
set -euo pipefail
caller=$PWD
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$TESSERA_ROOT"
from_caller() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$caller/$1" ;; esac; }

usage="usage: bash launch/finetune_long.sh HF_DIR CONVERSATIONS.jsonl OUT_DIR [--recipe FILE|8b-64k|8b-1gpu|8b-8gpu] [--nproc-per-node N] [--val-every K] [--dry-run] [-- tessera-train args]"
die() { echo "finetune_long.sh: error: $*" >&2; exit 2; }
[ $# -ge 3 ] || die "$usage"
hf_dir=$(from_caller "$1") conversations=$(from_caller "$2") out=$(from_caller "$3")
shift 3
recipe=$TESSERA_ROOT/launch/configs/llama3_8b_longctx.toml
nproc="" val_every=20 recipe_gpus="" dry_run=""
while [ $# -gt 0 ]; do
  case $1 in
    --recipe) case ${2:?} in
                8b-64k)  recipe=$TESSERA_ROOT/launch/configs/llama3_8b_longctx.toml recipe_gpus=8 ;;
                8b-1gpu) recipe=$TESSERA_ROOT/launch/configs/llama3_8b_long_1gpu.toml recipe_gpus=1 ;;
                8b-8gpu) recipe=$TESSERA_ROOT/launch/configs/llama3_8b_long_8gpu.toml recipe_gpus=8 ;;
                *) recipe=$(from_caller "$2")
                   if [ ! -f "$recipe" ] && [ -f "$TESSERA_ROOT/$2" ]; then recipe=$TESSERA_ROOT/$2; fi ;;
              esac
              shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --nproc-per-node) nproc=${2:?}; shift 2 ;;
    --val-every) val_every=${2:?}; shift 2 ;;
    --) shift; break ;;
    *) die "unknown argument '$1'; $usage" ;;
  esac
done
[ -f "$hf_dir/config.json" ] || die "'$hf_dir' has no config.json; give a Hugging Face model folder"
[ -f "$hf_dir/tokenizer.json" ] || die "'$hf_dir' has no tokenizer.json (the shards are built with the model's fast tokenizer)"
[ -f "$conversations" ] || die "'$conversations' is not a file; give a JSON Lines file of messages or prompt/completion records"
[ -f "$recipe" ] || die "recipe '$recipe' is not a file"
[[ "$val_every" =~ ^[0-9]+$ ]] && [ "$val_every" -ge 2 ] || die "--val-every $val_every must be a whole number >= 2"
[ -z "$nproc" ] || [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node $nproc must be a whole number >= 1"
if [ -z "$nproc" ] && [ -n "$recipe_gpus" ]; then nproc=$recipe_gpus; fi
if [ -z "$nproc" ]; then
  gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
  nproc=$(( gpus > 0 ? gpus : 4 ))
fi
if [ -n "$dry_run" ]; then
  echo "recipe: $recipe"
  echo "processes: $nproc"
  echo "would run: split $conversations (every ${val_every}th record to validation); tessera-data build (train, val);"
  echo "  tessera-convert from-hf $hf_dir $out/model; tessera-train --config $out/finetune.toml --nproc-per-node $nproc $*;"
  echo "  tessera-convert to-hf $out/run $out/hf"
  exit 0
fi
mkdir -p "$out/data"

echo "== 1/5 splitting $conversations: every ${val_every}th record held out for validation"
awk -v k="$val_every" -v train="$out/data/train.jsonl" -v val="$out/data/val.jsonl" \
  'NF { n++; if (n % k == 0) print > val; else print > train }' "$conversations"
[ -s "$out/data/val.jsonl" ] || die "'$conversations' has fewer than $val_every records: nothing left to validate on"

echo "== 2/5 building shards with $hf_dir/tokenizer.json"
for split in train val; do
  tessera-data build "$out/data/$split.jsonl" --tokenizer "$hf_dir/tokenizer.json" --output "$out/data/$split" \
    --overwrite --quiet
done

echo "== 3/5 importing $hf_dir"
tessera-convert from-hf "$hf_dir" "$out/model" --overwrite

echo "== 4/5 fine-tuning on $nproc processes with $recipe"
python - "$out/model/config.toml" "$recipe" "$hf_dir/config.json" "$out" <<'PY'
import json, sys, tomllib
from pathlib import Path

import tomli_w

imported, recipe, hf_config, out = sys.argv[1:]
config = tomllib.loads(Path(imported).read_text())
overlay = tomllib.loads(Path(recipe).read_text())
scaling = overlay.pop("model", {}).get("rope_scaling")
for section, values in overlay.items():  # the recipe's sections replace the import's defaults key by key
    config.setdefault(section, {}).update(values)
if scaling:
    if not scaling.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = json.loads(Path(hf_config).read_text())["max_position_embeddings"]
    config["model"]["rope_scaling"] = scaling
config.setdefault("data", {})["dataset"] = f"{out}/data/train"
config.setdefault("eval", {})["dataset"] = f"{out}/data/val"
config["train"]["run_dir"] = f"{out}/run"
Path(out, "finetune.toml").write_text(tomli_w.dumps(config))
PY
tessera-train --config "$out/finetune.toml" --nproc-per-node "$nproc" "$@"

echo "== 5/5 exporting to $out/hf"
tessera-convert to-hf "$out/run" "$out/hf" --overwrite
python - "$out/run/metrics.jsonl" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in records if "loss" in r]
val = [r for r in records if "val_loss" in r]
print(f"train loss {train[0]['loss']:.4f} (step {train[0]['step']}) -> {train[-1]['loss']:.4f} (step {train[-1]['step']})")
if val:
    print(f"val loss {val[0]['val_loss']:.4f} (step {val[0]['step']}) -> {val[-1]['val_loss']:.4f} (step {val[-1]['step']}); "
          f"by position at the end: {json.dumps({k: round(v, 4) for k, v in val[-1]['val_loss_by_position'].items()})}")
PY
