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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.harness import time_call
from bench.train_step import model_config
from core.attention import varlen_attention
from core.fp8 import fp8_linear
from core.layers import AttentionMeta, rotary_tables
from core.model import build_model
from core.planner.calibration import COLLECTIVES, Calibration, CalibrationError
from moe.experts import grouped_mm
from moe.layer import set_moe_sequences

MiB = 1 << 20
COLLECTIVE_SIZES = (8 * MiB, 64 * MiB, 256 * MiB)
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
MEMORY_SIZES = (1 << 17, 1 << 20, 1 << 24, 1 << 28, 1 << 31)


def _median_ms(fn, reps: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(time_call(fn) for _ in range(reps))


def measure_gemms(grid: list[int], log) -> list:
    """TFLOP/s of torch.mm in bf16 at every (m, n, k) of the grid."""
    big = max(grid)
    a = torch.randn(big, big, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(big, big, device="cuda", dtype=torch.bfloat16)
    table = []
    for m in grid:
        rows = []
        for n in grid:
            cols = []
            for k in grid:
                x, w = a[:m, :k], b[:k, :n]
                flops = 2.0 * m * n * k
                reps = 3 if flops > 1e14 else 5
                ms = _median_ms(lambda: torch.mm(x, w), reps=reps, warmup=1)
                cols.append(round(flops / (ms * 1e-3) / 1e12, 1))
            rows.append(cols)
        table.append(rows)
        log(f"gemm m={m}: " + " ".join(f"{max(c):.0f}" for c in rows) + " TFLOP/s (best k per n)")
    del a, b
    torch.cuda.empty_cache()
    return table


def measure_grouped(cal: Calibration, log) -> float:
    """Grouped GEMM time against `cal`'s dense per-expert estimate (the fine-grained MoE shape)."""
    rows, experts, k, n = 131072, 64, 2048, 1408
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, k, n, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
    ms = _median_ms(lambda: grouped_mm(x, w, offsets))
    efficiency = cal.grouped_gemm_s(rows, experts, n, k) * cal.grouped_efficiency / (ms * 1e-3)
    log(f"grouped gemm E={experts} rows={rows} {k}->{n}: {2 * rows * k * n / ms / 1e9:.0f} TFLOP/s, "
        f"{efficiency:.2f} of dense per-expert GEMMs")
    return round(efficiency, 3)


def measure_fp8_linear(log) -> float | None:
    """Tessera's FP8 linear against bf16, forward + backward, at 16384 x 4096 -> 14336."""
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(16384, 14336, device="cuda", dtype=torch.bfloat16)

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


def measure_attention(log) -> list:
    """Causal attention TFLOP/s (forward, backward) by document length, 32 q / 8 kv heads of 128."""
    out = []
    for length in ATTENTION_LENGTHS:
        docs = max(1, 32768 // length)
        total = docs * length
        q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cu = torch.arange(0, total + 1, length, device="cuda", dtype=torch.int32)
        meta = AttentionMeta(cu_seqlens=cu, max_seqlen=length)
        grad = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16)
        fwd = _median_ms(lambda: varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen))
        both = _median_ms(lambda: varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen).backward(grad))
        flops = 2.0 * length * length * 32 * 128 * docs
        row = [length, round(flops / (fwd * 1e-3) / 1e12, 1), round(2.5 * flops / ((both - fwd) * 1e-3) / 1e12, 1)]
        out.append(row)
        log(f"attention {docs} x {length}: fwd {row[1]:.0f}, bwd {row[2]:.0f} TFLOP/s")
    return out


def measure_memory(log) -> tuple[list, float]:
    """Copy bandwidth (read + write bytes) by size, and the GPU's cost per small kernel."""
    out = []
    for size in MEMORY_SIZES:
        src = torch.empty(size // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = _median_ms(lambda: dst.copy_(src))
        out.append([float(size), round(size / (ms * 1e-3) / 1e9, 1)])
    tiny = torch.zeros(1, device="cuda")
    per_kernel_us = _median_ms(lambda: [tiny.add_(1) for _ in range(200)]) * 1e3 / 200
    log("memory: " + ", ".join(f"{int(s) >> 10} KiB {g:.0f} GB/s" for s, g in out) + f"; {per_kernel_us:.1f} us per kernel")
    return out, round(per_kernel_us, 2)


def measure_pcie(log) -> float:
    host = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    down = _median_ms(lambda: host.copy_(dev, non_blocking=True))
    up = _median_ms(lambda: dev.copy_(host, non_blocking=True))
    gbps = 256 * MiB / (max(down, up) * 1e-3) / 1e9
    log(f"pinned host copies 256 MiB: {gbps:.1f} GB/s (the slower direction)")
    return round(gbps, 1)


def measure_host(log) -> dict[str, float]:
    """Host microseconds to issue one eager block's forward and backward, at few tokens (GPU idle)."""
    out = {}
    tokens = 256
    pos = torch.arange(tokens, device="cuda")
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, tokens], device="cuda", dtype=torch.int32), max_seqlen=tokens)
    for name, moe in (("dense", False), ("moe", True)):
        cfg = model_config(2, moe)
        model = build_model(cfg, seed=0).to("cuda", torch.bfloat16)
        block = model.layers["1"]  # the second block: MoE in the DeepSeek-like model
        rope = rotary_tables(pos, model.rope_inv_freq.to("cuda"), model.rope_scale)
        h = torch.randn(tokens, cfg.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        set_moe_sequences(model, meta.cu_seqlens, tokens)

        def step():
            block(h, rope, meta).float().sum().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        out[name] = round((time.perf_counter() - start) / 20 * 1e6, 0)
        del model, block
        log(f"host time of one eager {name} block, forward + backward: {out[name]:.0f} us")
    torch.cuda.empty_cache()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    sizes = sorted({g for g in (2, 4, 8, 16) if g <= world} | {world})
    groups = {g: dist.new_group(list(range(g))) for g in sizes}  # every rank takes part in creating each
    results: dict[str, dict[str, list]] = {op: {} for op in COLLECTIVES}
    for g in sizes:
        dist.barrier()
        if rank >= g:
            continue
        group = groups[g]
        for size in COLLECTIVE_SIZES:
            elems = size // 2
            buf = torch.randn(elems, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(buf)
            shard = torch.empty(elems // g, device="cuda", dtype=torch.bfloat16)
            calls = {
                "all_reduce": lambda: dist.all_reduce(buf, group=group),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, buf, group=group),
                "all_gather": lambda: dist.all_gather_into_tensor(out, shard, group=group),
                "all_to_all": lambda: dist.all_to_all_single(out, buf, group=group),
            }
            for op, call in calls.items():
                ms = _median_ms(call)
                factor = (g - 1) / g * (2 if op == "all_reduce" else 1)
                results[op].setdefault(str(g), []).append([size, round(factor * size / (ms * 1e-3) / 1e9, 1)])
    dist.barrier()
    p2p = None
    if rank < 2:
        data = torch.randn(64 * MiB // 2, device="cuda", dtype=torch.bfloat16)
        into = torch.empty_like(data)
        peer = 1 - rank

        def exchange():
            ops = [dist.P2POp(dist.isend, data, peer, groups[2]), dist.P2POp(dist.irecv, into, peer, groups[2])]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        p2p = round(64 * MiB / (_median_ms(exchange) * 1e-3) / 1e9, 1)
    if rank == 0:
        queue.put((results, p2p))
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(world: int, log) -> tuple[dict, float | None]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, p2p = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    for op, by_size in results.items():
        for group, rows in by_size.items():
            log(f"{op} over {group} GPUs: " + ", ".join(f"{s // MiB} MiB {g:.0f} GB/s" for s, g in rows))
    log(f"send/recv between 2 GPUs, 64 MiB: {p2p} GB/s")
    return results, p2p


def calibrate(base: Calibration, log=print, collectives: bool = True) -> Calibration:
    """A table measured here, on top of `base` for what one node cannot measure."""
    started = time.time()
    cal = Calibration.from_dict(base.to_dict(), base.path)
    measured, kept = [], []
    cal.gemm_tflops = {"bf16": measure_gemms(cal.gemm_grid, log)}
    cal._gemm_cache.clear()
    measured.append("gemm_tflops")
    cal.grouped_efficiency = measure_grouped(cal, log)
    measured.append("grouped_efficiency")
    fp8 = measure_fp8_linear(log)
    if fp8:
        cal.fp8_speedup = dict(cal.fp8_speedup, linear=fp8)
        measured.append("fp8_speedup.linear")
    cal.attention_tflops = measure_attention(log)
    cal.memory_gbps, cal.launch_us = measure_memory(log)
    cal.pcie_gbps = measure_pcie(log)
    cal.host_us_per_block = measure_host(log)
    measured += ["attention_tflops", "memory_gbps", "launch_us", "pcie_gbps", "host_us_per_block"]
    gpus = torch.cuda.device_count()
    torch.cuda.empty_cache()  # the workers share GPU 0 with this process
    if collectives and gpus > 1:
        table, p2p = measure_collectives(gpus, log)
        cal.collectives = dict(cal.collectives, intra=table)
        measured.append(f"collectives.intra ({gpus} GPUs)")
        if p2p:
            cal.p2p_gbps = dict(cal.p2p_gbps, intra=p2p)
            measured.append("p2p_gbps.intra")
    else:
        kept.append("collectives.intra, p2p_gbps.intra (one GPU visible)")
    kept += ["collectives.inter", "p2p_gbps.inter", "latency_us", "ring_efficiency", "fp8_speedup.grouped",
             "allocator"] + ([] if fp8 else ["fp8_speedup.linear"])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    cal.device = torch.cuda.get_device_name()
    cal.source = f"measured by bench.calibrate on {cal.device}, {date}, torch {torch.__version__}"
    cal.notes = [f"measured: {', '.join(measured)}", f"kept from {Path(base.path).name}: {', '.join(kept)}"]
    log(f"calibrated in {time.time() - started:.0f} s")
    return cal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the calibration JSON to write")
    parser.add_argument("--base", default=None, help="table whose values are kept for what is not measured "
                                                     "(default: the shipped H100 table)")
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
        base = Calibration.load(args.base)
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
