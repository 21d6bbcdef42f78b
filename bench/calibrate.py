"""Measure the planner's calibration table on this machine's GPUs (core/planner/calibration.py).

    python -m bench.calibrate --out FILE        # then: tessera-plan ... --calibration FILE

On one GPU (about 1-2 minutes on an H100): bf16 GEMM rates on the planner's M x N x K grid,
the routed experts' grouped GEMM against dense GEMMs of the per-expert shape, Tessera's FP8
linear against bf16 (forward + backward, quantisers included), causal attention forward and
backward by document length (the model's own attention call, cuDNN for whole rows),
memory-bound copies by size and the per-kernel cost, host-to-device copies (offload), and the
host's time to issue an eager block's forward and backward (a dense ~1B block and a
DeepSeek-like MoE block at a few tokens, where the GPU waits for the host). With several
GPUs visible it also measures the collectives inside this node (NCCL, one process per GPU):
all-reduce, reduce-scatter, all-gather and all-to-all bus bandwidth at 8, 64 and 256 MiB over
groups of 2, 4, 8 ... GPUs up to all of them, and point-to-point sends. What one node cannot measure (the network between
nodes, ring-attention blocks, FP8 grouped GEMMs, the allocator's overheads) keeps the shipped
table's values; the file's `notes` say which entries were measured and which were kept.
Timing: CUDA events, the median of several calls after a warm-up (bench.harness.time_call).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.harness import time_call
from bench.train_step import model_config
from core.attention import varlen_attention
from core.precision.blockwise import fp8_linear
from core.layers import AttentionMeta, rotary_tables
from core.train.model import build_model
from core.planner.calibration import COLLECTIVES, DEFAULT_PATH, Calibration, CalibrationError, default_path
from moe.experts import expert_mm

MiB = 1 << 20


@dataclass(frozen=True)
class Setup:
    """Where and at which sizes to measure: the GPU's, or a seconds-long CPU smoke of the same code."""

    device: str = "cuda"
    attention_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    attention_tokens: int = 32768
    heads: tuple[int, int, int] = (32, 8, 128)  # q heads, kv heads, head_dim
    memory_sizes: tuple[int, ...] = (1 << 17, 1 << 20, 1 << 24, 1 << 28, 1 << 31)
    collective_sizes: tuple[int, ...] = (8 * MiB, 64 * MiB, 256 * MiB)
    grouped: tuple[int, int, int, int] = (131072, 64, 2048, 1408)  # rows, experts, k, n
    linear: tuple[int, int, int] = (16384, 4096, 14336)
    model_dim: int = 0  # 0: the bench models' own sizes

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


SMOKE = Setup("cpu", (64, 128), 256, (4, 2, 16), (1 << 12, 1 << 16), (1 << 12,), (256, 4, 32, 16), (64, 32, 64), 64)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, reps: int = 5, warmup: int = 2, device: str = "cuda") -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    return statistics.median(time_call(fn, device=device) for _ in range(reps))


def _device_ms(fn, calls: int = 20, device: str = "cuda") -> float:
    """The device's milliseconds per call, without the host's gaps: `calls` calls captured in
    one CUDA graph and replayed. A single call between two events also times the host issuing
    it (~10 us), which dominates small kernels; inside a training step the host runs ahead of
    the GPU and those gaps vanish (where it does not, the host model prices them). Where the
    call cannot be captured: the calls queued back to back."""
    if device != "cuda":
        return _median_ms(fn, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # library handles and workspaces created outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return statistics.median(time_call(fn, iters=calls, device=device) for _ in range(5))
    ms = _median_ms(graph.replay, reps=5, warmup=1, device=device) / calls
    del graph
    return ms


def measure_gemms(grid: list[int], log, dev: str = "cuda") -> list:
    """TFLOP/s of torch.mm in bf16 at every (m, n, k) of the grid."""
    big = max(grid)
    a = torch.randn(big, big, device=dev, dtype=torch.bfloat16)
    b = torch.randn(big, big, device=dev, dtype=torch.bfloat16)
    table = []
    for m in grid:
        rows = []
        for n in grid:
            cols = []
            for k in grid:
                x, w = a[:m, :k], b[:k, :n]
                flops = 2.0 * m * n * k
                ms = _device_ms(lambda: torch.mm(x, w), calls=1 if flops > 1e12 else 20, device=dev)
                cols.append(max(round(flops / (ms * 1e-3) / 1e12, 3), 1e-3))
            rows.append(cols)
        table.append(rows)
        log(f"gemm m={m}: " + " ".join(f"{max(c):.0f}" for c in rows) + " TFLOP/s (best k per n)")
    del a, b
    if dev == "cuda":
        torch.cuda.empty_cache()
    return table


def measure_grouped(cal: Calibration, log, setup: Setup) -> float:
    """Grouped GEMM time against `cal`'s dense per-expert estimate (the fine-grained MoE shape)."""
    rows, experts, k, n = setup.grouped
    x = torch.randn(rows, k, device=setup.device, dtype=torch.bfloat16)
    w = torch.randn(experts, k, n, device=setup.device, dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device=setup.device, dtype=torch.int32) * (rows // experts)
    ms = _median_ms(lambda: expert_mm(x, w, offsets), device=setup.device)
    efficiency = cal.grouped_gemm_s(rows, experts, n, k) * cal.grouped_efficiency / (ms * 1e-3)
    log(f"grouped gemm E={experts} rows={rows} {k}->{n}: {2 * rows * k * n / ms / 1e9:.0f} TFLOP/s, "
        f"{efficiency:.2f} of dense per-expert GEMMs")
    return round(efficiency, 3)


def measure_fp8_linear(log, setup: Setup) -> float | None:
    """Tessera's FP8 linear against bf16, forward + backward (16384 x 4096 -> 14336 on the GPU)."""
    if not setup.cuda:
        return None  # the CPU runs FP8 as an exact emulation: no speed to measure
    m, k, n = setup.linear
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        return lambda: fn(x, w).backward(grad)

    try:
        fp8 = _median_ms(run(fp8_linear))
    except (RuntimeError, NotImplementedError) as err:  # no FP8 kernels on this GPU or build
        log(f"fp8 linear: not measured ({str(err).splitlines()[0]})")
        return None
    bf16 = _median_ms(run(torch.nn.functional.linear))
    log(f"fp8 linear fwd+bwd: {fp8:.2f} ms against bf16 {bf16:.2f} ms: {bf16 / fp8:.2f}x")
    return round(bf16 / fp8, 3)


def measure_attention(log, setup: Setup) -> list:
    """Causal attention TFLOP/s (forward, backward) by document length (32 q / 8 kv heads of 128)."""
    out, dev = [], setup.device
    hq, hkv, hd = setup.heads
    for length in setup.attention_lengths:
        docs = max(1, setup.attention_tokens // length)
        total = docs * length
        q = torch.randn(total, hq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, hkv, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, hkv, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        cu = torch.arange(0, total + 1, length, device=dev, dtype=torch.int32)
        grad = torch.randn(total, hq, hd, device=dev, dtype=torch.bfloat16)
        fwd = _median_ms(lambda: varlen_attention(q, k, v, cu, length), device=dev)
        both = _median_ms(lambda: varlen_attention(q, k, v, cu, length).backward(grad), device=dev)
        flops = 2.0 * length * length * hq * hd * docs
        row = [length, round(flops / (fwd * 1e-3) / 1e12, 3), round(2.5 * flops / (max(both - fwd, 1e-6) * 1e-3) / 1e12, 3)]
        out.append(row)
        log(f"attention {docs} x {length}: fwd {row[1]:.0f}, bwd {row[2]:.0f} TFLOP/s")
    return out


def measure_memory(log, setup: Setup) -> tuple[list, float]:
    """Copy bandwidth (read + write bytes) by size, and the device's cost per small kernel."""
    out, dev = [], setup.device
    for size in setup.memory_sizes:
        src = torch.empty(size // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ms = _device_ms(lambda: dst.copy_(src), calls=20 if size < 1 << 28 else 1, device=dev)
        out.append([float(size), round(size / (ms * 1e-3) / 1e9, 3)])
    tiny = torch.zeros(1, device=dev)
    per_kernel_us = _device_ms(lambda: tiny.add_(1), calls=200, device=dev) * 1e3
    log("memory: " + ", ".join(f"{int(s) >> 10} KiB {g:.0f} GB/s" for s, g in out) + f"; {per_kernel_us:.1f} us per kernel")
    return out, round(per_kernel_us, 2)


def measure_pcie(log, setup: Setup) -> float | None:
    if not setup.cuda:
        return None
    host = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    down = _median_ms(lambda: host.copy_(dev, non_blocking=True))
    up = _median_ms(lambda: dev.copy_(host, non_blocking=True))
    gbps = 256 * MiB / (max(down, up) * 1e-3) / 1e9
    log(f"pinned host copies 256 MiB: {gbps:.1f} GB/s (the slower direction)")
    return round(gbps, 1)


def measure_host(log, setup: Setup) -> dict[str, float]:
    """Host microseconds to issue one eager block's forward and backward, at few tokens (GPU idle)."""
    out, dev = {}, setup.device
    tokens = 256
    pos = torch.arange(tokens, device=dev)
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, tokens], device=dev, dtype=torch.int32), max_seqlen=tokens,
                         total_tokens=tokens)
    for name, moe in (("dense", False), ("moe", True)):
        cfg = model_config(2, moe)
        if setup.model_dim:  # the smoke's small model (as bench.train_step --dim)
            cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size = setup.model_dim, \
                setup.model_dim * 2, 4, 2, 512
            cfg.moe.ffn_dim = setup.model_dim // 2 if moe else 0
        model = build_model(cfg, seed=0).to(dev, torch.bfloat16)
        block = model.layers["1"]  # the second block: MoE in the DeepSeek-like model
        rope = rotary_tables(pos, model.rope_inv_freq.to(dev), model.rope_scale)
        h = torch.randn(tokens, cfg.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)

        def step(block=block):  # bound now: the loop deletes its name after timing
            block(h, rope, meta).float().sum().backward()

        for _ in range(3):
            step()
        _sync(dev)
        start = time.perf_counter()
        for _ in range(20):
            step()
        _sync(dev)
        out[name] = round((time.perf_counter() - start) / 20 * 1e6, 0)
        del model, block
        log(f"host time of one eager {name} block, forward + backward: {out[name]:.0f} us")
    if setup.cuda:
        torch.cuda.empty_cache()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, queue, setup: Setup) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = setup.device
    if setup.cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:  # the smoke: gloo, and all-reduce stands in for what gloo lacks
        dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = sorted({g for g in (2, 4, 8, 16) if g <= world} | {world})
    groups = {g: dist.new_group(list(range(g))) for g in sizes}  # every rank takes part in creating each
    results: dict[str, dict[str, list]] = {op: {} for op in COLLECTIVES}
    for g in sizes:
        dist.barrier()
        if rank >= g:
            continue
        group = groups[g]
        for size in setup.collective_sizes:
            elems = size // 2
            buf = torch.randn(elems, device=dev, dtype=torch.bfloat16 if setup.cuda else torch.float32)
            out = torch.empty_like(buf)
            shard = torch.empty(elems // g, device=dev, dtype=buf.dtype)
            calls = {
                "all_reduce": lambda: dist.all_reduce(buf, group=group),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, buf, group=group),
                "all_gather": lambda: dist.all_gather_into_tensor(out, shard, group=group),
                "all_to_all": lambda: dist.all_to_all_single(out, buf, group=group),
            }
            if not setup.cuda:
                calls = {op: calls["all_reduce"] for op in calls}
            for op, call in calls.items():
                ms = _median_ms(call, device=dev)
                factor = (g - 1) / g * (2 if op == "all_reduce" else 1)
                results[op].setdefault(str(g), []).append([size, round(factor * size / (ms * 1e-3) / 1e9, 1)])
    dist.barrier()
    p2p = None
    if rank < 2:
        data = torch.randn(setup.collective_sizes[-1] // 2, device=dev, dtype=torch.bfloat16)
        into = torch.empty_like(data)
        peer = 1 - rank

        def exchange():
            ops = [dist.P2POp(dist.isend, data, peer, groups[2]), dist.P2POp(dist.irecv, into, peer, groups[2])]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        p2p = round(data.numel() * 2 / (_median_ms(exchange, device=dev) * 1e-3) / 1e9, 3)
    if rank == 0:
        queue.put((results, p2p))
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(world: int, log, setup: Setup) -> tuple[dict, float | None]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_worker, args=(r, world, port, queue, setup)) for r in range(world)]
    for p in procs:
        p.start()
    results, p2p = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    for op, by_size in results.items():
        for group, rows in by_size.items():
            log(f"{op} over {group} GPUs: " + ", ".join(f"{s // MiB} MiB {g:.0f} GB/s" for s, g in rows))
    log(f"send/recv between 2 GPUs, {setup.collective_sizes[-1] // MiB} MiB: {p2p} GB/s")
    return results, p2p


def calibrate(base: Calibration, log=print, collectives: bool = True, setup: Setup = Setup(),
              grid: list[int] | None = None, world: int | None = None) -> Calibration:
    """A table measured here, on top of `base` for what one node cannot measure. `setup`,
    `grid` and `world` other than the defaults: the CPU smoke of the same code."""
    started = time.time()
    cal = Calibration.from_dict(base.to_dict(), base.path)
    measured, kept = [], []
    if grid:
        cal.gemm_grid = grid
    cal.gemm_tflops = {"bf16": measure_gemms(cal.gemm_grid, log, setup.device)}
    cal._gemm_cache.clear()
    measured.append("gemm_tflops")
    cal.grouped_efficiency = measure_grouped(cal, log, setup)
    measured.append("grouped_efficiency")
    fp8 = measure_fp8_linear(log, setup)
    if fp8:
        cal.fp8_speedup = dict(cal.fp8_speedup, linear=fp8)
        measured.append("fp8_speedup.linear")
    cal.attention_tflops = measure_attention(log, setup)
    cal.memory_gbps, cal.launch_us = measure_memory(log, setup)
    pcie = measure_pcie(log, setup)
    if pcie:
        cal.pcie_gbps = pcie
        measured.append("pcie_gbps")
    cal.host_us_per_block = measure_host(log, setup)
    measured += ["attention_tflops", "memory_gbps", "launch_us", "host_us_per_block"]
    gpus = world or torch.cuda.device_count()
    if setup.cuda:
        torch.cuda.empty_cache()  # the workers share GPU 0 with this process
    if collectives and gpus > 1:
        table, p2p = measure_collectives(gpus, log, setup)
        cal.collectives = dict(cal.collectives, intra=table)
        measured.append(f"collectives.intra (groups of up to {gpus} GPUs)")
        if p2p:
            cal.p2p_gbps = dict(cal.p2p_gbps, intra=p2p)
            measured.append("p2p_gbps.intra")
    else:
        kept.append("collectives.intra, p2p_gbps.intra (one GPU visible)")
    kept += ["collectives.inter", "p2p_gbps.inter", "latency_us", "ring_efficiency", "fp8_speedup.grouped",
             "allocator"] + ([] if fp8 else ["fp8_speedup.linear"]) + ([] if pcie else ["pcie_gbps"])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    cal.device = torch.cuda.get_device_name() if setup.cuda else "cpu (smoke)"
    cal.source = f"measured by bench.calibrate on {cal.device}, {date}, torch {torch.__version__}"
    cal.notes = [f"measured: {', '.join(measured)}", f"kept from {Path(base.path).name}: {', '.join(kept)}"]
    log(f"calibrated in {time.time() - started:.0f} s")
    return cal


def shipped_table(device_name: str | None = None) -> Path:
    """The shipped table of this GPU kind: by `device_name`, else `torch.cuda.get_device_name()` on a
    GPU (`core.planner.calibration.default_path`); the H100 table for any other (or no) GPU."""
    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
    return (default_path(device_name) if device_name else None) or DEFAULT_PATH


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the calibration JSON to write")
    parser.add_argument("--base", default=None, help="table whose values are kept for what is not measured "
                                                     "(default: the shipped table of this GPU kind, "
                                                     "e.g. h200_default.json on an H200; else the H100 one)")
    parser.add_argument("--no-collectives", action="store_true", help="skip the multi-GPU collectives")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not torch.cuda.is_available():
        print("bench.calibrate: needs a CUDA GPU (it measures the GPU it runs on); none is visible here", file=sys.stderr)
        return 2
    if not out.absolute().parent.is_dir():
        print(f"bench.calibrate: --out {out}: the folder {out.absolute().parent} does not exist", file=sys.stderr)
        return 2
    try:
        base = Calibration.load(args.base or shipped_table())
    except CalibrationError as err:
        print(f"bench.calibrate: {err}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    cal = calibrate(base, collectives=not args.no_collectives)
    cal.save(out)
    print(f"wrote {out}: tessera-plan ... --calibration {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
