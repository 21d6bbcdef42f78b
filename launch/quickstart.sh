#!/usr/bin/env bash
# The README's main job, end to end on one machine:
#   1. build LMDB shards from a real corpus (this Python's own standard library sources),
#   2. train the tiny dense model with tensor x data parallelism (tp=2, dp=2) on 4 local
#      processes (CPU/gloo, or the GPUs/NCCL when there are some), fed by a data service on
#      loopback that the trainer starts and stops itself,
#   3. write metrics, a checkpoint and loss.png to runs/quickstart, and clean up the corpus.
# Extra arguments go to tessera-train, e.g.: bash launch/quickstart.sh --set train.max_steps=100
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$TESSERA_ROOT"

work="$(mktemp -d "${TMPDIR:-/tmp}/tessera-quickstart.XXXXXX")"
trap 'rm -rf "$work"' EXIT
stdlib="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"

echo "== 1/3 building shards from $stdlib (**/*.py)"
tessera-data build "$stdlib" --glob '**/*.py' --output "$work/stdlib-shards"
tessera-data inspect "$work/stdlib-shards"

gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
nproc=4
[ "$gpus" -ge 2 ] && nproc=$(( gpus >= 4 ? 4 : 2 ))
echo "== 2/3 training on $nproc processes ($([ "$gpus" -ge 2 ] && echo "GPUs, NCCL" || echo "CPU, gloo")): tp=2, dp=$(( nproc / 2 ))"
rm -rf runs/quickstart
tessera-train --config launch/configs/tiny_dense.toml --nproc-per-node "$nproc" \
  --set parallel.tp=2 \
  --set data.dataset="$work/stdlib-shards" \
  --set train.run_dir=runs/quickstart \
  --set checkpoint.interval=10 \
  "$@"

echo "== 3/3 results in runs/quickstart"
python - <<'PY'
import json
records = [json.loads(line) for line in open("runs/quickstart/metrics.jsonl")]
first, last = records[0], records[-1]
print(f"loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']})")
PY
ls runs/quickstart runs/quickstart/checkpoints
