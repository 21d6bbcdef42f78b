#!/usr/bin/env bash
# What a checkpoint save costs the training step, blocking against asynchronous
# (checkpoint.async_save), on one GPU: the same run of a trainer config twice, a save every
# INTERVAL steps, alternating blocking / async / blocking / async. Reports, per mode, the time the
# step waits for each save (save_blocking_s), the full write (save_s), and the median step time of
# the steps without a save and of the steps right after a save (an async write still runs then). From the repository root:
#   bash bench/checkpoint_save.sh CONFIG [STEPS] [INTERVAL] [-- tessera-train --set arguments]
# e.g. the ~1B model imported by bench/finetune_long.sh:
#   bash bench/checkpoint_save.sh /tmp/ftl/masked/finetune.toml 12 4 -- --set train.seq_len=4096
set -euo pipefail
config=${1:?usage: bash bench/checkpoint_save.sh CONFIG [STEPS] [INTERVAL] [-- --set ...]}
steps=${2:-12} interval=${3:-4}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
W=${TESSERA_BENCH_DIR:-/tmp/ckpt-bench}
rm -rf "$W"; mkdir -p "$W"
for round in 1 2; do
  for mode in false true; do
    run="$W/async-$mode-$round"
    tessera-train --config "$config" --set train.run_dir="$run" --set train.max_steps="$steps" \
      --set checkpoint.interval="$interval" --set checkpoint.keep=1 --set checkpoint.save_at_end=false \
      --set checkpoint.async_save="$mode" --set eval.interval=0 --set train.plot=false "$@" 2>&1 \
      | grep -E "error|Error" || true
  done
done
python - "$W" "$interval" <<'PY'
import json, statistics, sys
from pathlib import Path

work, interval = Path(sys.argv[1]), int(sys.argv[2])
out = {}
for mode in ("false", "true"):
    blocking, full, plain, during = [], [], [], []
    for run in sorted(work.glob(f"async-{mode}-*")):
        records = [json.loads(line) for line in open(run / "metrics.jsonl")]
        for r in records[1:]:  # step 1 carries compilation and warm-up
            if "save_blocking_s" in r:
                blocking.append(r["save_blocking_s"])
            if "save_s" in r:
                full.append(r["save_s"])
            # the step after a save: an async write is still running during it
            (during if mode == "true" and r["step"] % interval == 1 else plain).append(r["step_s"])
    out["async" if mode == "true" else "blocking"] = {
        "save_blocking_s": round(statistics.median(blocking), 3), "save_s": round(statistics.median(full), 3),
        "step_s_without_save": round(statistics.median(plain), 4),
        "step_s_after_a_save": round(statistics.median(during), 4) if during else None,
        "saves": len(blocking)}
b, a = out["blocking"], out["async"]
out["step_cost_of_a_save_blocking_over_async"] = round(b["save_blocking_s"] / a["save_blocking_s"], 2)
print(json.dumps(out, indent=1))
PY
