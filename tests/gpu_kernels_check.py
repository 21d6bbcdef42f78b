"""GPU correctness of the CUTLASS kernels against float64 references (run on an H100).

    python tests/gpu_kernels_check.py [--quick] [--allow-fallback]

Every check uses fresh random inputs, uneven group sizes with empty groups (first, middle,
last) and rows past the last offset, and poisons outputs with NaN before the call, so an
element the kernel forgot to write fails the check. Reference: float64 products of the same
bf16 inputs, group membership read from the offsets with searchsorted (not the kernels' scan).
Tolerance: the bf16 rounding of the output is at most 2^-8 relative; we allow 2^-7 relative
plus 2^-10 of the output's RMS (fp32 accumulation over up to 8k terms stays far below that).
A wrong group, layout or missing tile gives errors of the order of the RMS itself.

The reference helpers also serve the CPU tests (tests/test_kernels.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RTOL, ATOL_RMS = 2.0**-7, 2.0**-10
FAMILY_FP8_GG = 2  # TESSERA_FAMILY_FP8_GG


# ---------------------------------------------------------------------------------------
# References (CPU or GPU, any dtype; float64 in the checks).
# ---------------------------------------------------------------------------------------

def group_ids(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the group of each row, -1 past the last group. Offsets are clamped to
    [0, rows] and a decreasing offset reads as an empty group (the kernels' contract)."""
    ends = torch.cummax(offsets.long().clamp(0, rows), 0).values
    ids = torch.searchsorted(ends, torch.arange(rows, device=offsets.device), right=True)
    return torch.where(ids < offsets.shape[0], ids, -1)


def reference_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[i] = x[i] @ w[group(i)], zero rows outside every group (differentiable)."""
    ids = group_ids(offsets, x.shape[0])
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for g in range(w.shape[0]):
        rows = (ids == g).nonzero().squeeze(1)
        if rows.numel():
            out = out.index_put((rows,), x[rows] @ w[g])
    return out


def reference_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dw[g] = sum over rows i of group g of outer(x[i], dy[i]); zeros for empty groups."""
    ids = group_ids(offsets, x.shape[0])
    out = x.new_zeros(offsets.shape[0], x.shape[1], dy.shape[1])
    for g in range(offsets.shape[0]):
        rows = (ids == g).nonzero().squeeze(1)
        out[g] = x[rows].t() @ dy[rows]
    return out


def uneven_offsets(rows: int, groups: int, gen: torch.Generator, empty: int = 0, tail: int = 0) -> torch.Tensor:
    """int32 cumulative ends of `groups` random-sized groups over rows - tail rows; `empty`
    groups (the first, the last, then random ones) get no rows at all."""
    used = rows - tail
    empty_set: set[int] = set()
    for g in [0, groups - 1, *torch.randperm(groups, generator=gen).tolist()]:
        if len(empty_set) >= min(empty, groups - 1):
            break
        empty_set.add(g)
    full = [g for g in range(groups) if g not in empty_set]
    cuts = torch.sort(torch.randint(0, used + 1, (len(full) - 1,), generator=gen)).values.tolist()
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, used])]
    counts = [0] * groups
    for g, size in zip(full, sizes):
        counts[g] = size
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def routed_offsets(rows: int, groups: int, gen: torch.Generator) -> torch.Tensor:
    """Offsets of uniform random routing: group sizes multinomial around rows / groups."""
    ids = torch.randint(0, groups, (rows,), generator=gen)
    return torch.bincount(ids, minlength=groups).cumsum(0).to(torch.int32)


# ---------------------------------------------------------------------------------------
# Checks.
# ---------------------------------------------------------------------------------------

class Failures(list):
    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor, atol_rms: float = ATOL_RMS) -> None:
        """Record a failure unless every element is finite and within tolerance of ref."""
        out64 = out.double()
        finite = bool(torch.isfinite(out64).all())
        rms = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
        err = (out64 - ref).abs()
        bound = RTOL * ref.abs() + atol_rms * rms
        worst = (err / bound.clamp_min(1e-30)).max().item() if ref.numel() else 0.0
        ok = finite and worst <= 1.0
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: max err/tolerance {worst:.3f}{'' if finite else ', NaN/inf left'}")
        if not ok:
            self.append(name)


def _bf16(shape, gen, device, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(torch.bfloat16)


CASES = [  # rows, k, n, groups, empty groups, rows past the end
    (1000, 256, 384, 5, 2, 17),
    (3000, 136, 200, 7, 3, 0),  # k, n multiples of 8 but not of any tile
    (517, 512, 1024, 1, 0, 5),
    (0, 64, 64, 3, 0, 0),  # no rows at all
    (4096, 2048, 1408, 16, 4, 0),
    (2048, 7168, 512, 8, 2, 100),
]


def check_grouped_variants(failures: Failures, device: torch.device, quick: bool) -> None:
    """Every built config x op (fwd, fwd with transposed weights both ways, wgrad), outputs poisoned."""
    from core.kernels import library
    from core.kernels.grouped_gemm import OP_FWD, OP_FWD_BT, OP_FWD_BT_T, OP_WGRAD, run_grouped, run_wgrad_f32

    lib = library.kernel_library(device)
    gen = torch.Generator(device=device).manual_seed(1234)
    cpu_gen = torch.Generator().manual_seed(1234)
    configs = [i for i, n in enumerate(lib.gg_bf16_config_names()) if n is not None]
    for rows, k, n, groups, empty, tail in CASES[: 3 if quick else None]:
        x = _bf16((rows, k), gen, device)
        w = _bf16((groups, k, n), gen, device, scale=k**-0.5)
        dy = _bf16((rows, n), gen, device)
        offsets = uneven_offsets(rows, groups, cpu_gen, empty, tail).to(device)
        ref = reference_mm(x.double(), w.double(), offsets)
        ref_bt = reference_mm(dy.double(), w.double().transpose(1, 2), offsets)
        ref_w = reference_wgrad(x.double(), dy.double(), offsets)
        for c in configs:
            tag = f"{lib.gg_bf16_config_names()[c]} rows={rows} k={k} n={n} G={groups}"
            out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)
            failures.check(f"fwd    {tag}", run_grouped(lib, OP_FWD, x, w, out, offsets, c), ref)
            out = torch.full((rows, k), float("nan"), dtype=torch.bfloat16, device=device)
            failures.check(f"fwd_bt {tag}", run_grouped(lib, OP_FWD_BT, dy, w, out, offsets, c), ref_bt)
            out = torch.full((rows, k), float("nan"), dtype=torch.bfloat16, device=device)
            failures.check(f"fwd_bt_t {tag}", run_grouped(lib, OP_FWD_BT_T, dy, w, out, offsets, c), ref_bt)
            out = torch.full((groups, k, n), float("nan"), dtype=torch.bfloat16, device=device)
            failures.check(f"wgrad  {tag}", run_grouped(lib, OP_WGRAD, x, dy, out, offsets, c), ref_w)
            # Into fp32: overwriting (empty groups zeroed), then adding to what is there.
            out = torch.full((groups, k, n), float("nan"), dtype=torch.float32, device=device)
            failures.check(f"wgrad_f32 overwrite {tag}", run_wgrad_f32(lib, x, dy, out, offsets, False, c), ref_w)
            before = torch.randn((groups, k, n), generator=gen, device=device)
            out = before.clone()
            failures.check(f"wgrad_f32 add       {tag}", run_wgrad_f32(lib, x, dy, out, offsets, True, c),
                           before.double() + ref_w)


def check_custom_op_autograd(failures: Failures, device: torch.device) -> None:
    """The tessera::grouped_mm op end to end: forward and both gradients."""
    from core.kernels import grouped_mm

    gen = torch.Generator(device=device).manual_seed(7)
    rows, k, n, groups = 2500, 512, 768, 6
    offsets = uneven_offsets(rows, groups, torch.Generator().manual_seed(7), empty=2, tail=9).to(device)
    x = _bf16((rows, k), gen, device).requires_grad_()
    w = _bf16((groups, k, n), gen, device, scale=k**-0.5).requires_grad_()
    dy = _bf16((rows, n), gen, device)
    torch.cuda.empty_cache()
    torch.full((64 << 20,), float("nan"), device=device)  # leave NaN in the allocator's blocks
    y = grouped_mm(x, w, offsets)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = reference_mm(x64, w64, offsets)
    y64.backward(dy.double())
    failures.check("op forward", y, y64.detach())
    failures.check("op dgrad", x.grad, x64.grad)
    failures.check("op wgrad", w.grad, w64.grad)
    # A data gradient that runs as its transpose (OP_FWD_BT_T): 1408 inputs, groups of ~1700 rows.
    from core.kernels.grouped_gemm import transposed_pads_less
    rows, k, n, groups = 5000, 1408, 256, 3
    assert transposed_pads_less(rows, groups, k)
    offsets = uneven_offsets(rows, groups, torch.Generator().manual_seed(8), empty=0, tail=5).to(device)
    x = _bf16((rows, k), gen, device).requires_grad_()
    w = _bf16((groups, k, n), gen, device, scale=k**-0.5)
    dy = _bf16((rows, n), gen, device)
    grouped_mm(x, w, offsets).backward(dy)
    failures.check("op dgrad computed transposed", x.grad, reference_mm(dy.double(), w.double().transpose(1, 2), offsets))


def check_cuda_graph(failures: Failures, device: torch.device) -> None:
    """Capture forward + wgrad once, then replay with new offsets and data in the same buffers."""
    from core.kernels import grouped_mm, grouped_mm_wgrad
    from core.kernels.grouped_gemm import grouped_mm_wgrad_into_

    gen = torch.Generator(device=device).manual_seed(11)
    cpu_gen = torch.Generator().manual_seed(11)
    rows, k, n, groups = 1536, 256, 512, 8
    x = _bf16((rows, k), gen, device)
    w = _bf16((groups, k, n), gen, device, scale=k**-0.5)
    dy = _bf16((rows, n), gen, device)
    offsets = uneven_offsets(rows, groups, cpu_gen).to(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up outside the graph (lazy init, workspace sizes)
        grouped_mm(x, w, offsets)
        grouped_mm_wgrad(x, dy, offsets)
        main_grad = torch.zeros(groups, k, n, device=device)
        grouped_mm_wgrad_into_(main_grad, x, dy, offsets, True)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_mm(x, w, offsets)
        dw = grouped_mm_wgrad(x, dy, offsets)
        grouped_mm_wgrad_into_(main_grad, x, dy, offsets, True)
    for trial in range(2):
        offsets.copy_(uneven_offsets(rows, groups, cpu_gen, empty=2 + trial, tail=13 * trial).to(device))
        x.copy_(_bf16((rows, k), gen, device))
        y.fill_(float("nan"))
        dw.fill_(float("nan"))
        before = torch.randn(main_grad.shape, generator=gen, device=device)
        main_grad.copy_(before)
        graph.replay()
        torch.cuda.synchronize(device)
        ref_w = reference_wgrad(x.double(), dy.double(), offsets)
        failures.check(f"graph replay {trial} forward", y, reference_mm(x.double(), w.double(), offsets))
        failures.check(f"graph replay {trial} wgrad", dw, ref_w)
        failures.check(f"graph replay {trial} wgrad into fp32 main grad", main_grad, before.double() + ref_w)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases only")
    parser.add_argument("--allow-fallback", action="store_true", help="pass without the compiled library")
    args = parser.parse_args(argv)
    from core.kernels import library

    if not torch.cuda.is_available():
        print("gpu_kernels_check: no CUDA device")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    lib = library.kernel_library(device)
    print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"library {library.library_path() if lib else 'NOT LOADED'}")
    if lib is None and not args.allow_fallback:
        print("gpu_kernels_check: the compiled library is not usable here (see the log line above)")
        return 1
    if lib is not None:
        print("configs: " + "; ".join(f"{f}: {lib.config_names(i)}" for i, f in enumerate(["bf16 grouped", "fp8 gemm",
                                                                                         "fp8 grouped"])))
    failures = Failures()
    if lib is not None:
        check_grouped_variants(failures, device, args.quick)
    check_custom_op_autograd(failures, device)
    check_cuda_graph(failures, device)
    if lib is not None and lib.config_names(FAMILY_FP8_GG):
        from tests import gpu_kernels_check_fp8

        gpu_kernels_check_fp8.run(failures, device)
    print(f"gpu_kernels_check: {'FAILED ' + str(len(failures)) if failures else 'all passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
