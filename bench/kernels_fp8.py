"""FP8 kernels against torch's FP8 GEMMs, measured in the same run (`python -m bench.kernels --bench --fp8`).

- grouped, per MoE shape (forward and dgrad): our blockwise grouped GEMM (1x128 activations,
  128x128 weights), each built configuration, against torch._scaled_grouped_mm with rowwise
  scales (use_fast_accum True and False), and bf16 torch._grouped_mm for context;
- grouped wgrad (x_e^T dy_e, grouped along the tokens): our K-grouped blockwise GEMM, each
  configuration, against torch._scaled_grouped_mm's K-grouped form (per-expert rowwise scales;
  it needs each expert's tokens in multiples of 16, so its routing is rounded up to that) and
  bf16 torch._grouped_mm; then the whole weight gradient (quantisers + GEMM + the fp32 copy of
  the result) against the per-expert loop of blockwise GEMMs it replaced;
- dense 8192^3 and the MoE layer's equal-FLOP dense shapes: our blockwise GEMM against
  torch._scaled_mm tensorwise and rowwise (fast accumulation), and cuBLAS blockwise through
  torch._scaled_mm when this torch accepts blockwise scales (checked against ours first);
- quantisers: GB/s of our fused kernels against the PyTorch fallback ops (same math).
Operands are quantised once, outside the timed region. Timing: bench.gemm_common.time_gemms
(interleaved rounds, cold L2, or CUDA-graph replays with --graph).
"""

from __future__ import annotations

import torch

from bench.gemm_common import gemm_stats, routed_offsets, time_gemms
from bench.harness import Timing, ratio
from core.precision import blockwise as recipe
from core.kernels import fp8
from core.kernels import fp8_wgrad as kwgrad


def _print(row: dict) -> None:
    ours = " | ".join(f"{n} {r['tflops']:5.0f} x{r['ratio']:.3f}[{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}]"
                      for n, r in row["configs"].items())
    base = " ".join(f"{k} {v:5.0f}" for k, v in row["baselines_tflops"].items())
    print(f"fp8 {row['shape']:10s} {row['pass']:6s} torch[{base}] | {ours}", flush=True)


def _compare(baselines: dict, base_keys: tuple, ours_fn, family: int, lib, flops: float, rounds: int,
             graph: bool, base_scale: dict | None = None) -> dict:
    """Baselines and each built configuration of ours, timed in interleaved rounds (time_gemms).
    A configuration's ratio is the median over rounds of the faster of base_keys in that round over ours.
    base_scale multiplies a baseline's times (one that did more work than ours, counted per unit of ours)."""
    def forced(c):
        def run():
            with fp8.forced_config(c):
                ours_fn()
        return run

    configs = {name: c for c, name in enumerate(lib.config_names(family) if lib else []) if name is not None}
    candidates = {name: forced(c) for name, c in configs.items()}
    if lib is not None:
        candidates["default"] = ours_fn  # the configuration the op picks by itself
    times = time_gemms({**baselines, **candidates}, rounds, graph)
    for key, factor in (base_scale or {}).items():
        times[key] = Timing([t * factor for t in times[key].rounds_ms], times[key].iters)
    base = Timing([min(times[k].rounds_ms[r] for k in base_keys if k in times) for r in range(rounds)])
    ours = {name: gemm_stats(base, times[name], flops) for name in candidates}
    return {"rounds": rounds, "baselines_tflops": {k: flops / times[k].ms / 1e9 for k in baselines},
            "baseline_ms_rounds": {k: times[k].rounds_ms for k in baselines}, "configs": ours}


def bench_grouped(shape, routing: str, lib, device, rounds: int, graph: bool = False) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    t, d, h, e = shape.routed, shape.dim, shape.hidden, shape.experts
    offsets = routed_offsets(shape, routing, device)
    w = (torch.randn(e, d, h, generator=gen, device=device) * d**-0.5).to(torch.bfloat16)
    rows = []
    for name, a_dim, weight_t in (("fwd", d, True), ("dgrad", h, False)):
        a = torch.randn(t, a_dim, generator=gen, device=device).to(torch.bfloat16)
        qa, sa = fp8.quantize_1x128(a, offsets)
        qw, sw = fp8.quantize_128x128(w, transpose=weight_t)  # [E, N, K]
        n = qw.shape[1]
        flops = 2.0 * t * a_dim * n
        # torch rowwise: a per row, b per output column of each expert.
        qa_r, sa_r = fp8.quantize_rowwise(a)
        b_rows = (w.transpose(1, 2) if weight_t else w).contiguous()  # [E, N, K]
        amax = b_rows.float().abs().amax(-1)
        sb_r = amax / torch.full_like(amax, fp8.E4M3_MAX)
        qb_r = (b_rows.float() / sb_r[..., None]).clamp(-448, 448).to(fp8.FP8)
        baselines = {}
        for fast in (True, False):
            baselines[f"rowwise{'_fast' if fast else ''}"] = lambda fast=fast: torch._scaled_grouped_mm(
                qa_r, qb_r.transpose(1, 2), sa_r.reshape(-1), sb_r, offs=offsets, out_dtype=torch.bfloat16,
                use_fast_accum=fast)
        wb = w.transpose(1, 2) if not weight_t else w
        baselines["bf16_grouped"] = lambda: torch._grouped_mm(a, wb, offs=offsets)
        row = {"shape": shape.name, "pass": name, "kind": "fp8_grouped", "routing": routing,
               **_compare(baselines, ("rowwise_fast", "rowwise"),
                          lambda: fp8.grouped_mm_blockwise(qa, sa, qw, sw, offsets), fp8.FAMILY_FP8_GG, lib, flops,
                          rounds, graph)}
        _print(row)
        rows.append(row)
    return rows


def _aligned_offsets(offsets: torch.Tensor, multiple: int) -> torch.Tensor:
    """The same routing with every group's size rounded up to a multiple (more tokens)."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    return (-(-counts // multiple) * multiple).cumsum(0).to(torch.int32)


def bench_grouped_wgrad(shape, routing: str, lib, device, rounds: int, graph: bool = False) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(3)
    t, d, h, e = shape.routed, shape.dim, shape.hidden, shape.experts
    offsets = routed_offsets(shape, routing, device)
    x = torch.randn(t, d, generator=gen, device=device).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=gen, device=device).to(torch.bfloat16)
    flops = 2.0 * t * d * h
    rs, bs = kwgrad.group_blocks(offsets, t)
    blocks = kwgrad.padded_blocks(t, e)
    qx, sx = kwgrad.quantize_grouped_t(x, rs, bs, blocks, True)  # the recipe's order: [E, d, h] out
    qd, sd = kwgrad.quantize_grouped_t(dy, rs, bs, blocks, False)
    baselines = {"bf16_grouped": lambda: torch._grouped_mm(x.t(), dy, offs=offsets)}
    # torch's K-grouped FP8: a = x^T [d, T16] row-major, b = dy [T16, h] column-major, one
    # scale per (expert, row of a) and (expert, column of b). Timing only: unit scales.
    off16 = _aligned_offsets(offsets, 16)
    t16 = int(off16[-1])
    qx16 = torch.zeros(d, t16, dtype=fp8.FP8, device=device)
    qd16 = torch.zeros(h, t16, dtype=fp8.FP8, device=device)
    ones_a, ones_b = torch.ones(e * d, device=device), torch.ones(e * h, device=device)
    for fast in (True, False):
        def scaled(fast=fast):
            return torch._scaled_grouped_mm(qx16, qd16.t(), ones_a, ones_b, offs=off16, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
        try:
            scaled()
            baselines[f"rowwise{'_fast' if fast else ''}_t16"] = scaled
        except (RuntimeError, ValueError) as err:
            print(f"fp8 wgrad: torch._scaled_grouped_mm K-grouped not measured: {str(err).splitlines()[0][:160]}",
                  flush=True)
    fp8_base = tuple(k for k in baselines if k.startswith("rowwise"))
    row = {"shape": shape.name, "pass": "wgrad", "kind": "fp8_grouped_wgrad", "routing": routing,
           **_compare(baselines, fp8_base or ("bf16_grouped",),
                      lambda: kwgrad.grouped_wgrad_blockwise(qx, sx, qd, sd, bs), fp8.FAMILY_FP8_GG, lib, flops,
                      rounds, graph, base_scale={k: t / t16 for k in fp8_base})}  # per routed token
    _print(row)

    def per_expert_loop():  # what expert_wgrad="fp8" ran before the K-grouped kernel
        out = x.new_zeros(e, d, h, dtype=torch.float32)
        start = 0
        for g, end in enumerate(offsets.tolist()):
            if end > start:
                out[g] = recipe.fp8_matmul_wgrad(dy[start:end], x[start:end]).t()
            start = max(start, end)
        return out

    def per_expert_loop_untransposed():  # the same, operands swapped to write [d, h] directly
        out = x.new_zeros(e, d, h, dtype=torch.float32)
        start = 0
        for g, end in enumerate(offsets.tolist()):
            if end > start:
                out[g] = recipe.fp8_matmul_wgrad(x[start:end], dy[start:end])
            start = max(start, end)
        return out

    timed = time_gemms({  # never graphed: the loops read offsets on the host
        "per_expert_loop": per_expert_loop,
        "per_expert_loop_untransposed": per_expert_loop_untransposed,
        "bf16_grouped_fp32_out": lambda: torch._grouped_mm(x.t(), dy, offs=offsets).float(),
        "ours": lambda: recipe.fp8_grouped_wgrad(x, dy, offsets, torch.float32)}, rounds, graph=False)
    whole = {name: t.ms for name, t in timed.items()}
    whole_row = {"shape": shape.name, "pass": "wgrad_whole", "kind": "fp8_grouped_wgrad_whole", "routing": routing,
                 "ms": whole, "ms_range": {name: (t.min_ms, t.max_ms) for name, t in timed.items()},
                 "ours_vs_loop": ratio(timed["per_expert_loop"], timed["ours"])["median"],
                 "ours_vs_bf16": ratio(timed["bf16_grouped_fp32_out"], timed["ours"])["median"]}
    print(f"fp8 {shape.name:10s} wgrad whole (quantise + GEMM + fp32 out), ms and ours' speed-up: "
          + " | ".join(f"{k} {v:.3f} (x{v / whole['ours']:.2f})" for k, v in whole.items()), flush=True)
    return [row, whole_row]


def _torch_blockwise(qa, sa, qb, sb, reference: torch.Tensor):
    """A callable running cuBLAS blockwise FP8 through torch._scaled_mm, or None if this torch
    does not take these scales (or gives a different answer than ours)."""
    # cuBLAS wants the 1x128 scales as [M, K/128] with M contiguous (our sa [K/128, M]
    # transposed), and the 128x128 ones as [K/128 rounded up to 4, N/128] with K contiguous.
    kb, nb = sb.shape
    sb_k_major = torch.zeros(nb, -(-kb // 4) * 4, device=sb.device, dtype=sb.dtype)
    sb_k_major[:, :kb] = sb.t()
    errors = []
    for scale_a, scale_b in ((sa.t(), sb_k_major.t()), (sa.t(), sb.t()), (sa.t(), sb)):
        try:
            out = torch._scaled_mm(qa, qb.t(), scale_a, scale_b, out_dtype=torch.bfloat16)
        except (RuntimeError, ValueError) as e:
            errors.append(str(e).splitlines()[0][:160])
            continue
        if (out.float() - reference.float()).abs().max() <= 0.02 * reference.float().abs().max():
            return lambda: torch._scaled_mm(qa, qb.t(), scale_a, scale_b, out_dtype=torch.bfloat16)
        errors.append("different result from ours")
    print(f"fp8 cuBLAS blockwise not measured: {errors}", flush=True)
    return None


def bench_dense(m: int, n: int, k: int, lib, device, rounds: int, graph: bool = False) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    b = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
    flops = 2.0 * m * n * k
    qa, sa = fp8.quantize_1x128(a)
    qb, sb = fp8.quantize_128x128(b)
    qa_t, sa_t = fp8.quantize_tensorwise(a)
    qb_t, sb_t = fp8.quantize_tensorwise(b)
    qa_r, sa_r = fp8.quantize_rowwise(a)
    qb_r, sb_r = fp8.quantize_rowwise(b)
    baselines = {
        "tensorwise_fast": lambda: torch._scaled_mm(qa_t, qb_t.t(), sa_t, sb_t, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True),
        "rowwise_fast": lambda: torch._scaled_mm(qa_r, qb_r.t(), sa_r, sb_r.t(), out_dtype=torch.bfloat16,
                                                 use_fast_accum=True),
        "bf16": lambda: a @ b.t(),
    }
    blockwise = _torch_blockwise(qa, sa, qb, sb, fp8.gemm_blockwise(qa, sa, qb, sb))
    if blockwise is not None:
        baselines["cublas_blockwise"] = blockwise
    row = {"shape": f"{m}x{n}x{k}", "pass": "dense", "kind": "fp8_gemm",
           **_compare(baselines, ("cublas_blockwise",) if blockwise is not None else ("rowwise_fast",),
                      lambda: fp8.gemm_blockwise(qa, sa, qb, sb), fp8.FAMILY_FP8_GEMM, lib, flops, rounds, graph)}
    _print(row)
    return row


def bench_quantizers(device, rounds: int, graph: bool = False) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(65536, 7168, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(16, 2048, 7168, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    offsets = torch.linspace(0, 65536, 129, device=device)[1:].to(torch.int32)
    cases = [
        ("tensorwise", lambda: fp8.quantize_tensorwise(x), lambda: fp8._quantize_blocks(
            x.float().reshape(1, -1), x.float().abs().amax().reshape(1)), x.numel()),
        ("rowwise", lambda: fp8.quantize_rowwise(x), lambda: fp8._quantize_blocks(x.float(), x.float().abs().amax(-1)),
         x.numel()),
        ("1x128", lambda: fp8.quantize_1x128(x), lambda: fp8._ref_1x128(x, None), x.numel()),
        ("1x128_grouped", lambda: fp8.quantize_1x128(x, offsets), lambda: fp8._ref_1x128(x, offsets), x.numel()),
        ("128x128", lambda: fp8.quantize_128x128(w), lambda: fp8._ref_128x128(w, False), w.numel()),
        ("128x128_t", lambda: fp8.quantize_128x128(w, True), lambda: fp8._ref_128x128(w, True), w.numel()),
        ("1x128_t", lambda: fp8.quantize_1x128_t(x), lambda: fp8._ref_1x128(x.t(), None), x.numel()),
    ]
    rows = []
    for name, ours, torch_ops, numel in cases:
        gbytes = numel * 3 / 1e9  # read bf16, write e4m3
        times = time_gemms({"ours": ours, "torch_ops": torch_ops}, rounds, graph)
        r = ratio(times["torch_ops"], times["ours"])
        row = {"kind": "fp8_quantize", "pass": name, "ours_gbps": gbytes / times["ours"].ms * 1e3,
               "torch_ops_gbps": gbytes / times["torch_ops"].ms * 1e3, "ratio": r["median"],
               "ratio_range": (r["min"], r["max"])}
        print(f"fp8 quantize {name:14s} ours {row['ours_gbps']:6.0f} GB/s | torch ops {row['torch_ops_gbps']:6.0f} GB/s"
              f" | x{row['ratio']:.1f}", flush=True)
        rows.append(row)
    return rows


def run(shapes, routing: str, lib, device, rounds: int, graph: bool = False) -> list[dict]:
    """All FP8 rows: quantisers, grouped GEMMs per MoE shape, dense GEMMs."""
    rows = bench_quantizers(device, rounds, graph)
    torch.cuda.empty_cache()
    for shape in shapes:
        rows += bench_grouped(shape, routing, lib, device, rounds, graph)
        torch.cuda.empty_cache()
        rows += bench_grouped_wgrad(shape, routing, lib, device, rounds, graph)
        torch.cuda.empty_cache()
    for m, n, k in [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336)]:
        rows.append(bench_dense(m, n, k, lib, device, rounds, graph))
        torch.cuda.empty_cache()
    return rows
