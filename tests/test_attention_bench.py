"""bench.attention_kernels: the CPU smoke mode runs the packed comparison (the split of long
documents against one varlen call) and finds them equal; without a GPU and --smoke it exits 2."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "bench.attention_kernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_smoke_split_equals_one_varlen_call():
    run = _run("--smoke")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    packed = [r for r in rows if r.get("mode") == "packed"]
    assert packed and packed[0]["tokens_in_long_docs"] > 0  # the split had long documents to take
    assert packed[0]["max_rel_diff"] < 1e-10  # float64: exact up to rounding


@pytest.mark.slow
def test_without_gpu_or_smoke_exits_2():
    run = _run("--mode", "packed")
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr
    assert _run("--smoke", "--min-doc", "0").returncode == 2
