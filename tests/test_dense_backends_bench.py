"""bench.dense_backends end to end on CPU: each variant in its own process, the first again at the end, one JSON record."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.cli import ROOT


def test_dense_backends_smoke_prints_one_record():
    proc = subprocess.run([sys.executable, "-m", "bench.dense_backends", "--dim", "128", "--layers", "2", "--seq", "64",
                           "--batch", "2", "--accum", "2", "--steps", "1", "--warmup", "1", "--variants", "torch-bf16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["bench"] == "dense_backends"
    assert set(record["results"]) == {"torch-bf16", "torch-bf16 (again)"}
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in record["results"].values())
