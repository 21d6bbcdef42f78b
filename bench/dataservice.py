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

Load (`--seconds S`): one server, `--streams N` streams (dp ranks 0..N-1 of one job) read for S
seconds, as threads spread over `--client-procs` processes, each sleeping `--step-sleep` s after
each batch like a training step (default 0.05; 0: reading as fast as it can). Reports tokens/s per stream,
next() latency p50/p99, errors (client exceptions and the server's tessera_data_errors_total),
and the server's resident memory sampled from its metrics endpoint every `--sample-s` seconds.
`--rounds R` repeats this R times on one server and takes its memory after each round, once
the streams have closed (and the server's next `--trim-every` has passed): memory that only
grows from round to round is memory the server does not give back.
Loopback only; every loop ends at the deadline.

Secure (`--secure`): the same streams, each stream count read from two servers in turn — plain
(no token, no TLS, `--skip-verify`: no start-up checksum pass) and secure (a bearer token, TLS
with a CA made here by `openssl`, every shard's checksum verified at start) — printing both
tokens/s and secure/plain. What a stream reads is checked the same on both (each document's
hash on first read, token ids against the vocabulary on server and client: the service has no
switch for these), so the ratio is the price of TLS and the token on the wire. At scale, on a
host with the cores of a training node:

    python -m bench.dataservice --secure --streams 1 8 --seq-len 8192 --micro-batch-size 4 --batches 300

    python -m bench.dataservice --streams 64 --seconds 60 --seq-len 8192 --micro-batch-size 1 --step-sleep 0
    python -m bench.dataservice --streams 64 --seconds 40 --rounds 3 --step-sleep 0 --sample-s 10
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import protos
from bench.harness import compare, emit
from dataservice.auth import ClientAuth
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


def secure_files(folder: Path) -> dict[str, Path]:
    """A bearer-token file, a CA and a server certificate for 127.0.0.1 signed by it (openssl),
    keys private as the service demands."""
    folder.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    files = {name: folder / name for name in ("token", "ca.pem", "ca.key", "server.pem", "server.key", "server.csr",
                                              "server.ext")}

    def openssl(*args) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    files["token"].write_text(os.urandom(32).hex() + "\n")
    openssl("req", "-x509", *ec, "-keyout", files["ca.key"], "-out", files["ca.pem"], "-days", "1", "-subj",
            "/CN=bench-ca", "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
            "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", *ec, "-keyout", files["server.key"], "-out", files["server.csr"], "-subj", "/CN=bench-server")
    files["server.ext"].write_text("extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"
                                   "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", files["server.csr"], "-CA", files["ca.pem"], "-CAkey", files["ca.key"],
            "-CAcreateserial", "-out", files["server.pem"], "-days", "1", "-extfile", files["server.ext"])
    for name in ("token", "ca.key", "server.key"):
        os.chmod(files[name], 0o600)
    return files


def client_main(args) -> None:
    """One trainer rank: warm up, wait for "go", read `--batches` as fast as possible, then
    time next() with a warm queue while sleeping like a training step."""
    auth = ClientAuth.from_files(args.auth_token_file, args.tls_ca_file)
    client = DataClient(args.address, dp_rank=args.dp_rank, dp_size=args.dp_size, seq_len=args.seq_len,
                        micro_batch_size=args.micro_batch_size, prefetch=args.prefetch, consumer="bench", auth=auth)
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


def run_streams(address: str, n: int, args, client_auth: tuple[str, ...] = ()) -> dict:
    """n client processes, one per dp rank; aggregate throughput over the common interval.
    `client_auth`: the clients' --auth-token-file / --tls-ca-file arguments."""
    procs = []
    for rank in range(n):
        cmd = [sys.executable, "-m", "bench.dataservice", "--client", "--address", address, "--dp-rank", str(rank),
               "--dp-size", str(n), "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
               "--batches", str(args.batches), "--prefetch", str(args.prefetch),
               "--warm-steps", str(args.warm_steps), "--step-sleep", str(args.step_sleep), *client_auth]
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


def start_server(path: Path, workers: int, log: Path, metrics: bool = False,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    """A `serve` process on loopback: (process, address, metrics URL or ""); its log goes to `log`
    (a pipe nobody reads would block it)."""
    cmd = [sys.executable, "-m", "dataservice.cli", "serve", "--data", str(path), "--host", "127.0.0.1", "--port", "0",
           "--workers", str(workers), *extra] + (["--metrics-port", "0"] if metrics else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("serving on "):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    url = proc.stdout.readline().split()[-1] if metrics else ""  # printed right after the address
    return proc, line.split()[-1], url


# ---- load: many streams for a fixed time -------------------------------------------------

def load_client_main(args) -> None:
    """Streams first_rank .. first_rank+threads-1 of a dp_size job, one thread each: warm up,
    wait for "go", read until the deadline; then one JSON line with each stream's figures."""
    ranks = range(args.first_rank, args.first_rank + args.threads)
    clients = {r: DataClient(args.address, dp_rank=r, dp_size=args.dp_size, seq_len=args.seq_len,
                             micro_batch_size=args.micro_batch_size, prefetch=args.prefetch, consumer="bench-load")
               for r in ranks}
    results = {r: {"rank": r, "slots": 0, "real": 0, "batches": 0, "waits": [], "errors": []} for r in ranks}
    go = threading.Event()

    def stream(rank: int, warm: threading.Barrier) -> None:
        out, client = results[rank], clients[rank]
        try:
            next(client)
        except Exception as err:  # reported, counted as an error
            out["errors"].append(f"warm-up: {err!r}")
        warm.wait()
        go.wait()
        deadline = out["start"] = time.monotonic()
        deadline += args.seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                b = next(client)
            except Exception as err:
                out["errors"].append(repr(err))
                break
            out["waits"].append(time.perf_counter() - t0)
            out["slots"] += b.tokens.numel()
            out["real"] += b.num_tokens
            out["batches"] += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
        out["end"] = time.monotonic()

    warm = threading.Barrier(len(ranks) + 1)
    threads = [threading.Thread(target=stream, args=(r, warm), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    warm.wait()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for t in threads:
        t.join(args.seconds + 120)
    for client in clients.values():
        client.close()
    print(json.dumps(list(results.values())), flush=True)


def scrape(url: str) -> dict[str, float]:
    """The metrics endpoint's unlabelled samples, and errors summed over their codes."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {"errors": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tessera_data_errors_total":
                out["errors"] += sample.value
            elif not sample.labels:
                out[sample.name] = sample.value
    return out


def rss_split_mb(pid: int) -> dict[str, float]:
    """Anonymous and file-backed resident memory of a process (Linux): the LMDB shards are mapped,
    so the file part grows with the pages read, up to the shards' size, and is not a leak."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024
    return {"anon_mb": fields.get("RssAnon", 0.0), "file_mb": fields.get("RssFile", 0.0)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_load(path: Path, args, log: Path) -> dict:
    """One server, args.streams streams over args.client_procs processes for args.seconds, args.rounds
    times; after each round, once its streams have closed, the server's memory."""
    n = args.streams[0]
    workers = max(args.workers, n + 8)
    extra = () if args.trim_every is None else ("--trim-every", str(args.trim_every))
    server, address, url = start_server(path, workers, log, metrics=True, extra=extra)
    samples, rounds, streams = [], [], []
    try:
        t0 = time.monotonic()
        for _ in range(args.rounds):
            done = load_round(address, url, server, n, args, samples, t0)
            while scrape(url)["tessera_data_streams_active"]:
                time.sleep(0.2)
            time.sleep((args.trim_every or 0) + 1.5)  # past the server's next trim, if it trims
            per_stream = [s["slots"] / (s["end"] - s["start"]) for s in done]
            rounds.append({"tokens_per_s": sum(per_stream), **rss_split_mb(server.pid)})
            streams += done
        final = scrape(url)
        server.send_signal(signal.SIGTERM)  # a drain with no stream open: exit 0 at once
        server_exit = server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    streams.sort(key=lambda s: s["rank"])
    waits = [w for s in streams for w in s["waits"]]
    per_stream = [s["slots"] / (s["end"] - s["start"]) for s in streams]
    errors = [f"rank {s['rank']}: {e}" for s in streams for e in s["errors"]]
    half = [x for x in samples if x["t"] >= samples[-1]["t"] / 2] or samples[-1:]
    return {
        "streams": n, "seconds": args.seconds, "rounds": rounds, "client_procs": len(range(0, n, -(-n // args.client_procs))),
        "step_sleep": args.step_sleep,
        "tokens_per_s": sum(r["tokens_per_s"] for r in rounds) / len(rounds),
        "real_tokens_per_s": sum(s["real"] / (s["end"] - s["start"]) for s in streams) / len(rounds),
        "per_stream_tokens_per_s": {"min": min(per_stream), "median": statistics.median(per_stream),
                                    "max": max(per_stream)},
        "batches": sum(s["batches"] for s in streams),
        "next_p50_ms": 1e3 * percentile(waits, 0.5), "next_p99_ms": 1e3 * percentile(waits, 0.99),
        "next_max_ms": 1e3 * max(waits),
        "client_errors": errors, "server_errors": final["errors"], "server_exit": server_exit,
        "rss_mb": {key: {"first": samples[0][key], "half": half[0][key], "last": samples[-1][key],
                         "max": max(x[key] for x in samples)} for key in ("rss_mb", "anon_mb", "file_mb")},
        "samples": samples,
    }


def load_round(address: str, url: str, server: subprocess.Popen, n: int, args, samples: list, t0: float) -> list:
    """One round of the load: the client processes read for args.seconds while the server is
    sampled every args.sample_s (into `samples`, times from t0); returns each stream's figures."""
    procs = []
    try:
        per_proc = -(-n // args.client_procs)
        for first in range(0, n, per_proc):
            cmd = [sys.executable, "-m", "bench.dataservice", "--load-client", "--address", address,
                   "--first-rank", str(first), "--threads", str(min(per_proc, n - first)), "--dp-size", str(n),
                   "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
                   "--prefetch", str(args.prefetch), "--seconds", str(args.seconds),
                   "--step-sleep", str(args.step_sleep)]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT))
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a load client failed to start")
        start = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        lines, pending = {}, {p.stdout.fileno(): p for p in procs}
        next_sample = start
        while pending:  # sample the server while the clients run; collect each client's line
            if time.monotonic() >= next_sample:
                m = scrape(url)
                samples.append({"t": round(time.monotonic() - t0, 2), "rss_mb": m["process_resident_memory_bytes"] / 2**20,
                                **rss_split_mb(server.pid), "streams": m["tessera_data_streams_active"],
                                "tokens": m["tessera_data_tokens_total"], "errors": m["errors"]})
                next_sample += args.sample_s
            ready, _, _ = select.select(list(pending), [], [], max(0.0, next_sample - time.monotonic()))
            for fd in ready:
                lines[fd] = pending.pop(fd).stdout.readline()
            if time.monotonic() - start > args.seconds + 180:
                raise RuntimeError("load clients did not finish")
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [s for line in lines.values() for s in json.loads(line)]


def print_load(r: dict, base: dict, args) -> None:
    print(f"\ndata service load: {r['streams']} streams x {r['seconds']:g} s x {len(r['rounds'])} rounds, "
          f"seq_len {args.seq_len}, micro_batch_size {args.micro_batch_size}, {r['client_procs']} client processes, "
          f"step sleep {r['step_sleep']:g} s, {os.cpu_count()} CPU cores")
    print(f"baseline (one process, no gRPC): {base['tokens_per_s'] / 1e6:.1f} M tok/s")
    ps = r["per_stream_tokens_per_s"]
    print(f"all streams {r['tokens_per_s'] / 1e6:.2f} M tok/s ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x baseline), "
          f"per stream min/median/max {ps['min'] / 1e3:.0f} / {ps['median'] / 1e3:.0f} / {ps['max'] / 1e3:.0f} k tok/s, "
          f"{r['batches']} batches")
    print(f"next(): p50 {r['next_p50_ms']:.2f} ms, p99 {r['next_p99_ms']:.2f} ms, max {r['next_max_ms']:.1f} ms")
    print(f"errors: {len(r['client_errors'])} in clients, {r['server_errors']:g} counted by the server; "
          f"server exit code {r['server_exit']}")
    for e in r["client_errors"][:5]:
        print(f"  {e}")
    for key, name in (("rss_mb", "RSS"), ("anon_mb", "anonymous"), ("file_mb", "file-backed (mapped shards)")):
        m = r["rss_mb"][key]
        print(f"server {name} MiB: first {m['first']:.0f}, at half time {m['half']:.0f}, last {m['last']:.0f}, "
              f"max {m['max']:.0f}")
    print("samples (s: RSS/anon MiB): " + " ".join(f"{x['t']:.0f}:{x['rss_mb']:.0f}/{x['anon_mb']:.0f}"
                                                   for x in r["samples"]))
    print("after each round, its streams closed: " + ", ".join(
        f"anonymous {x['anon_mb']:.1f} MiB ({x['tokens_per_s'] / 1e6:.2f} M tok/s)" for x in r["rounds"]))


def secure_main(args) -> None:
    """Each stream count against the plain server, then the secure one; both figures and the ratio."""
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        path = args.data or make_dataset(Path(tmp), args.docs)
        files = secure_files(Path(tmp) / "secrets")
        modes = {
            "plain": (("--skip-verify",), ()),
            "secure": (("--auth-token-file", str(files["token"]), "--tls-cert", str(files["server.pem"]),
                        "--tls-key", str(files["server.key"])),
                       ("--auth-token-file", str(files["token"]), "--tls-ca-file", str(files["ca.pem"]))),
        }
        servers = {}
        try:
            for mode, (serve_extra, _) in modes.items():
                servers[mode] = start_server(path, args.workers, Path(tmp) / f"server-{mode}.log", extra=serve_extra)[:2]
            rows = []
            for n in args.streams:
                got = {mode: run_streams(servers[mode][1], n, args, modes[mode][1]) for mode in modes}
                rows.append({"streams": n, **got, "secure_vs_plain": got["secure"]["tokens_per_s"] /
                             got["plain"]["tokens_per_s"]})
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    print(f"\ndata service, plain vs secure (bearer token + TLS + start-up checksums): seq_len {args.seq_len}, "
          f"micro_batch_size {args.micro_batch_size}, {args.batches} batches per stream, {os.cpu_count()} CPU cores")
    print(f"{'streams':>7} {'plain M tok/s':>13} {'secure M tok/s':>14} {'secure/plain':>12} "
          f"{'plain next() p99':>16} {'secure next() p99':>17}")
    for r in rows:
        print(f"{r['streams']:>7} {r['plain']['tokens_per_s'] / 1e6:>13.2f} {r['secure']['tokens_per_s'] / 1e6:>14.2f} "
              f"{r['secure_vs_plain']:>12.3f} {r['plain']['next_p99_us']:>14.0f}us {r['secure']['next_p99_us']:>15.0f}us")
    emit("dataservice", {"mode": "secure", "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
                         "cpu_cores": os.cpu_count(), "streams": rows}, device="cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load-client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--dp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dp-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--auth-token-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--tls-ca-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--secure", action="store_true",
                   help="run the streams against a plain and a secure server (token, TLS, start-up verification) "
                        "and print both tokens/s and their ratio")
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
    p.add_argument("--seconds", type=float, default=0.0,
                   help="load mode: read --streams N streams for this many seconds (default: off)")
    p.add_argument("--client-procs", type=int, default=4, help="load mode: client processes (default 4)")
    p.add_argument("--sample-s", type=float, default=2.0, help="load mode: seconds between samples of the server")
    p.add_argument("--rounds", type=int, default=1,
                   help="load mode: rounds of --seconds on one server, its memory taken after each (default 1)")
    p.add_argument("--trim-every", type=float, default=None,
                   help="load mode: the server's --trim-every (default: the server's own)")
    args = p.parse_args()
    if args.client:
        return client_main(args)
    if args.load_client:
        return load_client_main(args)
    if args.seconds and (len(args.streams) != 1 or args.seconds < 0 or args.client_procs < 1 or args.rounds < 1):
        p.error("--seconds takes one --streams N, --client-procs >= 1 and --rounds >= 1")
    if args.seconds:
        with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
            path = args.data or make_dataset(Path(tmp), args.docs)
            base = plan_baseline(path, args.seq_len, args.micro_batch_size)
            result = run_load(path, args, Path(tmp) / "server.log")
        print_load(result, base, args)
        emit("dataservice", {"mode": "load", "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
                             "cpu_cores": os.cpu_count(), "baseline": base,
                             "load": dict(result, vs_baseline=result["tokens_per_s"] / base["tokens_per_s"])},
             device="cpu")
        return None

    if args.secure:
        return secure_main(args)
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        path = args.data or make_dataset(Path(tmp), args.docs)
        base = plan_baseline(path, args.seq_len, args.micro_batch_size)
        server, address, _ = start_server(path, args.workers, Path(tmp) / "server.log")
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
