"""bench.fp8_quantizers: its CPU smoke mode (--tiny) times every quantiser beside the copy and
writes one JSON record with a figure per case and shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {"clone", "1x128", "1x128 grouped", "1x128 of the transpose", "grouped transpose 1x128",
         "grouped transpose 128x128"}


def test_tiny_run_records_every_quantiser_beside_the_copy():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "bench.fp8_quantizers", "--tiny", "--rounds", "2", "--iters", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"bench": "fp8_quantizers"')]
    assert len(records) == 1
    shapes = records[0]["shapes"]
    assert list(shapes) == ["512x256"]
    row = shapes["512x256"]
    assert set(row) == CASES
    for name, fig in row.items():
        assert 0 < fig["us_min"] <= fig["us"] <= fig["us_max"], name
        moved = 512 * 256 * (4 if name == "clone" else 3)
        assert abs(fig["GB/s"] - moved / (fig["us"] * 1e3)) < 1e-6 * fig["GB/s"], name
