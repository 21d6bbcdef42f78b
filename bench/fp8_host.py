"""Host (CPU) cost per call of the FP8 kernel wrappers, against bf16 `F.linear`.

Operands are 256x256, so the GPU always waits for the host: each figure is the mean host time
of a call, launches included (microseconds). Needs a CUDA GPU with the kernel library.

    python bench/fp8_host.py [--iters 300] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core import fp8  # noqa: E402
from core.kernels import fp8 as kfp8  # noqa: E402
from core.kernels.library import kernel_library  # noqa: E402


def host_us(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="also cProfile the FP8 linear's forward + backward")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/fp8_host.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda")
    x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(256, 256, device=dev, dtype=torch.bfloat16) * 0.02)
    gy = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    xd, wd = x.detach(), w.detach()
    qx, sx = kfp8.quantize_1x128(xd)
    qw, sw = kfp8.quantize_128x128(wd)
    cases = {
        "torch.empty": lambda: torch.empty(256, 256, device=dev, dtype=torch.bfloat16),
        "kernel_library": lambda: kernel_library(dev),
        "quantize_1x128": lambda: kfp8.quantize_1x128(xd),
        "quantize_128x128": lambda: kfp8.quantize_128x128(wd),
        "gemm_blockwise": lambda: kfp8.gemm_blockwise(qx, sx, qw, sw),
        "fp8_linear fwd, no autograd": lambda: fp8.fp8_linear(xd, wd),
        "fp8_linear fwd, autograd": lambda: fp8.fp8_linear(x, w),
        "fp8_linear fwd+bwd": lambda: fp8.fp8_linear(x, w).backward(gy),
        "F.linear fwd": lambda: F.linear(x, w),
        "F.linear fwd+bwd": lambda: F.linear(x, w).backward(gy),
    }
    for name, fn in cases.items():
        print(f"{name:32s} {host_us(fn, args.iters):8.1f} us")
    # Backward on the calling thread, as one backward per micro-batch amortises the hand-off to
    # autograd's device thread that each call here would pay.
    torch.autograd.set_multithreading_enabled(False)
    for name in ("fp8_linear fwd+bwd", "F.linear fwd+bwd"):
        print(f"{name + ', autograd on caller':32s} {host_us(cases[name], args.iters):8.1f} us")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            cases["fp8_linear fwd+bwd"]()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
