"""Benchmark the MoE layer: forward+backward against a per-expert loop and an equal-FLOP dense
MLP, and (EP mode) the expert-parallel dispatch+combine against a plain all-to-all.

Layer mode (one GPU; `--tiny` runs small shapes on CPU as a smoke test):

    python -m bench.moe_layer [--shapes mixtral,fine64,fine128] [--iters 10] [--compile] [--tiny]
                              [--back-to-back K] [--host-ahead] [--profile [--trace FILE]]

For each shape (E experts, top-k, R routed rows = tokens x k, dim -> expert hidden) it times
forward+backward of, in --iters interleaved rounds (bench.harness):
  layer   MoELayer (router, permute, grouped GEMMs through moe.experts.expert_mm, combine)
  gemm    the experts alone on pre-grouped rows (where the layer's time goes): the gate and up
          GEMM (one, on the fused [E, dim, 2F] weight), SwiGLU and the down GEMM
  gemmT   the same GEMMs through torch._grouped_mm and its autograd (CUDA bf16 only): the
          per-shape choice between Tessera's CUTLASS kernels and PyTorch's
  loop    the same layer with a per-expert Python loop of matmuls instead of expert_mm
  dense   a SwiGLU MLP of hidden k x F on the R/k tokens: equal active FLOPs
  layer+acc, dense+acc  the same as a later micro-batch of an accumulating step runs them: the
          weight gradients added into fp32 main grads (the experts' in the grouped GEMM's
          epilogue, the dense MLP's by one pass per gradient), which costs in proportion to the
          parameters (E x 3 x dim x F for the experts), not the FLOPs
and prints times, TFLOP/s of the expert GEMMs (18 R dim F per fwd+bwd) and the ratios
loop/layer (speed-up from grouping) and dense/layer (1.0: MoE costs what its FLOPs cost).
`--routing balanced` replaces the router's choice by an exactly balanced one (R/E rows per
expert, each token's k experts distinct, the router still computed): against the default
`router` (a freshly initialised router's load, max/mean printed) it separates the cost of
imbalance from the kernels' own.

Each timed round runs one call of a candidate after an idle GPU: the host's work before the
first kernels and wherever it falls behind the GPU shows as time (a step's first micro-batch).
`--back-to-back K` times K calls per round instead, the host queueing each call while the GPU
still runs the one before, as it does over an accumulating step's later micro-batches; the
times printed are per call. `--host-ahead` queues each round behind a sleeping GPU kernel, so the
host has issued every call before the GPU starts: the GPU's own time for the layer and for the
dense MLP, which is what a step's later micro-batches pay when the host keeps ahead (the default
also counts the GPU's waits for the host). `--profile --trace FILE` also writes the profiled rounds' Chrome trace
(`python -m bench.gpu_idle FILE`: where the GPU waited for the host).

EP mode (torchrun, one process per GPU, ep = world size; NCCL, or gloo on CPU with --tiny):

    torchrun --nproc-per-node 4 -m bench.moe_layer --ep [--shapes mixtral]

Each rank routes its own R/k tokens with a real router; it times dispatch+combine (forward:
permute, count exchange, exchange of the rows and their routing weights, grouping, and back, as
MoELayer builds the dispatchers) of each dispatcher (`--dispatchers`,
default alltoall) and, in the same run, two
plain all-to-alls with even splits of the same per-rank bytes, interleaved, each measurement
the slowest rank's. It prints the bus bandwidth of each (bytes x (ep-1)/ep / time, the
nccl-tests convention) and their ratio. Each shape ends with one record (JSON line).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile as torch_profile

from bench.harness import compare, emit, ratio
from core.config import ModelConfig, MoEConfig
from core.kernels.fused import accumulate_fp32_
from core.layers import FeedForward
from core.mesh import ParallelMesh, init_distributed
from core.parallel.data import MainGradSink
from moe.dispatcher import build_dispatcher
from moe.experts import GroupedExperts, _native_reason, expert_mm_loop
from moe.layer import MoELayer
from moe.router import Routing
from moe.parallel import apply_ep

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


def make_layer(e: int, k: int, dim: int, hidden: int, device, dtype) -> MoELayer:
    cfg = ModelConfig(dim=dim, ffn_dim=hidden, num_heads=1, num_kv_heads=1,
                      moe=MoEConfig(num_experts=e, top_k=k, ffn_dim=hidden, aux_loss_coeff=0.01))
    torch.manual_seed(0)
    return MoELayer(cfg, layer_id=0).to(device=device, dtype=dtype)


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offsets)


class BalancedRouter(torch.nn.Module):
    """The layer's router, run as usual, with its expert choice replaced by an exactly balanced
    one: token t takes experts (t*k + j) mod E, j < k, with the router's own weights."""

    def __init__(self, router: torch.nn.Module, num_experts: int):
        super().__init__()
        self.router, self.num_experts = router, num_experts

    def forward(self, x: torch.Tensor) -> Routing:
        r = self.router(x)
        t, k = r.indices.shape
        indices = (torch.arange(t * k, device=x.device) % self.num_experts).view(t, k)
        counts = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        return Routing(indices, r.weights, r.probs, r.logits, None, counts)


class _MainGrad:
    """What core.parallel.data.MainGradSink needs of a parameter's slot: an fp32 main grad
    already holding this step's earlier micro-batches (written), so every backward adds."""

    def __init__(self, param: torch.nn.Parameter):
        self.param, self.written, self.fused_pending = param, True, False
        self.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)


def accumulating(fn, experts: GroupedExperts | None, others: list[torch.nn.Parameter]):
    """fn run as a later micro-batch of an accumulating step: the experts' weight gradients go
    through their MainGradSink (added by the grouped GEMM's epilogue on the CUTLASS path), the
    other params' are added into fp32 main grads by one accumulate pass each, as the trainer does."""
    expert_params = (experts.w13, experts.w2) if experts is not None else ()
    sinks = {p: MainGradSink(_MainGrad(p)) for p in expert_params}
    mains = {p: _MainGrad(p) for p in others}

    def consume(slot):
        def hook(grads):
            accumulate_fp32_(slot.main_grad, grads[0], copy=False)
            return (None,)
        return hook

    # The hook lives on the param's AccumulateGrad node, which lives only while referenced.
    nodes = [torch.autograd.graph.get_gradient_edge(p).node for p in mains]
    for node, slot in zip(nodes, mains.values()):
        node.register_prehook(consume(slot))

    def step():
        for p, sink in sinks.items():
            p.main_grad_sink = sink
        try:
            fn()
        finally:
            for p in sinks:
                p.main_grad_sink = None
    step.sinks, step.mains, step.nodes = sinks, mains, nodes
    return step


def _with_fresh_grads(fn, tensors):
    def step():
        for t in tensors:
            t.grad = None
        fn()
        for t in tensors:  # freed before the next candidate runs (E=128 fills an 80 GB GPU otherwise)
            t.grad = None
    return step


def bench_layer(name: str, shape, iters: int, device, dtype, profile: bool = False, routing: str = "router",
                compiled: bool = False, back_to_back: int = 1, trace: str | None = None,
                host_ahead: bool = False) -> None:
    e, k, routed, dim, hidden = shape
    tokens = routed // k
    layer = make_layer(e, k, dim, hidden, device, dtype)
    if routing == "balanced":
        layer.router = BalancedRouter(layer.router, e)
    grouped = layer.experts.mm
    # --compile: as the trainer's compiled blocks run them, router, auxiliary loss and SwiGLU
    # fused by inductor, dispatch and grouped GEMMs eager (MoELayer._route).
    run_layer = torch.compile(layer) if compiled else layer
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, dim, device=device, dtype=dtype)

    def layer_step(mm=grouped):
        layer.experts.mm = mm
        run_layer(x).backward(grad)

    if profile:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        layer_step()
        with torch_profile(activities=activities) as prof:
            for _ in range(3):
                layer_step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
        if trace:
            prof.export_chrome_trace(trace)
    # The GEMMs alone, on rows already grouped like the layer's routing.
    counts = layer.router(x.detach()).tokens_per_expert
    rows = torch.randn(routed, dim, device=device, dtype=dtype, requires_grad=True)
    rows_grad = torch.randn(routed, dim, device=device, dtype=dtype)
    dense = FeedForward(dim, k * hidden).to(device=device, dtype=dtype)
    run_dense = torch.compile(dense) if compiled else dense

    def gemm_step():
        layer.experts.mm = grouped
        layer.experts(rows, counts).backward(rows_grad)

    steps = {"layer": layer_step, "gemm": gemm_step}
    if _native_reason(rows, layer.experts.w13[:, :, 0]) is None:  # the gate's [E, dim, F]: both GEMMs' sizes
        def gemm_torch_step():
            layer.experts.mm = torch_grouped_mm
            layer.experts(rows, counts).backward(rows_grad)
        steps["gemmT"] = gemm_torch_step
    steps.update({"loop": lambda: layer_step(expert_mm_loop), "dense": lambda: run_dense(x).backward(grad)})
    # Each round is one micro-batch's forward + backward that writes its gradients, as the
    # trainer's first micro-batch does: left in .grad, every round after the first would add a
    # bf16 read-modify-write of every weight gradient (aten::add_, 26% of the E=128 layer's GPU
    # time in a profile), a pass the trainer never makes. Its later micro-batches add into fp32
    # main grads instead: the +acc rows.
    grads_of = [*layer.parameters(), *dense.parameters(), x, rows]
    steps = {what: _with_fresh_grads(fn, grads_of) for what, fn in steps.items()}
    dense_acc = copy.deepcopy(dense)
    run_dense_acc = torch.compile(dense_acc) if compiled else dense_acc
    steps["layer+acc"] = _with_fresh_grads(accumulating(layer_step, layer.experts, []), grads_of)
    steps["dense+acc"] = _with_fresh_grads(
        accumulating(lambda: run_dense_acc(x).backward(grad), None, list(dense_acc.parameters())), [x])
    times = compare(steps, rounds=iters, iters=back_to_back, warmup=2, device=device, host_ahead=host_ahead)
    layer.experts.mm = grouped

    flops = 18 * routed * dim * hidden  # gate, up, down x (fwd + 2 bwd) x 2 flops per MAC
    loads = (counts.float().max() / counts.float().mean()).item()
    how = f"{dtype}, {device.type}" + (", compiled" if compiled else "") + \
        (f", {back_to_back} calls back to back per round" if back_to_back > 1 else "") + \
        (", host ahead" if host_ahead else "")
    print(f"{name}: E={e} top-{k} routed={routed} {dim}->{hidden} ({how}; {routing} routing, max/mean load {loads:.2f})")
    for what, t in times.items():
        print(f"  {what:9s} {t.ms:9.2f} ms [{t.min_ms:.2f} - {t.max_ms:.2f}]  {flops / t.ms / 1e9:8.1f} TFLOP/s "
              "(expert-GEMM FLOPs)")
    ratios = {f"{what}/layer": ratio(times[what], times["layer"]) for what in ("loop", "dense", "gemm")}
    ratios["dense/layer (acc)"] = ratio(times["dense+acc"], times["layer+acc"])
    if "gemmT" in times:
        ratios["gemmT/gemm"] = ratio(times["gemmT"], times["gemm"])
    print("  ratios: " + "  ".join(f"{what} {r['median']:.2f}" for what, r in ratios.items()))
    emit("moe_layer", {"mode": "layer", "shape": name, "experts": e, "top_k": k, "routed": routed, "dim": dim,
                       "hidden": hidden, "dtype": str(dtype), "routing": routing, "compiled": compiled,
                       "back_to_back": back_to_back, "host_ahead": host_ahead,
                       "max_mean_load": loads,
                       "timings": {what: t.summary() for what, t in times.items()},
                       "tflops": {what: flops / t.ms / 1e9 for what, t in times.items()}, "ratios": ratios}, device)


def bench_ep(name: str, shape, iters: int, device, dtype, profile: bool = False,
             dispatchers: tuple[str, ...] = ("alltoall",)) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    e, k, routed, dim, hidden = shape
    tokens = routed // k
    mesh = ParallelMesh.build(dp=world, ep=world, device_type=device.type)
    layer = make_layer(e, k, dim, hidden, device, dtype)
    apply_ep(torch.nn.ModuleList([layer]), mesh)
    group = mesh.group("ep")
    torch.manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(tokens, dim, device=device, dtype=dtype)
    with torch.no_grad():
        routing = layer.router(x)
        # As MoELayer builds them: the routing weights travel with the rows for the experts to apply.
        built = {kind: build_dispatcher(kind, e, group) for kind in dispatchers}
        for kind, d in built.items():
            # Round trip with identity experts that apply the rows' weights: every token must come
            # back as x * sum of its weights.
            rows, _, row_weights = d.dispatch(x, routing)
            back = d.combine((rows.float() * row_weights.unsqueeze(1)).to(dtype))
            expected = (x.float() * routing.weights.sum(-1, keepdim=True)).to(dtype)
            torch.testing.assert_close(back, expected, rtol=2e-2, atol=2e-2)
        sent = torch.tensor(d_splits(routing, e, world), device=device, dtype=torch.float64)
        per_rank_bytes = float(sent.sum()) * dim * x.element_size()  # rows this rank sends, each way
        even = torch.randn(int(sent.sum()) // world * world, dim, device=device, dtype=dtype)
        out = torch.empty_like(even)

        def dispatch_combine(d):
            rows, _, _ = d.dispatch(x, routing)
            d.combine(rows)

        def plain():
            dist.all_to_all_single(out, even, group=group)
            dist.all_to_all_single(even, out, group=group)

        candidates = {kind: (lambda d=d: dispatch_combine(d)) for kind, d in built.items()}
        times = compare({**candidates, "plain": plain}, rounds=iters, iters=1, warmup=3, device=device, group=group)
        if profile:  # every rank runs the rounds (collectives must match); rank 0 prints
            for kind, fn in candidates.items():
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                if rank == 0:
                    print(f"--- {kind}")
                    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20,
                                                    max_name_column_width=60))
    nbytes = torch.tensor([per_rank_bytes], device=device, dtype=torch.float64)
    dist.all_reduce(nbytes, op=dist.ReduceOp.MAX, group=group)
    nbytes = float(nbytes)
    bus = {kind: 2 * nbytes * (world - 1) / world / (t.ms / 1e3) / 1e9 for kind, t in times.items()}  # GB/s
    if rank == 0:
        print(f"EP {name}: ep={world} tokens/rank={tokens} top-{k} dim={dim} ({dtype}, {device.type}); "
              f"{nbytes / 2**20:.1f} MiB per rank each way")
        for kind in candidates:
            t = times[kind]
            print(f"  dispatch+combine [{kind:8s}] {t.ms:8.2f} ms  bus {bus[kind]:7.1f} GB/s  "
                  f"ratio {ratio(times['plain'], t)['median']:.2f} of the plain all-to-all bandwidth at the same bytes")
        print(f"  plain all-to-all x2 {times['plain'].ms:6.2f} ms  bus {bus['plain']:7.1f} GB/s")
    emit("moe_layer", {"mode": "ep", "shape": name, "ep": world, "tokens_per_rank": tokens, "top_k": k, "dim": dim,
                       "dtype": str(dtype), "bytes_per_rank": nbytes, "weigh_in_experts": True,
                       "timings": {kind: t.summary() for kind, t in times.items()}, "bus_GBps": bus,
                       "vs_plain": {kind: ratio(times["plain"], times[kind]) for kind in candidates}}, device)


def d_splits(routing, e: int, world: int) -> list[int]:
    """Rows this rank sends to each EP rank for this routing (the dispatch's input splits)."""
    counts = torch.bincount(routing.indices.reshape(-1), minlength=e)
    return counts.view(world, -1).sum(1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mixtral,fine64,fine128")
    parser.add_argument("--iters", type=int, default=10, help="interleaved timing rounds")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    parser.add_argument("--ep", action="store_true", help="expert-parallel dispatch mode (torchrun)")
    parser.add_argument("--dispatchers", default="alltoall",
                        help="EP mode: dispatchers to time in the same run (alltoall, allgather)")
    parser.add_argument("--routing", choices=["router", "balanced"], default="router",
                        help="layer mode: the router's own choice, or an exactly balanced one (R/E rows per expert)")
    parser.add_argument("--compile", action="store_true",
                        help="layer mode: torch.compile the layer and the dense MLP, as the trainer's compiled blocks")
    parser.add_argument("--profile", action="store_true",
                        help="print a profiler table of 3 steps (EP mode: of 3 dispatch+combine rounds, GPU only)")
    parser.add_argument("--trace", metavar="FILE",
                        help="layer mode with --profile and one shape: write the profiled steps' Chrome trace to FILE")
    parser.add_argument("--back-to-back", type=int, default=1, metavar="K",
                        help="layer mode: calls per timed round, queued one after another (default 1)")
    parser.add_argument("--host-ahead", action="store_true",
                        help="layer mode: queue each round behind a sleeping GPU kernel (the GPU's time alone)")
    args = parser.parse_args()
    table = TINY if args.tiny else SHAPES
    names = args.shapes.split(",")
    for n in names:
        if n not in table:
            parser.error(f"--shapes: unknown shape {n!r}; choose from {', '.join(table)}")
    if args.back_to_back < 1:
        parser.error(f"--back-to-back must be >= 1 calls per round, got {args.back_to_back}")
    if args.host_ahead and args.ep:
        parser.error("--host-ahead is for layer mode (EP rounds are timed after a barrier)")
    if args.trace and not (args.profile and not args.ep and len(names) == 1):
        parser.error("--trace needs --profile, layer mode and one shape (--shapes NAME)")
    cuda = torch.cuda.is_available() and not args.tiny
    if args.ep:
        _, _, device = init_distributed("nccl" if cuda else "gloo")
    else:
        device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for n in names:
        if args.ep:
            bench_ep(n, table[n], args.iters, device, dtype, args.profile and device.type == "cuda",
                     tuple(args.dispatchers.split(",")))
        else:
            bench_layer(n, table[n], args.iters, device, dtype, args.profile, args.routing, args.compile,
                        args.back_to_back, args.trace, args.host_ahead)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.ep:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
