"""bench.moe_layer: its CPU smoke mode (--tiny) runs every candidate of the layer comparison and
writes one JSON record per shape; --back-to-back, --host-ahead and --trace reach the record and the trace file;
bad arguments exit 2 with one line naming the fix. Its EP mode runs over two gloo ranks with both
dispatchers as the layer builds them (the routing weights travel with the rows) and checks each
round trip itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "bench.moe_layer", "--tiny", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_tiny_layer_comparison_back_to_back_with_a_trace(tmp_path):
    trace = tmp_path / "layer.json"
    proc = _run("--shapes", "fine64", "--iters", "1", "--back-to-back", "2", "--host-ahead", "--profile", "--trace",
                str(trace))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench": "moe_layer"')]
    assert len(records) == 1
    record = records[0]
    assert record["shape"] == "fine64" and record["back_to_back"] == 2 and record["host_ahead"] is True
    assert set(record["timings"]) == {"layer", "gemm", "loop", "dense", "layer+acc", "dense+acc"}
    assert all(t["iters"] == 2 and t["ms"] > 0 for t in record["timings"].values())
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "_PermuteBackward" for e in events)  # the layer's own autograd ran in it


def test_bad_arguments_exit_2_with_one_line():
    for args, words in ((["--back-to-back", "0"], "--back-to-back must be >= 1"),
                        (["--trace", "x.json"], "--trace needs --profile"),
                        (["--ep", "--host-ahead"], "--host-ahead is for layer mode")):
        proc = _run(*args)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr


def test_tiny_expert_parallel_dispatch_round_trips_over_two_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "bench.moe_layer", "--ep", "--tiny", "--shapes", "fine64", "--iters", "1",
                           "--dispatchers", "alltoall,allgather"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench": "moe_layer"')]
    assert len(records) == 1
    record = records[0]
    assert record["mode"] == "ep" and record["ep"] == 2 and record["weigh_in_experts"] is True
    assert set(record["timings"]) == {"alltoall", "allgather", "plain"}
    assert all(t["ms"] > 0 for t in record["timings"].values())
