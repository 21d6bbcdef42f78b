"""A data server for a test, and the raw gRPC side of talking to one.

The one way to start a server: in this process (`start_server`, the real gRPC server on a free
loopback port) or as a `tessera-data serve` process (`start_server_process`), each returning
the address it listens on. Then `stub`, `request` (a StreamRequest with the tests' defaults)
and `fetch` (the first N batches of a stream).
"""

from __future__ import annotations

import select
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

import protos
from dataservice.server import DataServer, serve
from tests.support.cli import ROOT, child_env

pb2, pb2_grpc = protos.load()


def start_server(datasets, **options) -> tuple[DataServer, str]:
    """`dataservice.server.serve(datasets, **options)` on a free port: (server, "127.0.0.1:PORT").
    The caller stops it (`server.stop(0)`)."""
    server, port = serve(datasets, **options)
    return server, f"127.0.0.1:{port}"


def start_server_process(data_specs, *extra, port: int = 0, log: Path | None = None,
                         timeout: float = 60.0) -> tuple[subprocess.Popen, str, str]:
    """`tessera-data serve --port PORT` with a `--data` per spec (a spec with spaces is several
    folders after one `--data`) and `extra`, once it has said where it serves: (process, address,
    metrics URL, "" without `--metrics-port`). Its log (stderr) is appended to `log`, or to a
    temporary file: a pipe nobody reads would stall it. The caller ends the process."""
    cmd = [sys.executable, "-m", "dataservice.cli", "serve", "--port", str(port), *map(str, extra)]
    for spec in data_specs:
        cmd += ["--data", *str(spec).split(" ")]
    sink = open(log, "a+") if log is not None else tempfile.TemporaryFile("w+")
    with sink:  # the process writes through its own copy
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=sink, text=True)
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("serving on "):
            proc.kill()
            proc.wait()
            sink.seek(0)
            raise AssertionError(f"server did not start: {line!r} {sink.read()[-2000:]}")
    url = proc.stdout.readline().split()[-1] if "--metrics-port" in extra else ""  # printed right after
    return proc, line.split()[-1], url


def stub(address: str):
    """A DataService stub on a new channel to `address`, taking messages up to 256 MiB."""
    return pb2_grpc.DataServiceStub(grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 256 << 20)]))


def request(**kw):
    """A StreamRequest: rows of 256 tokens, 2 per micro-batch, one data-parallel rank, unless
    `kw` says otherwise; `blend` as {name: weight}."""
    kw.setdefault("seq_len", 256)
    kw.setdefault("micro_batch_size", 2)
    kw.setdefault("dp_size", 1)
    blend = kw.pop("blend", {})
    return pb2.StreamRequest(blend=[pb2.DatasetWeight(name=k, weight=v) for k, v in blend.items()], **kw)


def fetch(address: str, n: int, **kw) -> list:
    """The first `n` PackedBatch messages of `request(**kw)`'s stream."""
    return list(stub(address).StreamBatches(request(max_batches=n, **kw), timeout=60))
