"""Host (CPU) cost per call of the FP8 kernel wrappers, against bf16 `F.linear`.

Operands are 256x256, so the GPU always waits for the host: the device time of `--iters` calls
back to back (bench.harness: CUDA events, interleaved rounds, the median) is the host's time per
call, launches included (microseconds). Needs a CUDA GPU with the kernel library.

    python -m bench.fp8_host [--iters 300] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F

from bench.harness import compare, emit
from core.precision import blockwise
from core.kernels import fp8 as kfp8
from core.kernels.library import kernel_library


def host_us(cases: dict, iters: int, rounds: int) -> dict[str, dict]:
    """Microseconds per call of each case (median over rounds, lowest and highest)."""
    times = compare(cases, rounds=rounds, iters=iters, warmup=10)
    return {name: {"us": 1e3 * t.ms, "us_min": 1e3 * t.min_ms, "us_max": 1e3 * t.max_ms} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300, help="calls per timing round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--profile", action="store_true", help="also cProfile the FP8 linear's forward + backward")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.fp8_host needs a CUDA GPU", file=sys.stderr)
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
        "fp8_linear fwd, no autograd": lambda: blockwise.fp8_linear(xd, wd),
        "fp8_linear fwd, autograd": lambda: blockwise.fp8_linear(x, w),
        "fp8_linear fwd+bwd": lambda: blockwise.fp8_linear(x, w).backward(gy),
        "F.linear fwd": lambda: F.linear(x, w),
        "F.linear fwd+bwd": lambda: F.linear(x, w).backward(gy),
    }
    results = host_us(cases, args.iters, args.rounds)
    # Backward on the calling thread, as one backward per micro-batch amortises the hand-off to
    # autograd's device thread that each call here would pay.
    torch.autograd.set_multithreading_enabled(False)
    on_caller = {f"{name}, autograd on caller": cases[name] for name in ("fp8_linear fwd+bwd", "F.linear fwd+bwd")}
    results.update(host_us(on_caller, args.iters, args.rounds))
    for name, r in results.items():
        print(f"{name:40s} {r['us']:8.1f} us  [{r['us_min']:.1f} - {r['us_max']:.1f}]")
    emit("fp8_host", {"iters": args.iters, "rounds": args.rounds, "host_us": results})
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            cases["fp8_linear fwd+bwd"]()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
