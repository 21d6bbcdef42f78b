"""One optimizer step at a long sequence (a million tokens by default) on one GPU, next to the
planner's prediction of the same config.

    python -m bench.long_context                                   # ~1B dense model, seq 2^20
    python -m bench.long_context --model llama8b --seq 262144 --optimizer-offload --offload-checkpoints
    python -m bench.long_context --model llama8b --seq 262144 --optimizer-offload --moments-dtype bf16 \
        --offload-checkpoints --offload-layers 8          # a host of 128 GiB
    python -m bench.long_context --smoke --seq 256                 # CPU, a tiny model: the test

The model is bench.train_step's ~1B dense Llama-style model (vocab 32000, d 2048, 20 layers,
16 heads, GQA 4, SwiGLU 5632) or the Llama-3.1-8B shape (vocab 128256, d 4096, 32 layers, 32
heads, GQA 8, SwiGLU 14336). The step is the trainer's own (`core.train.trainer.Trainer` on one
rank: `step` then `record`) on one synthetic row of --seq tokens, one document (the dense cuDNN
attention path), micro-batch 1, bf16, with the long-context switches: train.recompute (default
full), train.fused_loss (default on: no [T, vocab] logits), train.mlp_chunk_tokens (default
16384: no [T, ffn] intermediates), train.offload_checkpoints and train.optimizer_offload (off
unless asked).

Printed per timed step and as one JSON record (bench.harness.emit, and --out FILE): step time,
tokens/s, MFU (6 x (params - input embedding) + 6 x layers x d x seq FLOPs per token against
989 TFLOP/s, BENCHMARKS.md's formula: core.metrics.flops_per_token), the GPU peak
(torch.cuda.max_memory_allocated over the steps, and reserved), host memory (peak RSS and the
pinned bytes torch's host allocator holds), and `tessera-plan`'s estimate of the same config
(core.planner estimate_memory / estimate_time with --calibration, default the shipped table;
bench.planner_check compares the two the same way). --trace-peak records the allocator's trace
of the last step and prints the blocks alive at its peak by size ([T, d] in fp32 or bf16, ...):
what to compare with the planner's parts when a prediction is off.

A step at 2^20 tokens takes minutes: causal attention alone is 6 x layers x d x seq^2 = 2.7e17
FLOPs for the 20-layer 1B model (3.6e17 with full recompute's second forward), ~10 minutes at
600 TFLOP/s. So the default is one step, timed, with no warm-up (the first step's one-off costs,
cuDNN plans and allocator growth, are seconds against that), and `--layers 4` keeps a run at 2^20
near two minutes with the same per-layer work and the same MFU accounting. Memory at 2^20 with
full recompute: each layer keeps its input, T x d bf16 (4 GiB a layer for d 2048):
--offload-checkpoints moves those to pinned host memory, one layer's back ahead of its backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from bench.harness import emit
from bench.train_step import model_config, synthetic_batch
from core.config import Config, ModelConfig
from core.metrics import PEAK_FLOPS
from bench.calibrate import shipped_table
from core.planner.calibration import Calibration, CalibrationError
from core.planner.memory import estimate_memory
from core.planner.timing import estimate_time
from core.train.trainer import Trainer
from core.validation import ConfigError, validate

GIB = 2**30
MODELS = ("dense1b", "llama8b")


def llama8b_config() -> ModelConfig:
    """The Llama-3.1-8B shape (random weights: the step's cost, not its loss, is measured)."""
    return ModelConfig(vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                       rope_theta=500000.0)


def build_config(args) -> Config:
    if args.smoke:  # as bench.planner_check's smoke cases: the same code on the CPU, in seconds
        model = model_config(2, False, dim=64)
    else:
        model = llama8b_config() if args.model == "llama8b" else model_config(20, False)
    if args.layers:
        model.num_layers = args.layers
    config = Config(model=model)
    config.train = dataclasses.replace(
        config.train, device="cpu" if args.smoke else "cuda", seed=0, seq_len=args.seq, precision="bf16",
        micro_batch_size=1, global_batch_size=1, recompute=args.recompute, fused_loss=args.fused_loss,
        mlp_chunk_tokens=args.mlp_chunk_tokens, offload_checkpoints=args.offload_checkpoints,
        offload_checkpoints_layers=args.offload_layers, optimizer_offload=args.optimizer_offload,
        optimizer_moments_dtype=args.moments_dtype, compile=args.compile)
    return validate(config, 1)


def predict(config: Config, cal: Calibration) -> dict:
    memory = estimate_memory(config, rank=0, allocator=cal.allocator)
    timing = estimate_time(config, cal, 8)
    return {"peak_allocated_gib": memory.peak_allocated / GIB, "peak_reserved_gib": memory.peak_reserved / GIB,
            "device_total_gib": memory.device_total / GIB, "host_offload_gib": memory.offloaded / GIB,
            "host_optimizer_gib": memory.state.host / GIB, "step_s": timing.step_s,
            "tokens_per_s": timing.tokens_per_s, "mfu": timing.mfu}


def _pinned_bytes() -> int:
    """Pinned host bytes torch's caching host allocator holds (what pin_memory=True tensors use)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0))


def _report_interrupted(signum=None, frame=None) -> None:
    print(f"cut mid-step: GPU peak so far {torch.cuda.max_memory_allocated() / GIB:.1f} GiB allocated "
          f"({torch.cuda.max_memory_reserved() / GIB:.1f} reserved), host RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB, pinned {_pinned_bytes() / GIB:.1f} GiB",
          flush=True)
    os._exit(124)


def _watchdog(deadline_s: float) -> None:
    """Reports the peaks and ends the process at the deadline: a SIGTERM's Python handler waits for the
    main thread, which may sit in one CUDA call for minutes, so a limit outside would cut the figures."""
    timer = threading.Timer(deadline_s, _report_interrupted)
    timer.daemon = True
    timer.start()


def peak_live_set(snapshot: dict) -> tuple[int, dict[int, int]]:
    """Replays the allocator trace of `torch.cuda.memory._snapshot()`: the largest sum of live
    blocks, and at that moment {block bytes: count}, the tensors' sizes naming what was alive."""
    events = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    live, current, peak, at = {}, 0, -1, 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            current += e["size"]
        else:
            current -= live.pop(e["addr"], 0)
        if current > peak:
            peak, at = current, i
    live = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        else:
            live.pop(e["addr"], None)
    sizes: dict[int, int] = {}
    for size in live.values():
        sizes[size] = sizes.get(size, 0) + 1
    return peak, sizes


def measure(config: Config, warmup: int, steps: int, trace_peak: bool = False) -> dict:
    cuda = config.train.device == "cuda"
    trainer = Trainer(config)
    batch = synthetic_batch(1, config.train.seq_len, config.model.vocab_size, torch.device(config.train.device))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if cuda:  # a step cut by a time limit (timeout's SIGTERM) still reports the GPU peak it reached
        signal.signal(signal.SIGTERM, _report_interrupted)
    records = []
    for i in range(warmup + steps):
        last = i == warmup + steps - 1
        if trace_peak and last and cuda:  # no stacks: Python frames recorded under recompute break autograd
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)
        start = time.perf_counter()
        record = trainer.record(trainer.step([batch]), start)
        phase = "warm-up" if i < warmup else "timed"
        memory = (f", GPU peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB allocated "
                  f"({torch.cuda.max_memory_reserved() / GIB:.1f} reserved)" if cuda else "")
        # printed per step: a step cut short by a time limit still leaves the earlier ones' figures
        print(f"{phase} step {i + 1}: {record['step_s']:.2f} s, loss {record['loss']:.4f}{memory}, host RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB, pinned "
              f"{_pinned_bytes() / GIB:.1f} GiB", flush=True)
        if trace_peak and last and cuda:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak, sizes = peak_live_set(snapshot)
            print(f"traced step: {peak / GIB:.2f} GiB allocated during it at its peak; alive then, by block size: "
                  + ", ".join(f"{n} x {size / 2**20:.1f} MiB" for size, n in sorted(sizes.items(), reverse=True)
                              if size * n >= 2**26), flush=True)
        if i >= warmup:
            records.append(record)
    step_s = min(r["step_s"] for r in records)  # the fastest timed step: one step has no spread to speak of
    tokens = config.train.seq_len
    return {
        "step_s": step_s, "tokens_per_s": tokens / step_s,
        "mfu": trainer.flops_per_token * tokens / step_s / PEAK_FLOPS["bf16"],
        "loss": records[-1]["loss"],
        "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else 0.0,
        "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
        "pinned_gib": _pinned_bytes() / GIB,
        "flops_per_token": trainer.flops_per_token,
    }


def _err(pred: float, got: float) -> str:
    return f"{100 * (pred / got - 1):+.1f}%" if got else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="dense1b")
    parser.add_argument("--layers", type=int, default=0, help="fewer layers than the model's (0: all of them)")
    parser.add_argument("--seq", type=int, default=2**20, help="tokens of the one row (one document)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="full")
    parser.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=True,
                        help="train.fused_loss: the output head and the loss over token chunks")
    parser.add_argument("--mlp-chunk-tokens", type=int, default=16384,
                        help="train.mlp_chunk_tokens (0: the MLP over the whole sequence at once)")
    parser.add_argument("--offload-checkpoints", action="store_true", help="train.offload_checkpoints")
    parser.add_argument("--offload-layers", type=int, default=0,
                        help="train.offload_checkpoints_layers: only the first N blocks' inputs go to the host (0: all)")
    parser.add_argument("--optimizer-offload", action="store_true", help="train.optimizer_offload")
    parser.add_argument("--moments-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="train.optimizer_moments_dtype")
    parser.add_argument("--compile", action="store_true", help="train.compile")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=1, help="timed steps (the fastest is reported)")
    parser.add_argument("--calibration", default=None,
                        help="the planner's table (default: the shipped table of this GPU kind, else the H100 one)")
    parser.add_argument("--out", default=None, help="also write the record's figures as JSON here")
    parser.add_argument("--trace-peak", action="store_true",
                        help="record the allocator's trace of the last step and print what was alive at its peak")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="print the GPU peak so far and exit 124 after this many seconds (0: no limit)")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model (the tests)")
    args = parser.parse_args(argv)
    counts = (args.layers, args.mlp_chunk_tokens, args.offload_layers)
    if args.seq < 2 or args.warmup < 0 or args.steps < 1 or min(counts) < 0:
        print(f"bench.long_context: --seq {args.seq} must be >= 2, --warmup >= 0, --steps >= 1, --layers and "
              "--mlp-chunk-tokens, --offload-layers >= 0", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("bench.long_context: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    try:
        cal = Calibration.load(args.calibration or shipped_table())  # the table of this GPU kind
        config = build_config(args)
    except (CalibrationError, ConfigError) as err:
        print(f"bench.long_context: {err}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.deadline_s > 0:
        _watchdog(args.deadline_s)
    predicted = predict(config, cal)
    t = config.train
    switches = {"train.recompute": t.recompute, "train.fused_loss": t.fused_loss,
                "train.mlp_chunk_tokens": t.mlp_chunk_tokens, "train.offload_checkpoints": t.offload_checkpoints,
                "train.offload_checkpoints_layers": t.offload_checkpoints_layers,
                "train.optimizer_offload": t.optimizer_offload, "train.optimizer_moments_dtype": t.optimizer_moments_dtype,
                "train.compile": t.compile}
    name = "smoke" if args.smoke else args.model
    print(f"{name}, {config.model.num_layers} layers, seq {t.seq_len}: " + ", ".join(f"{k}={v}" for k, v in switches.items()))
    print(f"predicted ({cal.source}): step {predicted['step_s']:.2f} s, {predicted['tokens_per_s']:.0f} tok/s, "
          f"MFU {100 * predicted['mfu']:.1f}%, GPU allocated {predicted['peak_allocated_gib']:.1f} GiB "
          f"(reserved {predicted['peak_reserved_gib']:.1f}, all {predicted['device_total_gib']:.1f}), host "
          f"{predicted['host_offload_gib'] + predicted['host_optimizer_gib']:.1f} GiB", flush=True)
    try:
        measured = measure(config, args.warmup, args.steps, args.trace_peak)
    except torch.cuda.OutOfMemoryError as err:
        print(f"bench.long_context: out of GPU memory ({str(err).splitlines()[0][:160]}); the planner predicted "
              f"{predicted['device_total_gib']:.1f} GiB", file=sys.stderr)
        return 1
    m, p = measured, predicted
    print(f"measured: step {m['step_s']:.2f} s ({_err(p['step_s'], m['step_s'])} predicted), "
          f"{m['tokens_per_s']:.0f} tok/s, MFU {100 * m['mfu']:.1f}%, GPU peak allocated "
          f"{m['gpu_peak_allocated_gib']:.1f} GiB ({_err(p['peak_allocated_gib'], m['gpu_peak_allocated_gib'])} "
          f"predicted), reserved {m['gpu_peak_reserved_gib']:.1f} GiB, host RSS {m['host_rss_gib']:.1f} GiB, "
          f"pinned {m['pinned_gib']:.1f} GiB")
    figures = {"model": name, "layers": config.model.num_layers, "seq": t.seq_len, "config": switches,
               "calibration": cal.source, "predicted": predicted, "measured": measured}
    emit("long_context", figures, t.device)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
