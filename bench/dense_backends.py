"""Tessera's training step under each dense backend and precision, one after another in one run.

The variants (name: model.dense_backend, train.precision, train.fp8_recipe):

    torch-bf16        torch  bf16
    te-bf16           te     bf16
    torch-fp8         torch  fp8  blockwise  (Tessera's CUTLASS kernels)
    torch-tensorwise  torch  fp8  tensorwise (torchao's Float8Linear, compiled with the block)
    torch-rowwise     torch  fp8  rowwise    (torchao's Float8Linear)
    te-blockwise      te     fp8  blockwise  (TE's Float8BlockScaling)
    te-tensorwise     te     fp8  tensorwise (TE's current scaling)
    te-delayed        te     fp8  delayed    (TE's delayed scaling)

where te runs the norms in TE's fused modules (model.te_norm_fusion); "te-...-linears" (te-bf16-linears,
te-tensorwise-linears, ...) is the same with one te.Linear per projection instead.

each on the model and batch of bench.train_step (the dense ~1B Llama, or --moe the DeepSeek-like
MoE, whose experts stay on Tessera's grouped kernels), built, warmed up and timed over --steps
rounds in a process of its own, one after another: several ~1B trainers do not fit on one GPU
together, and each starts from an empty allocator and fresh Transformer Engine state. The
first variant runs again at the end, so drift over the run shows as the gap between its two
timings. Prints step time, tokens/s, MFU (bf16 peak for all), peak memory and the speed-up over
the first variant; one JSON record.

    python -m bench.dense_backends [--variants torch-bf16,te-bf16,...] [--batch 4] [--accum 4] [--compile]
    python -m bench.dense_backends --dim 128 --layers 2 --seq 64 --steps 2 --warmup 1 --variants torch-bf16,torch-fp8
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.harness import compare, emit
from bench.train_step import build_side, model_config, side_figures, synthetic_batch
from core.precision import te_backend

VARIANTS = {
    "torch-bf16": ("torch", "bf16", "blockwise"),
    "te-bf16": ("te", "bf16", "blockwise"),
    "torch-fp8": ("torch", "fp8", "blockwise"),
    "torch-tensorwise": ("torch", "fp8", "tensorwise"),
    "torch-rowwise": ("torch", "fp8", "rowwise"),
    "te-blockwise": ("te", "fp8", "blockwise"),
    "te-tensorwise": ("te", "fp8", "tensorwise"),
    "te-delayed": ("te", "fp8", "delayed"),
}
VARIANTS.update({f"{name}-linears": how for name, how in VARIANTS.items() if how[0] == "te"})


def measure(name: str, cfg, args) -> dict:
    """One variant's figures (bench.train_step.side_figures), in the calling process."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    batch = synthetic_batch(args.batch, args.seq, cfg.vocab_size, device)
    side_args = copy.copy(args)
    side_args.dense_backend, side_args.precision, side_args.fp8_recipe = VARIANTS[name]
    side_args.no_fp8_weight_cache, side_args.no_wgrad_fusion, side_args.back_to_back = False, False, 1
    side_args.te_norm_fusion = not name.endswith("-linears")
    side = build_side("tessera", cfg, batch, side_args)
    timing = compare({name: side.step}, rounds=args.steps, iters=1, warmup=0)[name]
    return side_figures(side, timing, args.batch * args.seq * args.accum, "tessera", side_args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="default 20 dense, 4 with --moe")
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--cuda-graphs", action="store_true", help="with --compile: train.cuda_graphs")
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--dim", type=int, default=2048, help="smaller for a CPU smoke test")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 1 or args.accum < 1:
        parser.error("--steps, --warmup and --accum must be >= 1")
    if any(VARIANTS[n][0] == "te" for n in names) and te_backend.unavailable_reason():
        parser.error(f"te variants need Transformer Engine: {te_backend.unavailable_reason()}")
    args.layers = args.layers or (4 if args.moe else 20)
    cfg = model_config(args.layers, args.moe, args.dim)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name in [*names, names[0]]:
        key = name if name not in results else f"{name} (again)"
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[key] = pool.submit(measure, name, cfg, args).result()
    first = results[names[0]]["step_ms"]
    for name, r in results.items():
        r["speedup"] = first / r["step_ms"]
        print(f"{name:22s} step {r['step_ms']:8.1f} ms [{r['step_ms_range'][0]:.1f} - {r['step_ms_range'][1]:.1f}]  "
              f"{r['tokens_per_s'] / 1e3:7.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  peak {r['peak_mem_gib']:5.1f} GiB  "
              f"x{r['speedup']:.3f} of {names[0]}")
    emit("dense_backends", {"args": vars(args), "results": results}, device)


if __name__ == "__main__":
    main()
