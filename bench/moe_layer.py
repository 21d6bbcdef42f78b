"""Benchmark the MoE layer: forward+backward against a per-expert loop and an equal-FLOP dense
MLP, and (EP mode) the expert-parallel dispatch+combine against a plain all-to-all.

Layer mode (one GPU; `--tiny` runs small shapes on CPU as a smoke test):

    python bench/moe_layer.py [--shapes mixtral,fine64,fine128] [--iters 10] [--tiny]

For each shape (E experts, top-k, R routed rows = tokens x k, dim -> expert hidden) it times
forward+backward of, in the same run:
  layer   MoELayer (router, permute, grouped GEMMs through moe.experts.grouped_mm, combine)
  gemm    the three grouped GEMMs alone on pre-grouped rows (where the layer's time goes)
  loop    the same layer with a per-expert Python loop of matmuls instead of grouped_mm
  dense   a SwiGLU MLP of hidden k x F on the R/k tokens: equal active FLOPs
and prints times, TFLOP/s of the expert GEMMs (18 R dim F per fwd+bwd) and the ratios
loop/layer (speed-up from grouping) and dense/layer (1.0: MoE costs what its FLOPs cost).

EP mode (torchrun, one process per GPU, ep = world size; NCCL, or gloo on CPU with --tiny):

    torchrun --nproc-per-node 4 bench/moe_layer.py --ep [--shapes mixtral]

Each rank routes its own R/k tokens with a real router; it times dispatch+combine (forward:
permute, count exchange, exchange, grouping, and back) of each dispatcher (`--dispatchers`,
default alltoall) and, in the same run, two
plain all-to-alls with even splits of the same per-rank bytes. It prints the bus bandwidth
of each (bytes x (ep-1)/ep / time, the nccl-tests convention) and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config import ModelConfig, MoEConfig  # noqa: E402
from core.layers import FeedForward  # noqa: E402
from moe.experts import grouped_mm_loop  # noqa: E402
from moe.layer import MoELayer  # noqa: E402

# name: (experts, top_k, routed rows, dim, expert hidden)
SHAPES = {
    "mixtral": (8, 2, 32768, 4096, 14336),
    "fine64": (64, 8, 131072, 2048, 1408),
    "fine128": (128, 8, 65536, 7168, 2048),
}
TINY = {
    "mixtral": (8, 2, 512, 64, 128),
    "fine64": (16, 4, 1024, 32, 48),
    "fine128": (32, 4, 512, 64, 32),
}


def timeit(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds of fn() (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_layer(e: int, k: int, dim: int, hidden: int, device, dtype) -> MoELayer:
    cfg = ModelConfig(dim=dim, ffn_dim=hidden, num_heads=1, num_kv_heads=1,
                      moe=MoEConfig(num_experts=e, top_k=k, ffn_dim=hidden, aux_loss_coeff=0.01))
    torch.manual_seed(0)
    return MoELayer(cfg, layer_id=0).to(device=device, dtype=dtype)


def bench_layer(name: str, shape, iters: int, device, dtype, profile: bool = False) -> None:
    e, k, routed, dim, hidden = shape
    tokens = routed // k
    layer = make_layer(e, k, dim, hidden, device, dtype)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, dim, device=device, dtype=dtype)

    def layer_step():
        layer(x).backward(grad)

    results = {"layer": timeit(layer_step, iters, 3, device)}
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            for _ in range(3):
                layer_step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    # The GEMMs alone, on rows already grouped like the layer's last routing.
    counts = layer.router(x.detach()).tokens_per_expert
    rows = torch.randn(routed, dim, device=device, dtype=dtype, requires_grad=True)
    rows_grad = torch.randn(routed, dim, device=device, dtype=dtype)
    results["gemm"] = timeit(lambda: layer.experts(rows, counts).backward(rows_grad), iters, 3, device)
    layer.experts.mm = grouped_mm_loop
    results["loop"] = timeit(layer_step, iters, 2, device)
    del layer, rows, rows_grad
    dense = FeedForward(dim, k * hidden).to(device=device, dtype=dtype)
    results["dense"] = timeit(lambda: dense(x).backward(grad), iters, 3, device)

    flops = 18 * routed * dim * hidden  # 3 GEMMs x (fwd + 2 bwd) x 2 flops per MAC
    loads = (counts.float().max() / counts.float().mean()).item()
    print(f"{name}: E={e} top-{k} routed={routed} {dim}->{hidden} ({dtype}, {device.type}; max/mean load {loads:.2f})")
    for what, secs in results.items():
        print(f"  {what:6s} {secs * 1e3:9.2f} ms  {flops / secs / 1e12:8.1f} TFLOP/s (expert-GEMM FLOPs)")
    print(f"  ratios: loop/layer {results['loop'] / results['layer']:.2f}x  dense/layer {results['dense'] / results['layer']:.2f}  "
          f"gemm/layer {results['gemm'] / results['layer']:.2f}")


def bench_ep(name: str, shape, iters: int, device, dtype, profile: bool = False,
             dispatchers: tuple[str, ...] = ("alltoall",)) -> None:
    import torch.distributed as dist

    from core.mesh import ParallelMesh
    from moe.dispatcher import build_dispatcher
    from moe.parallel import apply_ep

    world, rank = dist.get_world_size(), dist.get_rank()
    e, k, routed, dim, hidden = shape
    tokens = routed // k
    mesh = ParallelMesh.build(dp=world, ep=world, device_type=device.type)
    layer = make_layer(e, k, dim, hidden, device, dtype)
    apply_ep(torch.nn.ModuleList([layer]), mesh)
    group = mesh.group("ep")
    torch.manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(tokens, dim, device=device, dtype=dtype)
    times = {}
    with torch.no_grad():
        routing = layer.router(x)
        for kind in dispatchers:
            d = build_dispatcher(kind, e, group)

            def dispatch_combine():
                rows, _ = d.dispatch(x, routing)
                d.combine(rows)

            times[kind] = timeit(dispatch_combine, iters, 3, device)
            if profile:  # every rank runs the rounds (collectives must match); rank 0 prints
                from torch.profiler import ProfilerActivity, profile as torch_profile

                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        dispatch_combine()
                    torch.cuda.synchronize()
                if dist.get_rank() == 0:
                    print(f"--- {kind}")
                    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20,
                                                    max_name_column_width=60))
            # Round trip with identity experts: every token must come back as x * sum of its weights.
            rows, _ = d.dispatch(x, routing)
            back = d.combine(rows)
            expected = (x.float() * routing.weights.sum(-1, keepdim=True)).to(dtype)
            torch.testing.assert_close(back, expected, rtol=2e-2, atol=2e-2)
    sent = torch.tensor(d_splits(routing, e, world), device=device, dtype=torch.float64)
    per_rank_bytes = float(sent.sum()) * dim * x.element_size()  # rows this rank sends, each way
    even = torch.randn(int(sent.sum()) // world * world, dim, device=device, dtype=dtype)
    out = torch.empty_like(even)

    def plain():
        dist.all_to_all_single(out, even, group=group)
        dist.all_to_all_single(even, out, group=group)

    t_plain = timeit(plain, iters, 3, device)
    stats = torch.tensor([*times.values(), t_plain, per_rank_bytes], device=device, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    *t_ours, t_plain, nbytes = stats.tolist()
    if rank == 0:
        bus = lambda t: 2 * nbytes * (world - 1) / world / t / 1e9  # noqa: E731
        print(f"EP {name}: ep={world} tokens/rank={tokens} top-{k} dim={dim} ({dtype}, {device.type}); "
              f"{nbytes / 2**20:.1f} MiB per rank each way")
        for kind, t in zip(times, t_ours):
            print(f"  dispatch+combine [{kind:8s}] {t * 1e3:8.2f} ms  bus {bus(t):7.1f} GB/s  "
                  f"ratio {t_plain / t:.2f} of the plain all-to-all bandwidth at the same bytes")
        print(f"  plain all-to-all x2 {t_plain * 1e3:6.2f} ms  bus {bus(t_plain):7.1f} GB/s")


def d_splits(routing, e: int, world: int) -> list[int]:
    """Rows this rank sends to each EP rank for this routing (the dispatch's input splits)."""
    counts = torch.bincount(routing.indices.reshape(-1), minlength=e)
    return counts.view(world, -1).sum(1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,fine64,fine128")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    parser.add_argument("--ep", action="store_true", help="expert-parallel dispatch mode (torchrun)")
    parser.add_argument("--dispatchers", default="alltoall",
                        help="EP mode: dispatchers to time in the same run (alltoall, allgather)")
    parser.add_argument("--profile", action="store_true",
                        help="print a profiler table of 3 steps (EP mode: of 3 dispatch+combine rounds, GPU only)")
    args = parser.parse_args()
    table = TINY if args.tiny else SHAPES
    names = args.shapes.split(",")
    for n in names:
        if n not in table:
            parser.error(f"--shapes: unknown shape {n!r}; choose from {', '.join(table)}")
    cuda = torch.cuda.is_available() and not args.tiny
    if args.ep:
        from core.mesh import init_distributed

        _, _, device = init_distributed("nccl" if cuda else "gloo")
    else:
        device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    for n in names:
        if args.ep:
            bench_ep(n, table[n], args.iters, device, dtype, args.profile and device.type == "cuda",
                     tuple(args.dispatchers.split(",")))
        else:
            bench_layer(n, table[n], args.iters, device, dtype, args.profile)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.ep:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
