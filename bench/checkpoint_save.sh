#!/usr/bin/env bash
# What a checkpoint save costs the training step, blocking against asynchronous
# (checkpoint.async_save), on one GPU. The same run twice, one per mode, a save every INTERVAL
# steps (the first async save allocates its pinned host buffers, later ones reuse them). Reports
# per mode: the time the step waits for each save (save_blocking_s; for async: staging the state
# into host memory, plus any wait for the previous write, given apart as save_wait_s), the full
# write (save_s), and the median step time of the steps without a save and of the steps right
# after one (an async write still runs then). From the repository root:
#   bash bench/checkpoint_save.sh [CONFIG] [STEPS] [INTERVAL] [-- tessera-train --set arguments]
# Without CONFIG (or with "-"): a ~1B dense model (16 layers, dim 2048, random weights) at seq
# 8192 on shards built from this Python's standard library. Each run's checkpoints are deleted
# once it is read, so the disk holds one run's at a time.
set -euo pipefail
config=${1:--} steps=${2:-12} interval=${3:-6}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
W=${TESSERA_BENCH_DIR:-/tmp/ckpt-bench}
rm -rf "$W"; mkdir -p "$W"
if [ "$config" = "-" ]; then
  stdlib="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
  tessera-data build "$stdlib" --glob '**/*.py' --output "$W/shards" --quiet
  config=launch/configs/tiny_dense.toml
  set -- --set model.dim=2048 --set model.num_layers=16 --set model.num_heads=32 --set model.num_kv_heads=8 \
    --set model.ffn_dim=8192 --set train.seq_len=8192 --set train.micro_batch_size=1 \
    --set train.global_batch_size=1 --set train.lr=1e-4 --set train.min_lr=1e-5 --set data.dataset="$W/shards" "$@"
fi
for mode in false true; do
  run="$W/async-$mode"
  tessera-train --config "$config" --set train.run_dir="$run" --set train.max_steps="$steps" \
    --set checkpoint.interval="$interval" --set checkpoint.keep=1 --set checkpoint.save_at_end=false \
    --set checkpoint.async_save="$mode" --set eval.interval=0 --set train.plot=false "$@" 2>&1 \
    | grep -E "error|Error" || true
  rm -rf "$run/checkpoints"
done
python - "$W" "$interval" <<'PY'
import json, statistics, sys
from pathlib import Path

work, interval = Path(sys.argv[1]), int(sys.argv[2])
out = {}
for mode in ("false", "true"):
    records = [json.loads(line) for line in open(work / f"async-{mode}" / "metrics.jsonl")]
    train = [r for r in records if "step_s" in r]
    saves = [r for r in train if "save_blocking_s" in r]
    plain = [r["step_s"] for r in train[1:] if "save_blocking_s" not in r and r["step"] % interval != 1]
    after = [r["step_s"] for r in train if r["step"] % interval == 1 and r["step"] > 1]
    out["async" if mode == "true" else "blocking"] = {
        "save_blocking_s": [round(r["save_blocking_s"], 3) for r in saves],
        "save_wait_s": [round(r.get("save_wait_s", 0.0), 3) for r in saves],
        "save_s": [round(r["save_s"], 3) for r in records if "save_s" in r],
        "step_s_without_save": round(statistics.median(plain), 4),
        "step_s_after_a_save": round(statistics.median(after), 4) if after else None}
b, a = out["blocking"], out["async"]
steady = a["save_blocking_s"][-1] - a["save_wait_s"][-1]  # reused pinned buffers, no previous write waited for
out["async_staging_s_first_and_steady"] = [a["save_blocking_s"][0], round(steady, 3)]
out["blocking_save_over_async_staging"] = round(statistics.median(b["save_blocking_s"]) / max(steady, 1e-3), 1)
print(json.dumps(out, indent=1))
PY
