"""GPU checks of the FP8 kernels (run by tests/gpu_kernels_check.py on an H100).

- Quantisers: the CUDA kernels against the PyTorch fallbacks of core/kernels/fp8.py, which
  do the same fp32 arithmetic: q bytes and scales must be identical (poisoned outputs).
- Blockwise GEMMs (dense and grouped, every built configuration): against float64 products
  of the dequantised operands. Tolerance: bf16 output rounding (2^-8 relative, we allow 2^-7)
  plus 2^-8 of the output RMS for the FP8 tensor cores' limited-precision accumulation within
  each 128-deep K block before the fp32 promotion.
"""

from __future__ import annotations


import torch

from core.kernels import fp8, library
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
    cpu = torch.device("cpu")
    for name, fn, args in [
        ("tensorwise", fp8._quantize_tensorwise, (x,)),
        ("rowwise", fp8._quantize_rowwise, (x,)),
        ("1x128", fp8.quantize_1x128, (x, None)),
        ("1x128 grouped", fp8.quantize_1x128, (x, offsets)),
        ("1x128 of the transpose", fp8.quantize_1x128_t, (x[:2992],)),  # rows % 16 == 0 for the kernel
        ("128x128", fp8.quantize_128x128, (w, False)),
        ("128x128 transposed", fp8.quantize_128x128, (w, True)),
    ]:
        got = fn(*args)
        want = fn(*(a.to(cpu) if isinstance(a, torch.Tensor) else a for a in args))  # CPU: the fallback
        _exact(failures, f"quantize {name}", tuple(t.cpu() for t in got), want)


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
        for c, cname in enumerate(lib.config_names(fp8.FAMILY_FP8_GG)):
            if cname is None:
                continue
            with fp8.forced_config(c):
                torch.cuda.empty_cache()
                torch.full((64 << 20,), float("nan"), device=device)  # poison the allocator's blocks
                tag = f"{cname} rows={rows} d={d} h={h} E={experts}"
                failures.check(f"fp8 grouped fwd   {tag}", fp8.grouped_mm_blockwise(qx, sx, qw_fwd, sw_fwd, offsets),
                               ref_fwd, atol_rms=FP8_ATOL_RMS)
                failures.check(f"fp8 grouped dgrad {tag}", fp8.grouped_mm_blockwise(qdy, sdy, qw_bwd, sw_bwd, offsets),
                               ref_bwd, atol_rms=FP8_ATOL_RMS)


def run(failures: Failures, device: torch.device) -> None:
    check_quantizers(failures, device)
    check_gemms(failures, device)
