"""Benchmark: tokens/s the data service delivers through real DataClients, 1 and 8 streams.

Starts a real `tessera-data serve` process over a generated long-tailed dataset, then runs
N client processes (one per data-parallel rank, as trainers would) that read through
`DataClient`. Prints, per stream count: delivered tokens/s (row slots, B*S per batch) and
real tokens/s, packing efficiency, and the client's time per `next()` with a warm queue
(the consumer sleeps like a training step, so the prefetch queue is full).

Baseline in the same run: the StreamPlan alone (`plan.rows` + message building +
serialisation, in one process, no gRPC), i.e. what one core can produce, its three phases timed
in interleaved rounds (bench.harness, on the CPU clock); the service's tokens/s are also given
as a ratio to it. The service figures are the clients' own: tokens over the common interval of
all streams. Ends with one record (JSON line).

    python -m bench.dataservice                 # defaults: seq_len 8192, B 4, 1 and 8 streams
    python -m bench.dataservice --streams 1 2 8 --batches 300
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import protos
from bench.harness import compare, emit
from dataservice.build import build_dataset, make_corpus
from dataservice.client import DataClient
from dataservice.plan import StreamPlan, rows_for
from dataservice.server import DataServicer
from dataservice.shards import ShardedDataset
from dataservice.tokens import ResumeToken

ROOT = Path(__file__).resolve().parents[1]


def make_dataset(folder: Path, docs: int) -> Path:
    """A long-tailed corpus (34 .. 32k tokens per document, byte tokenizer) built into shards."""
    corpus = make_corpus(folder, docs, seed=11, min_len=32, max_len=32768)
    return Path(build_dataset([corpus], folder / "web", progress=False, overwrite=True))


def plan_baseline(path: Path, seq_len: int, batch: int, rounds: int = 5, iters: int = 20) -> dict:
    """Single-process cost of what the server does per batch, without gRPC: the rows of the next
    step, its message, the message's serialisation, timed in interleaved rounds."""
    protos.load()  # generates the message modules on first use
    ds = ShardedDataset.open(path)
    plan = StreamPlan([ds], [1.0], seed=0, seq_len=seq_len)
    state = {"step": 0, "anchor": plan.start_anchor()}

    def rows():
        state["mb"], state["anchor"] = plan.rows(rows_for(state["step"], 0, 1, batch), state["anchor"])
        state["step"] += 1

    def message():
        token = ResumeToken(plan.fingerprint, "0" * 16, (("web", 1.0),), 0, seq_len,
                            state["step"] * batch, state["anchor"].to_dict()).encode()
        state["msg"] = DataServicer._message(state["mb"], state["step"] - 1, batch, seq_len, token)

    def serialize():
        state["msg"].SerializeToString()

    rows(), message()  # the first message exists before any candidate runs
    times = compare({"rows": rows, "message": message, "serialize": serialize}, rounds=rounds, iters=iters,
                    warmup=1, device="cpu")
    ds.close()
    tokens = batch * seq_len
    per_batch_s = sum(t.ms for t in times.values()) / 1e3
    return {
        "rows_ms": times["rows"].ms, "message_ms": times["message"].ms, "serialize_ms": times["serialize"].ms,
        "timings": {name: t.summary() for name, t in times.items()},
        "tokens_per_s": tokens / per_batch_s, "rows_tokens_per_s": tokens / (times["rows"].ms / 1e3),
    }


def client_main(args) -> None:
    """One trainer rank: warm up, wait for "go", read `--batches` as fast as possible, then
    time next() with a warm queue while sleeping like a training step."""
    client = DataClient(args.address, dp_rank=args.dp_rank, dp_size=args.dp_size, seq_len=args.seq_len,
                        micro_batch_size=args.micro_batch_size, prefetch=args.prefetch, consumer="bench")
    for _ in range(3):
        next(client)
    print("ready", flush=True)
    sys.stdin.readline()
    slots = real = 0
    start = time.monotonic()
    for _ in range(args.batches):
        b = next(client)
        slots += b.tokens.numel()
        real += b.num_tokens
    end = time.monotonic()
    waits = []
    for _ in range(args.warm_steps):
        time.sleep(args.step_sleep)  # a training step: the prefetch thread fills the queue meanwhile
        t0 = time.perf_counter()
        next(client)
        waits.append(time.perf_counter() - t0)
    client.close()
    print(json.dumps({"start": start, "end": end, "slots": slots, "real": real, "waits": waits}), flush=True)


def run_streams(address: str, n: int, args) -> dict:
    """n client processes, one per dp rank; aggregate throughput over the common interval."""
    procs = []
    for rank in range(n):
        cmd = [sys.executable, "-m", "bench.dataservice", "--client", "--address", address, "--dp-rank", str(rank),
               "--dp-size", str(n), "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
               "--batches", str(args.batches), "--prefetch", str(args.prefetch),
               "--warm-steps", str(args.warm_steps), "--step-sleep", str(args.step_sleep)]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT))
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"bench client failed to start: {line!r}")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait(60)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    waits = sorted(w for r in results for w in r["waits"])
    slots, real = sum(r["slots"] for r in results), sum(r["real"] for r in results)
    return {
        "streams": n, "seconds": span, "tokens_per_s": slots / span, "real_tokens_per_s": real / span,
        "efficiency": real / slots, "next_median_us": 1e6 * statistics.median(waits),
        "next_p99_us": 1e6 * waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "per_stream_tokens_per_s": [r["slots"] / (r["end"] - r["start"]) for r in results],
    }


def start_server(path: Path, workers: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A `serve` process; its log goes to `log` (a pipe nobody reads would block it)."""
    proc = subprocess.Popen([sys.executable, "-m", "dataservice.cli", "serve", "--data", str(path), "--port", "0",
                             "--workers", str(workers)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("serving on "):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--dp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dp-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help="an existing dataset folder (default: generate one)")
    p.add_argument("--docs", type=int, default=8000, help="documents to generate (default 8000, ~22M tokens)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=150, help="batches each stream reads in the timed phase")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=128)
    args = p.parse_args()
    if args.client:
        return client_main(args)

    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        path = args.data or make_dataset(Path(tmp), args.docs)
        base = plan_baseline(path, args.seq_len, args.micro_batch_size)
        server, address = start_server(path, args.workers, Path(tmp) / "server.log")
        try:
            rows = [run_streams(address, n, args) for n in args.streams]
        finally:
            server.terminate()
            server.wait(30)
    cores = os.cpu_count()
    print(f"\ndata service benchmark: seq_len {args.seq_len}, micro_batch_size {args.micro_batch_size}, "
          f"{args.batches} batches per stream, {cores} CPU cores, one server process, one client process per stream")
    print(f"baseline (one process, no gRPC): plan.rows {base['rows_ms']:.2f} ms/batch "
          f"({base['rows_tokens_per_s'] / 1e6:.1f} M tok/s), message build {base['message_ms']:.3f} ms, "
          f"serialise {base['serialize_ms']:.3f} ms -> {base['tokens_per_s'] / 1e6:.1f} M tok/s")
    print(f"{'streams':>7} {'M tok/s':>9} {'real M tok/s':>12} {'vs baseline':>11} {'efficiency':>10} "
          f"{'next() median':>13} {'next() p99':>11} {'per stream M tok/s':>20}")
    for r in rows:
        per = ", ".join(f"{x / 1e6:.2f}" for x in r["per_stream_tokens_per_s"])
        print(f"{r['streams']:>7} {r['tokens_per_s'] / 1e6:>9.2f} {r['real_tokens_per_s'] / 1e6:>12.2f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:>10.2f}x {r['efficiency']:>10.4f} "
              f"{r['next_median_us']:>11.0f}us {r['next_p99_us']:>9.0f}us  {per}")
    emit("dataservice", {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size, "cpu_cores": cores,
                         "baseline": base, "streams": [dict(r, vs_baseline=r["tokens_per_s"] / base["tokens_per_s"])
                                                       for r in rows]}, device="cpu")


if __name__ == "__main__":
    main()
