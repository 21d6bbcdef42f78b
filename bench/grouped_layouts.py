"""Grouped GEMM kernels on the plain and the aligned (M-grouped contiguous) layout, one GPU.

    python -m bench.grouped_layouts [--shapes deepseek,fine64,fine128,mixtral] [--rounds 3] [--te]

For each MoE shape (tokens per GPU x top_k routed rows, skewed routing) and each expert GEMM
(up: dim -> 2 x ffn, the fused gate/up; down: ffn -> dim) it times forward (x @ w[e]), dgrad
(dy @ w[e]^T) and wgrad (x_e^T dy_e, bf16 out; and wgrad_main: added into an fp32 main grad) of:
  torch          torch._grouped_mm on the plain layout (the baseline of every ratio)
  cutlass        Tessera's CUTLASS kernels (csrc/), when the library is built
  triton         core.kernels.grouped_triton on the aligned layout (operands already aligned)
  triton_layout  the same plus what the layout costs per call: building it from the counts and
                 zeroing the input's padding rows (the permute writes the rows themselves)
  dense          torch.mm of the same total FLOPs (context)
  te, te_fp8     Transformer Engine's GroupedLinear, bf16 and FP8 (Float8BlockScaling), with --te
                 when installed (its forward, and "fwdbwd": forward + both gradients, against
                 torch's three GEMMs)
TFLOP/s count the real rows only (2 x rows x K x N), so the aligned kernels' padding is in their
time. Routing: token logits N(0, 1) plus a per-expert bias N(0, --skew) (a trained router's uneven
load; printed as max/mean), top_k of the softmax. Timing: bench.harness interleaved rounds, L2
flushed before each call, ratios the median of same-round ratios (bench.gemm_common). Prints one
JSON line per (shape, GEMM, pass, kernel), then one record of them all.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gemm_common import gemm_stats, time_gemms
from bench.harness import emit
from core.kernels import grouped_mm, grouped_mm_wgrad, library
from core.kernels.fused import accumulate_fp32_
from core.kernels.grouped_gemm import grouped_mm_wgrad_into_
from core.kernels.grouped_triton import ALIGN, aligned_mm, aligned_wgrad, aligned_wgrad_into_, zero_padding_rows_
from moe.aligned import aligned_layout, to_aligned

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 16384


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    dim: int
    ffn: int


def _deepseek() -> Shape:
    cfg = tomllib.loads((ROOT / "launch/configs/deepseek_like.toml").read_text())["model"]
    moe = cfg["moe"]
    return Shape("deepseek", moe["num_experts"], moe["top_k"], cfg["dim"], moe["ffn_dim"])


SHAPES = {
    "deepseek": _deepseek,
    "fine64": lambda: Shape("fine64", 64, 6, 2048, 768),
    "fine128": lambda: Shape("fine128", 128, 8, 2048, 768),
    "mixtral": lambda: Shape("mixtral", 8, 2, 4096, 14336),
}


def skewed_counts(experts: int, top_k: int, tokens: int, skew: float, seed: int = 0) -> torch.Tensor:
    """Rows per expert of top_k routing from softmax(N(0, 1) + bias), bias_e ~ N(0, skew)."""
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(experts, generator=gen) * skew
    logits = torch.randn(tokens, experts, generator=gen) + bias
    ids = logits.softmax(-1).topk(top_k, dim=-1).indices
    return torch.bincount(ids.reshape(-1), minlength=experts)


def _te():
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # not installed, or built for another torch/CUDA
        return None, f"{type(exc).__name__}: {exc}"
    return te, None


def _te_candidates(te, e: int, k: int, n: int, w: torch.Tensor, x, dy, splits: list[int]) -> dict:
    """TE GroupedLinear forward and forward+backward, bf16 and (when the recipe exists) FP8 blockwise."""
    layer = te.GroupedLinear(e, k, n, bias=False, params_dtype=torch.bfloat16, device=x.device)
    with torch.no_grad():
        for g in range(e):
            getattr(layer, f"weight{g}").copy_(w[g].t())
    xg = x.detach().requires_grad_()
    fns = {"te": lambda: layer(x, splits),
           "te@fwdbwd": lambda: layer(xg, splits).backward(dy)}
    try:
        from transformer_engine.common.recipe import Float8BlockScaling
        recipe = Float8BlockScaling()
    except Exception:
        return fns

    def fp8(backward: bool):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(xg if backward else x, splits)
        if backward:
            y.backward(dy)
    fns["te_fp8"] = lambda: fp8(False)
    fns["te_fp8@fwdbwd"] = lambda: fp8(True)
    return fns


def bench_gemm(shape: Shape, proj: str, counts: torch.Tensor, args, lib, te, device) -> list[dict]:
    e = shape.experts
    k, n = (shape.dim, 2 * shape.ffn) if proj == "up" else (shape.ffn, shape.dim)
    rows = int(counts.sum())
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(e, k, n, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
    dy = torch.randn(rows, n, generator=gen, device=device).to(torch.bfloat16)
    counts_dev = counts.to(device)
    offsets = torch.cumsum(counts_dev, 0, dtype=torch.int32)
    layout = aligned_layout(counts_dev, rows, ALIGN)
    xa, dya = to_aligned(x, layout), to_aligned(dy, layout)
    offs_a, te_ids = layout.offsets, layout.tile_expert
    wt = w.transpose(1, 2)
    main = torch.zeros(e, k, n, device=device)
    flops = 2.0 * rows * k * n

    def with_layout(fn, buffer):
        def run():
            lay = aligned_layout(counts_dev, rows, ALIGN)
            zero_padding_rows_(buffer, lay.ends, lay.offsets)
            return fn(lay)
        return run

    passes = {
        "fwd": {"torch": lambda: torch._grouped_mm(x, w, offs=offsets),
                "triton": lambda: aligned_mm(xa, w, offs_a, te_ids),
                "triton_layout": with_layout(lambda lay: aligned_mm(xa, w, lay.offsets, lay.tile_expert), xa),
                "dense": lambda: x @ w[0]},
        "dgrad": {"torch": lambda: torch._grouped_mm(dy, wt, offs=offsets),
                  "triton": lambda: aligned_mm(dya, wt, offs_a, te_ids),
                  "triton_layout": with_layout(lambda lay: aligned_mm(dya, wt, lay.offsets, lay.tile_expert), dya),
                  "dense": lambda: dy @ wt[0]},
        "wgrad": {"torch": lambda: torch._grouped_mm(x.t(), dy, offs=offsets),
                  "triton": lambda: aligned_wgrad(xa, dya, offs_a),
                  "dense": lambda: x.t() @ dy},
        "wgrad_main": {"torch": lambda: accumulate_fp32_(main, torch._grouped_mm(x.t(), dy, offs=offsets), copy=False),
                       "triton": lambda: aligned_wgrad_into_(main, xa, dya, offs_a, True)},
    }
    if lib is not None:
        passes["fwd"]["cutlass"] = lambda: grouped_mm(x, w, offsets)
        passes["dgrad"]["cutlass"] = lambda: grouped_mm(dy, wt, offsets)
        passes["wgrad"]["cutlass"] = lambda: grouped_mm_wgrad(x, dy, offsets)
        passes["wgrad_main"]["cutlass"] = lambda: grouped_mm_wgrad_into_(main, x, dy, offsets, True)
    if te is not None:
        try:
            te_fns = _te_candidates(te, e, k, n, w, x, dy, counts.tolist())
        except Exception as exc:
            print(f"# {shape.name} {proj}: TE GroupedLinear skipped ({type(exc).__name__}: {exc})", flush=True)
            te_fns = {}
        passes["fwd"].update({name: fn for name, fn in te_fns.items() if "@" not in name})
        bwd = {name.split("@")[0]: fn for name, fn in te_fns.items() if "@" in name}
        if bwd:
            def torch_all():
                torch._grouped_mm(x, w, offs=offsets)
                torch._grouped_mm(dy, wt, offs=offsets)
                torch._grouped_mm(x.t(), dy, offs=offsets)
            passes["fwdbwd"] = {"torch": torch_all, **bwd}
    out = []
    for name, fns in passes.items():
        pass_flops = 3 * flops if name == "fwdbwd" else flops
        try:
            times = time_gemms(fns, args.rounds)
        except Exception as exc:  # one failing candidate must not hide the others' figures
            print(f"# {shape.name} {proj} {name}: failed ({type(exc).__name__}: {exc}); timing each alone", flush=True)
            times = {}
            for cand, fn in fns.items():
                try:
                    times.update(time_gemms({"torch": fns["torch"], cand: fn} if cand != "torch" else {cand: fn},
                                            args.rounds))
                except Exception as exc2:
                    out.append({"shape": shape.name, "gemm": proj, "pass": name, "kernel": cand,
                                "error": f"{type(exc2).__name__}: {exc2}"})
                    print(json.dumps(out[-1]), flush=True)
            if "torch" not in times:
                continue
        base = times["torch"]
        for cand, t in times.items():
            stats = gemm_stats(base, t, pass_flops)
            row = {"shape": shape.name, "gemm": proj, "pass": name, "kernel": cand, "experts": e, "top_k": shape.top_k,
                   "rows": rows, "aligned_rows": layout.rows, "k": k, "n": n, "ms": stats["ms"],
                   "tflops": stats["tflops"], "ratio_to_torch": stats["ratio"], "ratio_range": stats["ratio_range"]}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--gemms", default="up,down", help="up (dim -> 2 ffn), down (ffn -> dim)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per GPU (routed rows: x top_k)")
    parser.add_argument("--skew", type=float, default=0.5, help="std of the per-expert logit bias")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--te", action="store_true", help="also Transformer Engine's GroupedLinear (skipped if absent)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    bad_gemms = [g for g in args.gemms.split(",") if g not in ("up", "down")]
    if unknown or bad_gemms or args.rounds < 1 or args.tokens < 1:
        print(f"bench.grouped_layouts: unknown shapes {unknown} (known: {list(SHAPES)}) or gemms {bad_gemms} "
              "(up, down), or --rounds/--tokens below 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.grouped_layouts: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    lib = library.kernel_library(device)
    te, te_reason = _te() if args.te else (None, "not asked (--te)")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUTLASS library "
          f"{library.library_path() if lib else 'not built'}, TE {'yes' if te else te_reason}", flush=True)
    results = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]()
        counts = skewed_counts(shape.experts, shape.top_k, args.tokens, args.skew)
        mean = counts.float().mean().item()
        print(f"# {name}: E={shape.experts} top-{shape.top_k} dim {shape.dim} ffn {shape.ffn}, rows {int(counts.sum())}"
              f", max/mean load {counts.max().item() / mean:.2f}, min {counts.min().item()}", flush=True)
        for proj in args.gemms.split(","):
            results += bench_gemm(shape, proj, counts, args, lib, te, device)
            torch.cuda.empty_cache()
    emit("grouped_layouts", {"tokens": args.tokens, "skew": args.skew, "rounds": args.rounds, "results": results},
         argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
