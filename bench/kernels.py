"""CUTLASS kernels (csrc/) against their PyTorch baselines, measured in the same run on one GPU.

    python -m bench.kernels --check --bench [--configs all] [--shapes mixtral,fine64,fine128]

Each section (check, bf16, fp8) runs in its own process so a crashing kernel cannot take the
others down. --check runs tests/gpu_kernels_check.py first (float64 references, poisoned
outputs, CUDA graphs). --bench times, on Mixtral-like and fine-grained MoE shapes with uniform random
routing (seeded; --routing balanced for equal groups):
- bf16 grouped GEMM, forward (x @ w[e]), dgrad (dy @ w[e]^T) and wgrad (x_e^T dy_e), each
  CUTLASS configuration (--configs all) or the default choice, against torch._grouped_mm
  on the same tensors, plus the equal-FLOP dense torch.mm for context;
- with --fp8 (when built): see bench/kernels_fp8.py.
Timing: bench.harness, --rounds interleaved rounds (each round starting one further along the
list), CUDA events, the L2 flushed before each call (--graph: CUDA-graph replays instead, no
host gaps, no flush). A ratio is the median over rounds of the same-round ratios, so clock and
thermal drift between measurements (torch's baselines moved by up to 10% between calls) hit
both sides alike. Prints a table, then one record (JSON line).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import kernels_fp8
from bench.gemm_common import DEFAULT_SHAPES, SHAPES, MoEShape, gemm_stats, routed_offsets, time_gemms
from bench.harness import emit
from core.kernels import library
from core.kernels.fused import accumulate_fp32_
from core.kernels.grouped_gemm import (OP_FWD, OP_FWD_BT, OP_FWD_BT_T, OP_WGRAD, choose_config, run_grouped,
                                      run_wgrad_f32)

ROOT = Path(__file__).resolve().parents[1]
RESULT_TAG = "@@results "


def bench_grouped_bf16(shape: MoEShape, routing: str, configs: str, lib, device, rounds: int,
                       graph: bool = False) -> list[dict]:
    """Rows of results for forward, dgrad and wgrad of one MoE shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    t, d, h, e = shape.routed, shape.dim, shape.hidden, shape.experts
    x = torch.randn(t, d, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(e, d, h, generator=gen, device=device) * d**-0.5).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=gen, device=device).to(torch.bfloat16)
    offsets = routed_offsets(shape, routing, device)
    flops = 2.0 * t * d * h
    names = lib.gg_bf16_config_names() if lib else []
    passes = {
        # pass: (torch baseline, (op, a, b, out shape), dense equal-FLOP mm)
        "fwd": (lambda: torch._grouped_mm(x, w, offs=offsets), (OP_FWD, x, w, (t, h)), lambda: x @ w[0]),
        "dgrad": (lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offsets), (OP_FWD_BT, dy, w, (t, d)),
                  lambda: dy @ w[0].t()),
        # The same product with the weight's rows as the tiles' M and the tokens as their N.
        "dgrad_t": (lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offsets), (OP_FWD_BT_T, dy, w, (t, d)),
                    lambda: dy @ w[0].t()),
        "wgrad": (lambda: torch._grouped_mm(x.t(), dy, offs=offsets), (OP_WGRAD, x, dy, (e, d, h)),
                  lambda: x.t() @ dy),
    }
    rows = []
    for name, (baseline, (op, a, b, out_shape), dense) in passes.items():
        default = choose_config(lib, op, a.shape[0], e, a.shape[1], out_shape[-1]) if lib is not None else None
        chosen = ([i for i, n in enumerate(names) if n is not None] if configs == "all" else [default]) if lib else []
        fns = {"torch": baseline, "dense": dense}
        for c in chosen:
            def ours(c=c):
                run_grouped(lib, op, a, b, torch.empty(out_shape, dtype=torch.bfloat16, device=device), offsets, c)
            fns[names[c]] = ours
        times = time_gemms(fns, rounds, graph)
        base = times["torch"]
        row = {"shape": shape.name, "pass": name, "routing": routing, "rounds": rounds, "torch_ms": base.ms,
               "torch_ms_rounds": base.rounds_ms, "torch_tflops": flops / base.ms / 1e9,
               "dense_tflops": flops / times["dense"].ms / 1e9, "configs": {}}
        for c in chosen:
            row["configs"][names[c]] = {**gemm_stats(base, times[names[c]], flops), "default": c == default}
        rows.append(row)
        best = max(row["configs"].items(), key=lambda kv: kv[1]["ratio"], default=(None, None))
        print(f"{shape.name:8s} {name:6s} torch {row['torch_tflops']:6.0f} TFLOP/s (dense {row['dense_tflops']:4.0f})"
              + "".join(f" | {n} {r['tflops']:5.0f} x{r['ratio']:.3f}{'*' if r['default'] else ''}"
                        f"[{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}]"
                        for n, r in row["configs"].items())
              + (f" | best {best[0]}" if best[0] else ""), flush=True)
    if lib is not None:
        rows.append(bench_wgrad_into_main_grad(x, dy, offsets, e, lib, rounds, shape.name, flops, graph))
    return rows


def bench_wgrad_into_main_grad(x, dy, offsets, experts: int, lib, rounds: int, shape_name: str, flops: float,
                               graph: bool = False) -> dict:
    """The experts' weight gradient as training consumes it: added into an fp32 main grad.
    Baseline: torch._grouped_mm in bf16, then the trainer's fp32 accumulation pass; ours
    unfused: our bf16 wgrad and the same pass; ours fused: the wgrad GEMM's epilogue adds to the
    main grad (gradient_accumulation_fusion)."""
    main_grad = torch.zeros(experts, x.shape[1], dy.shape[1], device=x.device)
    dw = torch.empty(experts, x.shape[1], dy.shape[1], dtype=torch.bfloat16, device=x.device)
    fns = {
        "torch": lambda: accumulate_fp32_(main_grad, torch._grouped_mm(x.t(), dy, offs=offsets), copy=False),
        "ours_unfused": lambda: accumulate_fp32_(main_grad, run_grouped(lib, OP_WGRAD, x, dy, dw, offsets), copy=False),
        "ours_fused": lambda: run_wgrad_f32(lib, x, dy, main_grad, offsets, accumulate=True),
    }
    times = time_gemms(fns, rounds, graph)
    row = {"shape": shape_name, "pass": "wgrad_into_main_grad", "rounds": rounds,
           "torch_ms": times["torch"].ms, "torch_ms_rounds": times["torch"].rounds_ms,
           "configs": {n: gemm_stats(times["torch"], times[n], flops) for n in ("ours_unfused", "ours_fused")}}
    print(f"{shape_name:8s} wgrad+fp32 main grad: torch+pass {row['torch_ms']:.3f} ms"
          + "".join(f" | {n} {r['ms']:.3f} ms x{r['ratio']:.3f}[{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}]"
                    for n, r in row["configs"].items()), flush=True)
    return row


def run_section(section: str, args) -> tuple[int, list[dict]]:
    """One section in this process: 'check', 'bf16' or 'fp8'."""
    device = torch.device("cuda", torch.cuda.current_device())
    if section == "check":
        from tests import gpu_kernels_check  # CUDA-only checks, loaded only for this section

        return gpu_kernels_check.main([]), []
    lib = library.kernel_library(device)
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"library {library.library_path() if lib else 'NOT LOADED (torch only)'}, routing {args.routing}", flush=True)
    shapes = [SHAPES[n] for n in args.shapes.split(",")]
    if section == "fp8":
        return 0, kernels_fp8.run(shapes, args.routing, lib, device, args.rounds, args.graph)
    results = []
    for shape in shapes:
        results += bench_grouped_bf16(shape, args.routing, args.configs, lib, device, args.rounds, args.graph)
        torch.cuda.empty_cache()
    return 0, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="run tests/gpu_kernels_check.py first")
    parser.add_argument("--bench", action="store_true", help="time kernels against torch baselines")
    parser.add_argument("--configs", choices=["all", "default"], default="all")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--routing", choices=["random", "balanced"], default="random")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per comparison")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host gaps, no L2 flush)")
    parser.add_argument("--fp8", action="store_true", help="also the FP8 kernels (bench/kernels_fp8.py)")
    parser.add_argument("--section", choices=["check", "bf16", "fp8"], help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=180, help="seconds per section (a hung kernel costs no more)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        print(f"bench.kernels: unknown shapes {unknown}; known: {list(SHAPES)}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("bench.kernels: --rounds must be at least 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.section:  # child process: run one section, hand results back on a tagged line
        status, results = run_section(args.section, args)
        print(RESULT_TAG + json.dumps({"status": status, "results": results}), flush=True)
        return status
    # Each section runs in its own process, so a crashed kernel (a poisoned CUDA context)
    # costs only its section, not the rest of the run.
    sections = (["check"] if args.check else []) + (["bf16"] + (["fp8"] if args.fp8 else []) if args.bench else [])
    passthrough = ["--configs", args.configs, "--shapes", args.shapes, "--routing", args.routing,
                   "--rounds", str(args.rounds)] + (["--graph"] if args.graph else [])
    report = {"graph": args.graph, "sections": {}}
    results, status = [], 0
    for section in sections:
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.kernels", "--section", section, *passthrough],
                                  stdout=subprocess.PIPE, text=True, timeout=args.timeout, cwd=ROOT)
            out, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, code = exc.stdout or "", "timeout"
            out = out if isinstance(out, str) else out.decode(errors="replace")
        tagged = [line for line in out.splitlines() if line.startswith(RESULT_TAG)]
        print("\n".join(line for line in out.splitlines() if not line.startswith(RESULT_TAG)), flush=True)
        if tagged:
            part = json.loads(tagged[-1][len(RESULT_TAG):])
            results += part["results"]
        report["sections"][section] = code
        status = status or (code if isinstance(code, int) else 1)
    report["results"] = results
    emit("kernels", report, argv=argv)
    return status


if __name__ == "__main__":
    sys.exit(main())
