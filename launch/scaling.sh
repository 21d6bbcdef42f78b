#!/usr/bin/env bash
# One node's scaling runs (issue 7), through the real trainer and one data service process
# (the trainer's loopback server) feeding every rank:
#   moe      the DeepSeek-like fine-grained MoE (launch/configs/deepseek_like.toml, 4 layers so
#            that one GPU holds all 64 experts) at ep=N over dp=N, and ep=N/2 (2 copies of each
#            expert) when N >= 4; every GPU runs the same work at every N (2 x 4096 tokens a
#            micro-batch, 8 micro-batches a step), so tokens/s per GPU compare directly;
#   longseq  a 16-layer dense model (dim 2048) on documents longer than the sequence, one row of
#            S = 16384 x N tokens per step at cp=N, and at cp=1 on S/N (weak scaling: the
#            attention term makes per-GPU work grow with S, which MFU counts, so the
#            efficiency is MFU(cp=N on S) / MFU(cp=1 on S/N)).
# Each run's median tokens/s, MFU (active parameters), data wait and (MoE, ep > 1) time in the
# token all-to-alls over the steps after the warm-up are printed as one line, then the
# efficiencies against the 1-GPU runs.
#
#   bash launch/scaling.sh [moe|longseq|all] [--gpus N] [--steps K]     (default: all, every GPU)
#   bash launch/scaling.sh all --smoke     # tiny models on 4 CPU processes (gloo): the script works
# Extra trainer settings: TESSERA_SCALING_SET="train.compile=false ..." (space-separated).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# GPU machines without a package index run it with their own Python: TESSERA_NO_VENV=1.
if [ -z "${TESSERA_NO_VENV:-}" ]; then source "$here/env.sh"; fi
cd "$here/.."
python="${PYTHON:-python3}"
command -v python >/dev/null 2>&1 && python="${PYTHON:-python}"

what=all gpus="" steps=8 smoke=0
while [ $# -gt 0 ]; do
  case "$1" in
    moe|longseq|all) what=$1 ;;
    --gpus) gpus=$2; shift ;;
    --steps) steps=$2; shift ;;
    --smoke) smoke=1 ;;
    *) echo "launch/scaling.sh: unknown argument '$1' (moe|longseq|all, --gpus N, --steps K, --smoke)" >&2; exit 2 ;;
  esac
  shift
done
visible="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$smoke" = 1 ]; then gpus=${gpus:-4}; device=cpu; else gpus=${gpus:-$visible}; device=cuda; fi
if [ "$device" = cuda ] && { [ "$gpus" -lt 1 ] || [ "$gpus" -gt "$visible" ]; }; then
  echo "launch/scaling.sh: --gpus $gpus but $visible GPUs are visible (--smoke runs on the CPU)" >&2; exit 2
fi
work="${TESSERA_SCALING_DIR:-runs/scaling}"
mkdir -p "$work"
summary="$work/summary.jsonl"
: > "$summary"

corpus() {  # corpus NAME N_DOCS MIN_CHARS MAX_CHARS -> shard folder (built once)
  local out="$work/data-$1"
  [ -f "$out/manifest.json" ] || "$python" - "$work" "$1" "$2" "$3" "$4" <<'PY'
import sys
from pathlib import Path
from dataservice.build import build_dataset, make_corpus
work, name, n, lo, hi = Path(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:])
print("built", build_dataset([make_corpus(work, n_docs=n, seed=7, min_len=lo, max_len=hi)], work / f"data-{name}"))
PY
  echo "$out"
}

run() {  # run NAME NPROC CONFIG DATA SETTINGS...
  local name=$1 nproc=$2 config=$3 data=$4; shift 4
  local sets=() s
  for s in "$@" ${TESSERA_SCALING_SET:-}; do sets+=(--set "$s"); done
  echo "== $name on $nproc $([ $device = cuda ] && echo GPUs || echo CPU processes)"
  rm -rf "$work/$name"
  "$python" -m core.cli --config "$config" --nproc-per-node "$nproc" --set data.dataset="$data" \
    --set train.run_dir="$work/$name" --set train.device=$device --set train.max_steps="$steps" \
    --set train.plot=false --set checkpoint.interval=0 --set checkpoint.save_at_end=false "${sets[@]}" \
    > "$work/$name.log" 2>&1 || { tail -n 30 "$work/$name.log"; echo "launch/scaling.sh: $name failed" >&2; exit 1; }
  "$python" - "$work/$name/metrics.jsonl" "$name" "$nproc" "$summary" <<'PY'
import json, statistics, sys
path, name, nproc, summary = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
records = [json.loads(line) for line in open(path)]
timed = records[min(3, len(records) - 1):]  # past compilation and the server's first rows
med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
row = {"run": name, "gpus": nproc, "steps": len(timed), "tokens_per_s": med("tokens_per_s"),
       "tokens_per_s_per_gpu": med("tokens_per_s") / nproc, "step_s": med("step_s"),
       "data_wait_s": med("data_wait_s"), "mfu": med("mfu") if timed[0].get("mfu") is not None else None,
       "max_mean_load": med("moe/max_mean_load") if "moe/max_mean_load" in timed[0] else None,
       "all_to_all_s": med("moe/all_to_all_s") if "moe/all_to_all_s" in timed[0] else None}
open(summary, "a").write(json.dumps(row) + "\n")
mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
print(f"{name:22s} {nproc} x | {row['tokens_per_s']:10.0f} tok/s ({row['tokens_per_s_per_gpu']:9.0f} per GPU) | "
      f"step {row['step_s']:.3f} s | data wait {1e3 * row['data_wait_s']:.2f} ms | MFU {mfu}"
      + ("" if row["all_to_all_s"] is None else
         f" | all-to-all {1e3 * row['all_to_all_s']:.1f} ms ({100 * row['all_to_all_s'] / row['step_s']:.1f}%)"))
PY
}

if [ "$smoke" = 1 ]; then
  moe_model=(model.num_layers=4 model.dim=64 model.num_heads=4 model.num_kv_heads=2 model.ffn_dim=128 model.moe.ffn_dim=32
             model.moe.num_experts=8 model.moe.top_k=2 model.moe.n_groups=4 model.moe.topk_groups=2
             model.vocab_size=264 train.seq_len=128 train.micro_batch_size=1)
  micro=1
  dense_model=(model.dim=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.ffn_dim=128)
  moe_docs=(moe 300 64 2000) long_docs=(long 40 3000 6000) per_gpu_seq=256 accum=2
else
  moe_model=(model.num_layers=4 train.seq_len=4096 train.micro_batch_size=2 train.compile=true)
  micro=2
  dense_model=(model.dim=2048 model.num_layers=16 model.num_heads=16 model.num_kv_heads=4 model.ffn_dim=5632
               train.recompute=full train.compile=true)
  moe_docs=(moe 4000 200 60000) long_docs=(long 120 300000 330000) per_gpu_seq=16384 accum=8
fi

if [ "$what" != longseq ]; then
  data="$(corpus "${moe_docs[@]}" | tail -n 1)"
  ep_list=("$gpus")
  [ "$gpus" -ge 4 ] && ep_list+=($(( gpus / 2 )))
  for ep in "${ep_list[@]}"; do
    run "moe-ep$ep-dp$gpus" "$gpus" launch/configs/deepseek_like.toml "$data" "${moe_model[@]}" \
      parallel.ep="$ep" train.global_batch_size=$(( gpus * accum * micro ))
  done
  if [ "$gpus" -gt 1 ]; then
    run "moe-ep1-dp1" 1 launch/configs/deepseek_like.toml "$data" "${moe_model[@]}" parallel.ep=1 \
      train.global_batch_size=$(( accum * micro ))
  fi
fi

if [ "$what" != moe ]; then
  data="$(corpus "${long_docs[@]}" | tail -n 1)"
  seq=$(( per_gpu_seq * gpus ))
  run "longseq-cp$gpus-seq$seq" "$gpus" launch/configs/tiny_dense.toml "$data" "${dense_model[@]}" \
    parallel.cp="$gpus" train.seq_len="$seq" train.micro_batch_size=1 train.global_batch_size=1
  if [ "$gpus" -gt 1 ]; then
    run "longseq-cp1-seq$per_gpu_seq" 1 launch/configs/tiny_dense.toml "$data" "${dense_model[@]}" \
      parallel.cp=1 train.seq_len="$per_gpu_seq" train.micro_batch_size=1 train.global_batch_size=1
  fi
fi

"$python" - "$summary" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
one = {r["run"].split("-")[0]: r for r in rows if r["gpus"] == 1}
for r in rows:
    kind = r["run"].split("-")[0]
    base = one.get(kind)
    if base is None or r is base:
        continue
    if kind == "moe":  # the same work per GPU: tokens/s per GPU compare directly
        eff, how = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], "tokens/s per GPU"
    elif r["mfu"] and base["mfu"]:  # attention work per token grows with S: compare FLOP rates
        eff, how = r["mfu"] / base["mfu"], f"MFU {100 * r['mfu']:.1f}% vs {100 * base['mfu']:.1f}%"
    else:
        print(f"{r['run']}: no MFU on the CPU, no weak-scaling efficiency")
        continue
    print(f"{r['run']}: scaling efficiency against {base['run']} {eff:.3f} ({how})")
print(f"summary: {sys.argv[1]}")
PY
