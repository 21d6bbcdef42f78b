"""Tile order of our CUTLASS kernels: raster (along M or N) x swizzle (1, 2, 4, 8), each timed
against the PyTorch baseline of the same operands in the same run, on one GPU.

    python -m bench.kernel_raster [--shapes mixtral,fine64,fine128] [--families bf16,fp8,dense] [--graph]

Neighbouring CTAs of a persistent kernel share operand tiles in L2 when the scheduler walks
the output in swizzled strips; which order is best depends on the shape. This picks the
defaults (core/kernels: TESSERA_GG_RASTER / TESSERA_GG_SWIZZLE override them at run time).
Each kernel runs its default configuration. The baseline and the eight orders are timed in
--rounds interleaved rounds (bench.gemm_common.time_gemms); a ratio is the median of same-round
ratios. Prints one line per case, then one record (JSON line).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from bench.gemm_common import DEFAULT_SHAPES, SHAPES, gemm_stats, routed_offsets, time_gemms
from bench.harness import emit
from core.kernels import fp8, library
from core.kernels.grouped_gemm import OP_FWD, OP_FWD_BT, OP_WGRAD, RASTER_ENV, SWIZZLE_ENV, choose_config, run_grouped

ORDERS = [(r, s) for r in (0, 1) for s in (1, 2, 4, 8)]


def _with_order(ours, raster: int, swizzle: int):
    def run():
        os.environ[RASTER_ENV], os.environ[SWIZZLE_ENV] = str(raster), str(swizzle)
        try:
            ours()
        finally:
            os.environ.pop(RASTER_ENV), os.environ.pop(SWIZZLE_ENV)
    return run


def sweep(name: str, baseline, ours, flops: float, rounds: int, graph: bool) -> dict:
    fns = {"torch": baseline, **{f"r{r}s{s}": _with_order(ours, r, s) for r, s in ORDERS}}
    times = time_gemms(fns, rounds, graph)
    row = {"case": name, "rounds": rounds, "torch_tflops": flops / times["torch"].ms / 1e9, "orders": {}}
    for key in fns:
        if key != "torch":
            row["orders"][key] = gemm_stats(times["torch"], times[key], flops)
    best = max(row["orders"].items(), key=lambda kv: kv[1]["ratio"])
    print(f"{name:22s} torch {row['torch_tflops']:6.0f} | "
          + " ".join(f"{k} {v['ratio']:.3f}" for k, v in row["orders"].items())
          + f" | best {best[0]} x{best[1]['ratio']:.3f}", flush=True)
    return row


def bf16_cases(shape, lib, device, rounds: int, graph: bool) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    t, d, h, e = shape.routed, shape.dim, shape.hidden, shape.experts
    x = torch.randn(t, d, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(e, d, h, generator=gen, device=device) * d**-0.5).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=gen, device=device).to(torch.bfloat16)
    offsets = routed_offsets(shape, "random", device)
    rows = []
    for name, baseline, op, a, b, out_shape in (
        ("fwd", lambda: torch._grouped_mm(x, w, offs=offsets), OP_FWD, x, w, (t, h)),
        ("dgrad", lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offsets), OP_FWD_BT, dy, w, (t, d)),
        ("wgrad", lambda: torch._grouped_mm(x.t(), dy, offs=offsets), OP_WGRAD, x, dy, (e, d, h)),
    ):
        config = choose_config(lib, op, a.shape[0], e, a.shape[1], out_shape[-1])
        out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
        rows.append(sweep(f"bf16 {shape.name} {name}", baseline,
                          lambda op=op, a=a, b=b, out=out, c=config: run_grouped(lib, op, a, b, out, offsets, c),
                          2.0 * t * d * h, rounds, graph))
    return rows


def fp8_grouped_cases(shape, device, rounds: int, graph: bool) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    t, d, h, e = shape.routed, shape.dim, shape.hidden, shape.experts
    offsets = routed_offsets(shape, "random", device)
    w = (torch.randn(e, d, h, generator=gen, device=device) * d**-0.5).to(torch.bfloat16)
    rows = []
    for name, a_dim, weight_t in (("fwd", d, True), ("dgrad", h, False)):
        a = torch.randn(t, a_dim, generator=gen, device=device).to(torch.bfloat16)
        qa, sa = fp8.quantize_1x128(a, offsets)
        qw, sw = fp8.quantize_128x128(w, transpose=weight_t)
        qa_r, sa_r = fp8.quantize_rowwise(a)
        b_rows = (w.transpose(1, 2) if weight_t else w).contiguous()
        amax = b_rows.float().abs().amax(-1)
        sb_r = amax / torch.full_like(amax, fp8.E4M3_MAX)
        qb_r = (b_rows.float() / sb_r[..., None]).clamp(-448, 448).to(fp8.FP8)
        baseline = lambda qa_r=qa_r, sa_r=sa_r, qb_r=qb_r, sb_r=sb_r: torch._scaled_grouped_mm(  # noqa: E731
            qa_r, qb_r.transpose(1, 2), sa_r.reshape(-1), sb_r, offs=offsets, out_dtype=torch.bfloat16,
            use_fast_accum=True)
        rows.append(sweep(f"fp8 {shape.name} {name}", baseline,
                          lambda qa=qa, sa=sa, qw=qw, sw=sw: fp8.grouped_mm_blockwise(qa, sa, qw, sw, offsets),
                          2.0 * t * a_dim * qw.shape[1], rounds, graph))
    return rows


def fp8_dense_cases(device, rounds: int, graph: bool) -> list[dict]:
    rows = []
    for m, n, k in [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (8192, 4096, 4096)]:
        gen = torch.Generator(device=device).manual_seed(1)
        a = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
        b = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
        qa, sa = fp8.quantize_1x128(a)
        qb, sb = fp8.quantize_128x128(b)
        qa_r, sa_r = fp8.quantize_rowwise(a)
        qb_r, sb_r = fp8.quantize_rowwise(b)
        baseline = lambda qa_r=qa_r, sa_r=sa_r, qb_r=qb_r, sb_r=sb_r: torch._scaled_mm(  # noqa: E731
            qa_r, qb_r.t(), sa_r, sb_r.t(), out_dtype=torch.bfloat16, use_fast_accum=True)
        rows.append(sweep(f"fp8 dense {m}x{n}x{k}", baseline,
                          lambda qa=qa, sa=sa, qb=qb, sb=sb: fp8.gemm_blockwise(qa, sa, qb, sb), 2.0 * m * n * k,
                          rounds, graph))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--families", default="bf16,fp8,dense")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per case")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host gaps, no L2 flush)")
    args = parser.parse_args()
    if args.rounds < 1:
        print("bench.kernel_raster: --rounds must be at least 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.kernel_raster: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    lib = library.kernel_library(device)
    if lib is None:
        print("bench.kernel_raster: the kernel library is not loaded (bash csrc/build.sh)", file=sys.stderr)
        return 2
    families = args.families.split(",")
    rows = []
    for shape in (SHAPES[n] for n in args.shapes.split(",")):
        if "bf16" in families:
            rows += bf16_cases(shape, lib, device, args.rounds, args.graph)
        if "fp8" in families:
            rows += fp8_grouped_cases(shape, device, args.rounds, args.graph)
        torch.cuda.empty_cache()
    if "dense" in families:
        rows += fp8_dense_cases(device, args.rounds, args.graph)
    emit("kernel_raster", {"graph": args.graph, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
