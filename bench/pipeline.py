"""Pipeline-parallel bubble through the real trainer: 1F1B against interleaved 1F1B.

For each micro-batch count M the trainer (`python -m core.train.cli`) runs twice on pp = N ranks
(dp = 1) with the same corpus, seed and global batch (M micro-batches per step): once with
`parallel.pp_schedule=1f1b`, once `interleaved` with 2 virtual stages per rank. Over the
steps after the first 3 (warm-up) it takes the medians of the trainer's own per-step metrics:
`pp_idle_mean` (measured idle share, the mean over the pipeline ranks), `pp_bubble_theory`
((p-1)/(v*M+p-1)), `tokens_per_s`, `step_s` (with its spread, as a bench.harness Timing), `mfu`.
It prints one line per run and, per M, interleaved / 1f1b of tokens/s and of the measured idle
share; each run's row is a bench.harness record, printed and appended to OUT/summary.jsonl (the
interleaved rows carry the two ratios). The step times are the trainer's: the two schedules
are whole trainer processes, so they alternate run by run, not step by step.

    python -m bench.pipeline                                  # every visible GPU (>= 2), M = 8,16, 8 steps
    python -m bench.pipeline --gpus 4 --micro 8,16,32 --steps 12 --out runs/pp4
    python -m bench.pipeline --set train.compile=true         # extra trainer settings for every run
    python -m bench.pipeline --smoke                          # 2 CPU processes (gloo), tiny model: it works

GPU model: launch/configs/tiny_dense.toml at dim 2048, 16 layers, 16 heads (4 KV), FFN 5632,
4096-token rows, one row per micro-batch (bf16): Llama-like stages big enough that compute,
not kernel launches or point-to-point latency, sets the step time, as in real training.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.harness import Timing, emit
from core.config import ConfigError, load_config
from core.validation import validate
from dataservice.build import build_dataset, make_corpus

ROOT = Path(__file__).resolve().parent.parent

CONFIG = ROOT / "launch" / "configs" / "tiny_dense.toml"
SCHEDULES = (("1f1b", 1), ("interleaved", 2))  # (parallel.pp_schedule, parallel.pp_virtual_stages)
WARMUP = 3  # steps dropped: allocator growth, first-touch of the data server's rows
GPU_MODEL = ["model.dim=2048", "model.num_layers=16", "model.num_heads=16", "model.num_kv_heads=4",
             "model.ffn_dim=5632", "train.seq_len=4096", "train.micro_batch_size=1", "train.compile=false"]
# 4 layers: pp=2 x 2 virtual stages, one layer each.
SMOKE_MODEL = ["model.dim=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
               "model.ffn_dim=128", "train.seq_len=128", "train.micro_batch_size=1"]
# make_corpus(n_docs, min_len, max_len): many documents per packed row, as in real data.
GPU_DOCS, SMOKE_DOCS = (2000, 200, 20000), (200, 64, 2000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=0,
                        help="pipeline ranks, one per GPU (default: every visible GPU; --smoke: 2 CPU processes)")
    parser.add_argument("--micro", default="8,16", help="micro-batches per step, comma-separated (default 8,16)")
    parser.add_argument("--steps", type=int, default=8,
                        help=f"optimizer steps per run; the first {WARMUP} are warm-up and not timed (default 8)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "pipeline_bench",
                        help="work folder: corpus, run folders, logs, summary.jsonl (default runs/pipeline_bench)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra trainer setting for every run, e.g. train.compile=true (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU processes (gloo): the script works")
    args = parser.parse_args(argv)
    try:
        args.micro = [int(m) for m in args.micro.split(",")]
    except ValueError:
        parser.error(f"--micro takes micro-batch counts like 8 or 8,16, got '{args.micro}'")
    if min(args.micro) < 1 or args.steps < 1:
        parser.error(f"--micro counts and --steps must be >= 1, got --micro {args.micro} --steps {args.steps}")
    if args.smoke:
        args.gpus = args.gpus or 2
    else:
        import torch  # only here: the smoke run and the argument errors above need no CUDA query

        visible = torch.cuda.device_count()
        if args.gpus > visible or (not args.gpus and visible < 2):
            parser.error(f"--gpus {args.gpus or 'all'} but {visible} GPUs are visible (--smoke runs on the CPU)")
        args.gpus = args.gpus or visible
    if args.gpus < 2:
        parser.error(f"--gpus {args.gpus}: a pipeline needs at least 2 ranks")
    args.out = args.out.resolve()
    try:  # a bad --set is the user's, whatever the schedule: say so before the per-run checks
        load_config(CONFIG, [*(SMOKE_MODEL if args.smoke else GPU_MODEL), *args.overrides])
    except ConfigError as err:
        parser.error(f"--set: {err}")
    # Ask the trainer's own config check about every run before the first starts, so an
    # impossible combination stops here, with its message, not after an hour of GPU time.
    for micro in args.micro:
        for schedule, virtual in SCHEDULES:
            try:
                validate(load_config(CONFIG, trainer_settings(args, schedule, virtual, micro)), args.gpus)
            except ConfigError as err:
                parser.error(f"--micro {micro} with the {schedule} schedule on pp={args.gpus}: {err}")
    return args


def trainer_settings(args: argparse.Namespace, schedule: str, virtual: int, micro: int) -> list[str]:
    """The `--set` list of one run; the bench's own keys last, so --set cannot change them."""
    model = SMOKE_MODEL if args.smoke else GPU_MODEL
    rows = load_config(CONFIG, [*model, *args.overrides]).train.micro_batch_size
    return [*model, *args.overrides, f"parallel.pp={args.gpus}", "parallel.tp=1", "parallel.cp=1",
            f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={virtual}",
            f"train.global_batch_size={micro * rows}",  # dp = 1: exactly `micro` micro-batches a step
            f"train.max_steps={args.steps}", "train.log_interval=1", f"train.device={'cpu' if args.smoke else 'cuda'}",
            "train.plot=false", "checkpoint.interval=0", "checkpoint.save_at_end=false"]


def build_corpus(args: argparse.Namespace) -> Path:
    """The shard folder every run reads (built once per work folder): same data for both schedules."""
    n_docs, lo, hi = SMOKE_DOCS if args.smoke else GPU_DOCS
    out = args.out / f"data-n{n_docs}-{lo}-{hi}"
    if not (out / "manifest.json").is_file():
        build_dataset([make_corpus(args.out, n_docs=n_docs, seed=7, min_len=lo, max_len=hi)], out)
    return out


def run(args: argparse.Namespace, data: Path, schedule: str, virtual: int, micro: int) -> dict:
    """One trainer run; returns its summary row (medians over the steps after the warm-up)."""
    name = f"pp{args.gpus}-m{micro}-{schedule}"
    run_dir, log_path = args.out / name, args.out / f"{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to: start clean
    sets = [*trainer_settings(args, schedule, virtual, micro), f"data.dataset={data}", f"train.run_dir={run_dir}"]
    cmd = [sys.executable, "-m", "core.train.cli", "--config", str(CONFIG), "--nproc-per-node", str(args.gpus),
           *(arg for s in sets for arg in ("--set", s))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc:
        lines = log_path.read_text().splitlines()
        rejected = [line for line in lines if "tessera-train: error:" in line]  # the trainer's config check
        print("\n".join(rejected or lines[-30:]), file=sys.stderr)
        print(f"bench.pipeline: {name} failed (exit {rc}); log: {log_path}", file=sys.stderr)
        sys.exit(2 if rejected else 1)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[min(WARMUP, len(records) - 1):]  # with --steps <= 3, the last step alone
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    steps = Timing([1e3 * r["step_s"] for r in timed])
    return {"run": name, "pp": args.gpus, "schedule": schedule, "virtual_stages": virtual, "micro": micro,
            "steps": len(timed), "pp_idle_mean": med("pp_idle_mean"), "pp_bubble_theory": med("pp_bubble_theory"),
            "tokens_per_s": med("tokens_per_s"), "step_s": steps.ms / 1e3,
            "step_s_range": (steps.min_ms / 1e3, steps.max_ms / 1e3),
            "mfu": med("mfu") if timed[0].get("mfu") is not None else None}  # no MFU on the CPU


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = build_corpus(args)
    summary = args.out / "summary.jsonl"
    summary.write_text("")
    where = "CPU processes (gloo)" if args.smoke else "GPUs"
    print(f"pipeline bench: pp={args.gpus} on {args.gpus} {where}, micro-batches {args.micro}, "
          f"{args.steps} steps (first {WARMUP} untimed)", flush=True)
    for micro in args.micro:
        rows = {}
        for schedule, virtual in SCHEDULES:
            row = rows[schedule] = run(args, data, schedule, virtual, micro)
            if schedule != "1f1b":
                base = rows["1f1b"]
                row["tokens_per_s_vs_1f1b"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["idle_vs_1f1b"] = row["pp_idle_mean"] / base["pp_idle_mean"] if base["pp_idle_mean"] > 0 else None
            emit("pipeline", row, device="cpu" if args.smoke else "cuda", argv=argv, path=summary)
            mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            print(f"{row['run']:24s} v={virtual} | idle {row['pp_idle_mean']:.3f} "
                  f"(theory {row['pp_bubble_theory']:.3f}) | {row['tokens_per_s']:10.0f} tok/s "
                  f"| step {row['step_s']:.3f} s | MFU {mfu}", flush=True)
        inter, base = rows["interleaved"], rows["1f1b"]
        idle = "-" if inter["idle_vs_1f1b"] is None else f"{inter['idle_vs_1f1b']:.3f}"
        print(f"M={micro}: interleaved/1f1b tokens/s {inter['tokens_per_s_vs_1f1b']:.3f}, measured idle {idle} "
              f"(theory {inter['pp_bubble_theory'] / base['pp_bubble_theory']:.3f})", flush=True)
    print(f"summary: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
