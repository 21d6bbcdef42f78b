"""What the GEMM benchmarks (bench.kernels, bench.kernels_fp8, bench.kernel_raster) share: the MoE
shapes and their routing, so that the three time the same problems; their timing settings; and
a candidate's figures against the baseline it was timed with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.harness import Timing, compare, ratio


@dataclass(frozen=True)
class MoEShape:
    name: str
    experts: int
    top_k: int
    routed: int  # rows after dispatch (tokens x top_k)
    dim: int
    hidden: int


SHAPES = {
    "mixtral": MoEShape("mixtral", 8, 2, 32768, 4096, 14336),
    "fine64": MoEShape("fine64", 64, 8, 131072, 2048, 1408),
    "fine128": MoEShape("fine128", 128, 8, 65536, 7168, 2048),
    # fine64's down projection (1408 -> 2048): its wgrad has 11 M tiles of 128 (not in the default list)
    "fine64down": MoEShape("fine64down", 64, 8, 131072, 1408, 2048),
}
DEFAULT_SHAPES = "mixtral,fine64,fine128"


def routed_offsets(shape: MoEShape, routing: str, device) -> torch.Tensor:
    """Cumulative rows per expert: uniform random routing (seeded), or equal groups ("balanced")."""
    if routing == "balanced":
        counts = torch.full((shape.experts,), shape.routed // shape.experts, dtype=torch.int64)
    else:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, shape.experts, (shape.routed,), generator=gen)
        counts = torch.bincount(ids, minlength=shape.experts)
    return counts.cumsum(0).to(torch.int32).to(device)


def time_gemms(fns: dict, rounds: int, graph: bool = False) -> dict[str, Timing]:
    """The kernels' timing: interleaved rounds of about 100 ms per candidate, each call from a cold
    L2 (the operands of the previous call are not in cache), or, with graph, CUDA-graph replays
    back to back (no host time between calls, no flush). Callables that read back to the host
    cannot be captured: pass graph=False for them."""
    return compare(fns, rounds=rounds, warmup=3, flush_l2=not graph, graph=graph)


def gemm_stats(base: Timing, ours: Timing, flops: float) -> dict:
    """One candidate against the baseline timed in the same rounds: its median time and TFLOP/s,
    and the median (and lowest, highest) of the same-round ratios baseline / candidate."""
    r = ratio(base, ours)
    return {**ours.summary(), "ms_rounds": ours.rounds_ms, "tflops": flops / ours.ms / 1e9, "ratio": r["median"],
            "ratio_range": (r["min"], r["max"])}
