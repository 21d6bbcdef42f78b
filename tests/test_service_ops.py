"""The data service operated as a service, and a trainer that loses its data service mid-run.

- The command line (serve, health, peek) imports no torch.
- Prometheus metrics, scraped over HTTP on loopback, move by exactly what was sent.
- `tessera-data health`: one line per replica; exit 0 when all are SERVING, 1 when one is
  NOT_SERVING or UNREACHABLE, 2 for a malformed address.
- SIGTERM drains: NOT_SERVING, new streams refused, the open stream ends between two messages
  and its last resume token continues it exactly elsewhere; exit 0 within the grace.
- Memory: after 16 streams of ~400 KB messages close, the server's anonymous memory is back
  within a few MiB of where it was before them (glibc keeps the freed buffers without
  `--trim-every`: about 28 MiB more).
- One shared server: each stream brings its own seed and blend, and a blend's stream equals,
  row for row, the stream of a server that holds only that mix.
- A 2-process trainer (gloo) whose first replica is SIGKILLed (the second of data.address takes
  over), whose second replica is then SIGKILLed too, and whose first is started again on its
  address: every step's loss equals the uninterrupted run's, bit for bit (same layout, same rows).

References: the uninterrupted stream of the same request from a live server, and the
uninterrupted trainer run of the same config.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import protos
from dataservice.build import build_dataset, make_corpus
from dataservice.shards import ShardedDataset
from tests.support.cli import ROOT, child_env, run_process
from tests.support.distributed import free_port
from tests.support.service import fetch as service_fetch
from tests.support.service import request as service_request
from tests.support.service import start_server, start_server_process, stub

pb2, pb2_grpc = protos.load()
pytestmark = pytest.mark.timeout(180)
FIELDS = ("tokens", "labels", "position_ids", "cu_seqlens", "seq_lens", "row_ids", "doc_hashes")


# ---- fixtures and helpers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    a = build_dataset([make_corpus(root, 300, seed=3, min_len=16, max_len=600)], root / "a", progress=False)
    b = build_dataset([make_corpus(root, 200, seed=4, min_len=16, max_len=900)], root / "b", progress=False)
    return {"a": Path(a), "b": Path(b)}


@pytest.fixture(scope="module")
def opened(data):
    """Each dataset opened once (LMDB refuses a second environment of one folder in a process)."""
    return {name: (ShardedDataset.open(path), str(path)) for name, path in data.items()}


def start_metered(opened, **weights):
    """A server of the opened datasets at `weights`, with its metrics endpoint."""
    return start_server([(*opened[name], float(w)) for name, w in weights.items()], metrics_port=0)


@pytest.fixture(scope="module")
def shared(opened):
    """One server holding both datasets (default blend a:1, b:1)."""
    srv, address = start_metered(opened, a=1, b=1)
    yield address
    srv.stop(0)


@pytest.fixture(scope="module")
def only_a(opened):
    """A server of dataset a alone: the reference of a's streams."""
    srv, address = start_metered(opened, a=1)
    yield address
    srv.stop(0)


def request(**kw):
    """tests.support.service's request at this file's shorter rows."""
    kw.setdefault("seq_len", 128)
    return service_request(**kw)


def fetch(address, n, **kw):
    kw.setdefault("seq_len", 128)
    return service_fetch(address, n, **kw)


def arrays(msg):
    return {f: getattr(msg, f) for f in FIELDS}


def scrape(url):
    """/metrics as {'name{label=value,...}': value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---- the process -----------------------------------------------------------------------------

def test_the_command_line_starts_without_torch():
    # serve, health and peek are the service's own: a health probe or a replica restart does
    # not pay for importing torch (only dataservice.client, the trainer's side, needs it).
    code = "import sys, dataservice.cli, dataservice.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout == "False\n", out.stderr


# ---- metrics -----------------------------------------------------------------------------

def test_metrics_endpoint_counts_streams_rows_tokens_latency_and_errors(opened):
    srv, address = start_metered(opened, a=1)
    url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
    try:
        before = scrape(url)
        assert before["tessera_data_streams_total"] == 0 and before["tessera_data_draining"] == 0
        msgs = fetch(address, 5, micro_batch_size=3)
        m = scrape(url)
        assert m["tessera_data_streams_total"] == 1 and m["tessera_data_streams_active"] == 0
        assert m["tessera_data_batches_total"] == 5 and m["tessera_data_rows_total"] == 15
        assert m["tessera_data_tokens_total"] == sum(msg.num_tokens for msg in msgs) > 0
        assert m["tessera_data_first_batch_seconds_count"] == 1 and m["tessera_data_batch_seconds_count"] == 4
        assert m["tessera_data_batch_seconds_bucket{le=+Inf}"] == 4 and m["tessera_data_batch_seconds_sum"] > 0
        assert m["process_resident_memory_bytes"] > 0

        with pytest.raises(grpc.RpcError):
            fetch(address, 1, seq_len=1)
        assert scrape(url)["tessera_data_errors_total{code=INVALID_ARGUMENT}"] == 1

        stream = stub(address).StreamBatches(request())  # unbounded: open until cancelled
        next(stream)
        assert scrape(url)["tessera_data_streams_active"] == 1
        stream.cancel()
        wait_for(lambda: scrape(url)["tessera_data_streams_active"] == 0, what="the cancelled stream to end")
        assert scrape(url)["tessera_data_streams_total"] == 2

        srv.drain(0)
        with pytest.raises(grpc.RpcError):
            fetch(address, 1)
        m = scrape(url)
        assert m["tessera_data_draining"] == 1 and m["tessera_data_errors_total{code=UNAVAILABLE}"] == 1
    finally:
        srv.stop(0)


# ---- health --------------------------------------------------------------------------------

@pytest.mark.slow
def test_health_prints_a_line_per_replica_and_exits_0_1_or_2(opened, shared):
    draining, address = start_metered(opened, a=1)
    draining.drain(0)  # NOT_SERVING, as during a drain
    nobody = f"127.0.0.1:{free_port()}"
    try:
        ok = run_process("dataservice.cli", "health", "--address", shared)
        assert (ok.returncode, ok.stdout, ok.stderr) == (0, f"{shared}: SERVING\n", "")
        mixed = run_process("dataservice.cli", "health", "--address", f"{shared},{address}", "--address", nobody)
        assert mixed.returncode == 1, mixed.stderr
        assert mixed.stdout.splitlines() == [f"{shared}: SERVING", f"{address}: NOT_SERVING",
                                             f"{nobody}: UNREACHABLE (connection refused)"]
        bad = run_process("dataservice.cli", "health", "--address", "localhost")
        assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
        assert "must read HOST:PORT" in bad.stderr
    finally:
        draining.stop(0)


# ---- drain on SIGTERM ------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_drains_open_stream_at_a_message_boundary_and_refuses_new_ones(data, only_a, tmp_path):
    log = tmp_path / "serve.log"
    proc, address, _ = start_server_process([data["a"]], "--grace", "30", log=log)
    try:
        req = dict(seq_len=256, micro_batch_size=2, seed=7)
        stream = stub(address).StreamBatches(request(**req))  # unbounded
        got = [next(stream) for _ in range(3)]
        proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == not_serving,
                 what="NOT_SERVING")
        with pytest.raises(grpc.RpcError) as refused:
            fetch(address, 1, **req)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            for msg in stream:  # what the server had sent before it noticed the drain, then the end
                got.append(msg)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "reconnect with the last resume token" in ended.value.details()
        assert proc.wait(timeout=20) == 0 and time.monotonic() - t0 < 15  # ended by the drain, not the grace
    finally:
        proc.kill()
        proc.wait()
    # Whole messages, in order, and the last one's token continues the stream exactly.
    reference = fetch(only_a, len(got) + 2, **req)
    assert [m.step for m in got] == list(range(len(got)))
    assert [m.SerializeToString() for m in got] == [m.SerializeToString() for m in reference[:len(got)]]
    resumed = fetch(only_a, 2, resume_token=got[-1].resume_token, **req)
    assert [m.SerializeToString() for m in resumed] == [m.SerializeToString() for m in reference[len(got):]]
    text = log.read_text()
    assert "draining 1 streams" in text and "serve: stopped\n" in text and "cancelled" not in text


# ---- one shared server or one per mix ----------------------------------------------------------

def anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; malloc_trim is glibc's")
def test_server_memory_falls_back_once_streams_close(data, tmp_path):
    trim = os.environ.get("TESSERA_TEST_TRIM_EVERY", "1")  # 0 shows this test failing without the fix
    proc, address, _ = start_server_process([data["a"]], "--trim-every", trim, log=tmp_path / "serve.log")
    big = dict(seq_len=8192, micro_batch_size=4)  # ~400 KB messages, as trainers ask

    def read(rank: int, n: int, sizes: list) -> None:
        with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as channel:
            for msg in pb2_grpc.DataServiceStub(channel).StreamBatches(
                    request(dp_rank=rank, dp_size=16, max_batches=n, **big), timeout=120):
                sizes.append(len(msg.tokens))  # each message is dropped once counted

    try:
        warm: list = []
        for rank in range(16):  # one at a time: the plan's caches fill as they will, little is freed
            read(rank, 120, warm)
        time.sleep(float(trim) + 1.5)
        before = anon_mib(proc.pid)
        sizes: list = []
        threads = [threading.Thread(target=read, args=(r, 120, sizes)) for r in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert len(sizes) == 16 * 120 and set(sizes) == {4 * 8192 * 4}
        time.sleep(float(trim) + 1.5)  # past the server's next trim
        after = anon_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    assert after - before < 15, f"anonymous memory {before:.1f} MiB before 16 streams, {after:.1f} MiB after"


def test_shared_server_serves_each_stream_its_own_seed_and_blend(shared, only_a, opened):
    a_hashes = set(opened["a"][0].hashes.tolist())
    b_hashes = set(opened["b"][0].hashes.tolist())
    # Two jobs on one server at once: job 1 reads a alone with seed 5, job 2 b alone with seed 6.
    job1 = stub(shared).StreamBatches(request(max_batches=4, blend={"a": 1.0}, seed=5), timeout=60)
    job2 = stub(shared).StreamBatches(request(max_batches=4, blend={"b": 2.0}, seed=6), timeout=60)
    got1, got2 = [], []
    for m1, m2 in zip(job1, job2):
        got1.append(m1)
        got2.append(m2)
    docs1 = {h for m in got1 for h in np.frombuffer(m.doc_hashes, "<u8").tolist() if h}
    docs2 = {h for m in got2 for h in np.frombuffer(m.doc_hashes, "<u8").tolist() if h}
    assert docs1 and docs1 <= a_hashes and docs2 and docs2 <= b_hashes
    # A blend's stream on the shared server = the stream of a server of that mix alone, row for row
    # (resume tokens differ: they name the server's datasets).
    assert [arrays(m) for m in got1] == [arrays(m) for m in fetch(only_a, 4, seed=5)]
    # The seed is the stream's own: another seed, another order.
    assert [arrays(m) for m in got1] != [arrays(m) for m in fetch(shared, 4, blend={"a": 1.0}, seed=6)]


# ---- a trainer that loses its data service ---------------------------------------------------

TRAIN = ["model.dim=64", "model.num_layers=2", "model.ffn_dim=128", "train.seq_len=512",
         "train.micro_batch_size=2", "train.global_batch_size=8", "train.max_steps=20", "train.warmup_steps=1",
         "train.plot=false", "train.log_interval=100", "data.prefetch=2", "checkpoint.save_at_end=false"]


OUTAGE_S = 2.0  # how long no replica serves


def start_training(run_dir: Path, address: str = "", dataset: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "core.train.cli", "--config", str(ROOT / "launch/configs/tiny_dense.toml"),
           "--nproc-per-node", "2"]
    source = f"data.address={address}" if address else f"data.dataset={dataset}"
    for item in [*TRAIN, source, f"train.run_dir={run_dir}"]:
        cmd += ["--set", item]
    run_dir.mkdir(parents=True)
    log = open(run_dir.with_suffix(".log"), "w")  # a file: an unread pipe would block the trainer
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, run_dir: Path) -> None:
    proc.wait(timeout=150)
    assert proc.returncode == 0, run_dir.with_suffix(".log").read_text()[-4000:]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def resumed_streams(log: Path) -> dict[int, int]:
    """{dp rank: first step} of the streams a replica opened after step 0 (its log lines)."""
    found = re.findall(r"stream tessera-train@\S+ dp (\d+)/2: .* from step (\d+)", log.read_text())
    return {int(rank): int(step) for rank, step in found if int(step) > 0}


@pytest.mark.slow
def test_trainer_survives_losing_its_data_service_with_every_loss_unchanged(data, tmp_path):
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "a2")}
    port_a = free_port()
    a, address_a, _ = start_server_process([data["a"]], port=port_a, log=logs["a"])
    b, address_b, metrics_b = start_server_process([data["a"]], "--metrics-port", "0", log=logs["b"])
    a2 = trainer = uninterrupted = None
    try:
        # The uninterrupted run reads the same stream from its own loopback server, alongside.
        uninterrupted = start_training(tmp_path / "reference", dataset=data["a"])
        trainer = start_training(tmp_path / "faults", f"{address_a},{address_b}")
        wait_for(lambda: len(records(tmp_path / "faults")) >= 2, timeout=120, what="step 2")
        a.kill()  # SIGKILL: no drain; both ranks fail over to b from their last received token
        wait_for(lambda: len(resumed_streams(logs["b"])) == 2, what="both ranks on replica b")
        wait_for(lambda: scrape(metrics_b)["tessera_data_batches_total"] >= 4, what="replica b to serve")
        b.kill()  # now nobody serves: the ranks retry with backoff
        a.wait(10)
        time.sleep(OUTAGE_S)  # longer than the prefetched batches last, so the ranks must wait
        a2, _, _ = start_server_process([data["a"]], port=port_a, log=logs["a2"])  # replica a back on its address
        finish(trainer, tmp_path / "faults")
        finish(uninterrupted, tmp_path / "reference")
    finally:
        for run in (trainer, uninterrupted):
            if run is not None and run.poll() is None:
                run.terminate()  # tessera-train stops its workers (grace, then SIGKILL)
                run.wait(60)
        for proc in (a, b, a2):
            if proc is not None:
                proc.kill()
                proc.wait()
    reference = [r["loss"] for r in records(tmp_path / "reference")]
    got = records(tmp_path / "faults")
    assert len(reference) == 20 and [r["step"] for r in got] == list(range(1, 21))
    assert [r["loss"] for r in got] == reference  # bit for bit: no batch lost, none repeated
    # The faults hit the run: b and then the restarted a served both ranks from mid-run steps
    # (a2 from where b's last received batch left them), and the ranks waited for a2.
    on_b, on_a2 = resumed_streams(logs["b"]), resumed_streams(logs["a2"])
    assert sorted(on_a2) == [0, 1] and all(on_a2[r] >= on_b[r] > 0 for r in (0, 1)), (on_b, on_a2)
    waits = [r["data_wait_s"] for r in got]
    assert max(waits) > OUTAGE_S / 4, waits
