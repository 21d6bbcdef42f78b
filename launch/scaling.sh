#!/usr/bin/env bash
# One node's scaling runs, through the real trainer and one data service process
# (the trainer's loopback server) feeding every rank, at each GPU count N asked for and at 1:
#   moe      the DeepSeek-like fine-grained MoE (launch/configs/deepseek_like.toml, 4 layers so
#            that one GPU holds all 64 experts) at ep=N over dp=N, and ep=N/2 (2 copies of each
#            expert) when N >= 4; every GPU runs the same work at every N (2 x 4096 tokens a
#            micro-batch, 8 micro-batches a step), so tokens/s per GPU compare directly;
#   longseq  a 16-layer dense model (dim 2048) on documents longer than the sequence, one row of
#            S = 16384 x N tokens per step at cp=N (weak scaling: the attention term makes
#            per-GPU work grow with S, which MFU counts, so the efficiency is an MFU ratio).
# Each run's median tokens/s, MFU (active parameters), data wait and (MoE, ep > 1) time in the
# token all-to-alls over the steps after the warm-up are printed as one line, then each run's
# efficiency against the 1-GPU run and the same layout at the next smaller N.
#
#   bash launch/scaling.sh [moe|longseq|all] [--gpus 4,8] [--steps K]   (default: all, every GPU)
#   bash launch/scaling.sh all --smoke     # tiny models on 4 CPU processes (gloo): the script works
# Extra trainer settings: TESSERA_SCALING_SET="train.compile=false ..." (space-separated).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
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
    *) echo "launch/scaling.sh: unknown argument '$1' (moe|longseq|all, --gpus N[,N...], --steps K, --smoke)" >&2; exit 2 ;;
  esac
  shift
done
visible="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$smoke" = 1 ]; then gpus=${gpus:-4}; device=cpu; else gpus=${gpus:-$visible}; device=cuda; fi
if ! [[ "$gpus" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "launch/scaling.sh: --gpus takes GPU counts like 8 or 4,8, got '$gpus'" >&2; exit 2
fi
counts=($(printf '1\n%s\n' ${gpus//,/ } | sort -n -u))  # always the 1-GPU baseline, smallest first
for n in "${counts[@]}"; do
  if [ "$n" -lt 1 ] || { [ "$device" = cuda ] && [ "$n" -gt "$visible" ]; }; then
    echo "launch/scaling.sh: --gpus $gpus but $visible GPUs are visible (--smoke runs on the CPU)" >&2; exit 2
  fi
done
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
  "$python" -m core.train.cli --config "$config" --nproc-per-node "$nproc" --set data.dataset="$data" \
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

for n in "${counts[@]}"; do
  if [ "$what" != longseq ]; then
    data="$(corpus "${moe_docs[@]}" | tail -n 1)"
    ep_list=("$n")
    [ "$n" -ge 4 ] && ep_list+=($(( n / 2 )))
    for ep in "${ep_list[@]}"; do
      run "moe-ep$ep-dp$n" "$n" launch/configs/deepseek_like.toml "$data" "${moe_model[@]}" \
        parallel.ep="$ep" train.global_batch_size=$(( n * accum * micro ))
    done
  fi
  if [ "$what" != moe ]; then
    data="$(corpus "${long_docs[@]}" | tail -n 1)"
    seq=$(( per_gpu_seq * n ))
    run "longseq-cp$n-seq$seq" "$n" launch/configs/tiny_dense.toml "$data" "${dense_model[@]}" \
      parallel.cp="$n" train.seq_len="$seq" train.micro_batch_size=1 train.global_batch_size=1
  fi
done

"$python" - "$summary" <<'PY'
import json, re, sys
rows = [json.loads(line) for line in open(sys.argv[1])]


def layout(r):  # (kind, GPUs per expert copy): runs of one layout at different N compare
    kind = r["run"].split("-")[0]
    ep = re.match(r"moe-ep(\d+)-", r["run"])
    return kind, r["gpus"] // int(ep.group(1)) if ep else 1


def efficiency(r, base):
    if layout(r)[0] == "moe":  # the same work per GPU: tokens/s per GPU compare directly
        return r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], "tokens/s per GPU"
    if r["mfu"] and base["mfu"]:  # attention work per token grows with S: compare FLOP rates
        return r["mfu"] / base["mfu"], f"MFU {100 * r['mfu']:.1f}% vs {100 * base['mfu']:.1f}%"
    return None, "no MFU on the CPU"


for r in rows:
    if r["gpus"] == 1:
        continue
    one = next(b for b in rows if b["gpus"] == 1 and layout(b)[0] == layout(r)[0])
    smaller = [b for b in rows if 1 < b["gpus"] < r["gpus"] and layout(b) == layout(r)]
    for base in [one] + smaller[-1:]:
        eff, how = efficiency(r, base)
        print(f"{r['run']}: scaling efficiency against {base['run']} "
              + (f"{eff:.3f} ({how})" if eff is not None else f"not computed ({how})"))
print(f"summary: {sys.argv[1]}")
PY
