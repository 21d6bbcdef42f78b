"""GPU checks of the FP8 kernels (run by tests/gpu_kernels_check.py on an H100).

- Quantisers: the CUDA kernels against the PyTorch fallbacks of core/kernels/fp8.py, which
  do the same fp32 arithmetic: q bytes and scales must be identical (poisoned outputs).
- The experts' K-grouped wgrad (core/kernels/fp8_wgrad.py): its transposing quantiser the same
  way (the blocks it writes), its GEMM per configuration like the others, and the whole
  fp8_grouped_wgrad captured in a CUDA graph and replayed with new routing.
- Blockwise GEMMs (dense and grouped, every built configuration): against float64 products
  of the dequantised operands. Tolerance: bf16 output rounding (2^-8 relative, we allow 2^-7)
  plus 2^-8 of the output RMS for the FP8 tensor cores' limited-precision accumulation within
  each 128-deep K block before the fp32 promotion.
"""

from __future__ import annotations


import torch

from core.kernels import fp8, library
from core.kernels import fp8_wgrad as kwgrad
from tests.gpu_kernels_check import Failures, reference_mm, uneven_offsets

FP8_ATOL_RMS = 2.0**-8


def _exact(failures: Failures, name: str, got: tuple, want: tuple) -> None:
    ok = all(torch.equal(g.view(torch.uint8) if g.dtype == fp8.FP8 else g, w.view(torch.uint8) if w.dtype == fp8.FP8
                         else w) for g, w in zip(got, want))
    verdict = "bit-identical to the fallback" if ok else "differs from the fallback"
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: {verdict}")
    if not ok:
        failures.append(name)


def check_quantizers(failures: Failures, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(21)
    x = (torch.randn(3000, 1408, generator=gen, device=device) * 3).to(torch.bfloat16)
    x[7] = 0  # an all-zero row / block
    offsets = uneven_offsets(3000, 9, torch.Generator().manual_seed(21), empty=3, tail=40).to(device)
    w = (torch.randn(4, 2048, 1408, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    # Enough groups for three levels of the kernel's 16-ary group search.
    many = uneven_offsets(3000, 300, torch.Generator().manual_seed(22), empty=40, tail=7).to(device)
    cpu = torch.device("cpu")
    for name, fn, args in [
        ("tensorwise", fp8._quantize_tensorwise, (x,)),
        ("rowwise", fp8._quantize_rowwise, (x,)),
        ("1x128", fp8.quantize_1x128, (x, None)),
        ("1x128 grouped", fp8.quantize_1x128, (x, offsets)),
        ("1x128 grouped, 300 groups", fp8.quantize_1x128, (x, many)),
        ("1x128 of the transpose", fp8.quantize_1x128_t, (x[:2992],)),  # rows % 16 == 0 for the kernel
        ("128x128", fp8.quantize_128x128, (w, False)),
        ("128x128 transposed", fp8.quantize_128x128, (w, True)),
    ]:
        got = fn(*args)
        want = fn(*(a.to(cpu) if isinstance(a, torch.Tensor) else a for a in args))  # CPU: the fallback
        _exact(failures, f"quantize {name}", tuple(t.cpu() for t in got), want)


def _each_grouped_config(lib, device: torch.device):
    """Yields each built FP8 grouped configuration's name while it is forced, with NaN left in
    the allocator's free blocks, so an output element no kernel writes shows up."""
    for c, cname in enumerate(lib.config_names(fp8.FAMILY_FP8_GG)):
        if cname is None:
            continue
        with fp8.forced_config(c):
            torch.cuda.empty_cache()
            torch.full((64 << 20,), float("nan"), device=device)
            yield cname


def check_gemms(failures: Failures, device: torch.device) -> None:
    lib = library.kernel_library(device)
    gen = torch.Generator(device=device).manual_seed(22)
    cases = [(1000, 2048, 1408), (516, 7168, 512), (64, 256, 4096)]  # m, k, n (m % 4 == 0: TMA scales)
    for m, k, n in cases:
        a = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
        b = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
        qa, sa = fp8.quantize_1x128(a)
        qb, sb = fp8.quantize_128x128(b)
        ref = fp8.dequantize_1x128(qa, sa).double() @ fp8.dequantize_128x128(qb, sb).double().t()
        for c, cname in enumerate(lib.config_names(fp8.FAMILY_FP8_GEMM)):
            if cname is None:
                continue
            with fp8.forced_config(c):
                failures.check(f"fp8 gemm {cname} m={m} k={k} n={n}", fp8.gemm_blockwise(qa, sa, qb, sb), ref,
                               atol_rms=FP8_ATOL_RMS)
    cpu_gen = torch.Generator().manual_seed(22)
    for rows, d, h, experts, empty, tail in [(3000, 1024, 1408, 8, 3, 20), (4096, 2048, 512, 16, 2, 0)]:
        x = torch.randn(rows, d, generator=gen, device=device).to(torch.bfloat16)
        w = (torch.randn(experts, d, h, generator=gen, device=device) * d**-0.5).to(torch.bfloat16)
        dy = torch.randn(rows, h, generator=gen, device=device).to(torch.bfloat16)
        offsets = uneven_offsets(rows, experts, cpu_gen, empty, tail).to(device)
        qx, sx = fp8.quantize_1x128(x, offsets)
        qw_fwd, sw_fwd = fp8.quantize_128x128(w, transpose=True)  # [E, h, d]: forward
        qdy, sdy = fp8.quantize_1x128(dy, offsets)
        qw_bwd, sw_bwd = fp8.quantize_128x128(w)  # [E, d, h]: dgrad
        ref_fwd = reference_mm(fp8.dequantize_1x128(qx, sx, offsets).double(),
                               fp8.dequantize_128x128(qw_fwd, sw_fwd).double().transpose(1, 2), offsets)
        ref_bwd = reference_mm(fp8.dequantize_1x128(qdy, sdy, offsets).double(),
                               fp8.dequantize_128x128(qw_bwd, sw_bwd).double().transpose(1, 2), offsets)
        for cname in _each_grouped_config(lib, device):
            tag = f"{cname} rows={rows} d={d} h={h} E={experts}"
            failures.check(f"fp8 grouped fwd   {tag}", fp8.grouped_mm_blockwise(qx, sx, qw_fwd, sw_fwd, offsets),
                           ref_fwd, atol_rms=FP8_ATOL_RMS)
            failures.check(f"fp8 grouped dgrad {tag}", fp8.grouped_mm_blockwise(qdy, sdy, qw_bwd, sw_bwd, offsets),
                           ref_bwd, atol_rms=FP8_ATOL_RMS)


def _wgrad_reference(qd, sd, qx, sx, block_starts) -> torch.Tensor:
    """float64 [G, M, N]: per group, the product of its dequantised K blocks (zeros if empty)."""
    bs = block_starts.tolist()
    out = torch.zeros(len(bs) - 1, qd.shape[0], qx.shape[0], dtype=torch.float64, device=qd.device)
    for g in range(len(bs) - 1):
        if bs[g + 1] > bs[g]:
            cols = slice(128 * bs[g], 128 * bs[g + 1])
            out[g] = fp8.dequantize_1x128(qd[:, cols], sd[bs[g]:bs[g + 1]]).double() @ \
                fp8.dequantize_128x128(qx[:, cols], sx[bs[g]:bs[g + 1]]).double().t()
    return out


def check_grouped_wgrad(failures: Failures, device: torch.device) -> None:
    lib = library.kernel_library(device)
    gen = torch.Generator(device=device).manual_seed(23)
    cpu_gen = torch.Generator().manual_seed(23)
    for rows, d, h, experts, empty, tail in [(3000, 1024, 1408, 8, 3, 20), (4096, 2048, 512, 16, 2, 0),
                                             (700, 256, 384, 3, 0, 0),
                                             # two and three rounds of the kernel's 32-ary block search
                                             (6000, 256, 384, 100, 10, 0), (20000, 128, 128, 1100, 50, 0)]:
        x = (torch.randn(rows, d, generator=gen, device=device) * 2).to(torch.bfloat16)
        dy = torch.randn(rows, h, generator=gen, device=device).to(torch.bfloat16)
        offsets = uneven_offsets(rows, experts, cpu_gen, empty, tail).to(device)
        rs, bs = kwgrad.group_blocks(offsets, rows)
        blocks = kwgrad.padded_blocks(rows, experts)
        used = int(bs[-1])
        tag = f"rows={rows} d={d} h={h} E={experts}"
        quantised = {}
        for per_column in (True, False):
            src = dy if per_column else x
            got = kwgrad.quantize_grouped_t(src, rs, bs, blocks, per_column)
            want = kwgrad.quantize_grouped_t(src.cpu(), rs.cpu(), bs.cpu(), blocks, per_column)
            _exact(failures, f"quantize grouped transpose {'1x128' if per_column else '128x128'} {tag}",
                   (got[0][:, :128 * used].cpu(), got[1][:used].cpu()), (want[0][:, :128 * used], want[1][:used]))
            quantised[per_column] = got
        (qd, sd), (qx, sx) = quantised[True], quantised[False]
        ref = _wgrad_reference(qd, sd, qx, sx, bs)
        for cname in _each_grouped_config(lib, device):
            failures.check(f"fp8 grouped wgrad {cname} {tag}", kwgrad.grouped_wgrad_blockwise(qd, sd, qx, sx, bs),
                           ref, atol_rms=FP8_ATOL_RMS)
            # Into fp32 (the main grad): NaN-poisoned and overwritten, then added onto random values.
            out = torch.full(ref.shape, float("nan"), dtype=torch.float32, device=device)
            kwgrad.grouped_wgrad_blockwise_into_(out, qd, sd, qx, sx, bs, False)
            failures.check(f"fp8 grouped wgrad into fp32 {cname} {tag}", out, ref, atol_rms=FP8_ATOL_RMS)
            before = torch.randn(ref.shape, generator=gen, device=device)
            out = before.clone()
            kwgrad.grouped_wgrad_blockwise_into_(out, qd, sd, qx, sx, bs, True)
            failures.check(f"fp8 grouped wgrad added to fp32 {cname} {tag}", out, before.double() + ref,
                           atol_rms=FP8_ATOL_RMS)


def check_grouped_wgrad_graph(failures: Failures, device: torch.device) -> None:
    """core.precision.blockwise.fp8_grouped_wgrad captured once, replayed with new routing and data."""
    from core.precision import blockwise as recipe

    gen = torch.Generator(device=device).manual_seed(24)
    cpu_gen = torch.Generator().manual_seed(24)
    rows, d, h, experts = 2048, 512, 768, 8
    x = torch.randn(rows, d, generator=gen, device=device).to(torch.bfloat16)
    dy = torch.randn(rows, h, generator=gen, device=device).to(torch.bfloat16)
    offsets = uneven_offsets(rows, experts, cpu_gen).to(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up outside the graph (lazy init, workspace sizes)
        recipe.fp8_grouped_wgrad(x, dy, offsets, torch.float32)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dw = recipe.fp8_grouped_wgrad(x, dy, offsets, torch.float32)
    for trial in range(2):
        offsets.copy_(uneven_offsets(rows, experts, cpu_gen, empty=2 + trial, tail=13 * trial).to(device))
        x.copy_(torch.randn(rows, d, generator=gen, device=device).to(torch.bfloat16))
        dw.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        # The reference: each expert's tokens quantised on their own, one dense blockwise GEMM
        # per expert (x^T 1x128, dy^T 128x128: fp8_matmul_wgrad with the operands swapped).
        ref = torch.zeros(experts, d, h, dtype=torch.float64, device=device)
        start = 0
        for g, end in enumerate(offsets.tolist()):
            end = max(end, start)
            if end > start:
                ref[g] = recipe.fp8_matmul_wgrad(x[start:end], dy[start:end]).double()
            start = end
        failures.check(f"fp8 grouped wgrad graph replay {trial} (against the per-expert GEMMs)", dw, ref,
                       atol_rms=FP8_ATOL_RMS)


def run(failures: Failures, device: torch.device) -> None:
    check_quantizers(failures, device)
    check_gemms(failures, device)
    check_grouped_wgrad(failures, device)
    check_grouped_wgrad_graph(failures, device)
