"""bench.pipeline: its CPU smoke mode runs the real trainer at pp=2 with the 1F1B and the
interleaved schedule on the same data and writes one summary row per run; bad arguments exit 2.

Reference for the theoretical bubble: with p ranks, v virtual stages per rank and m
micro-batches, (p-1)/(v*m+p-1) (`core.parallel.schedules.theoretical_bubble`); here p=2, m=4:
1/5 for 1F1B (v=1) and 1/9 interleaved (v=2). The measured idle share on 2 shared CPU cores
says little about the schedules, so only its range is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "bench.pipeline", *args, "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_smoke_runs_both_schedules(tmp_path):
    proc = _run(tmp_path, "--smoke", "--micro", "4", "--steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [(r["schedule"], r["virtual_stages"], r["pp"], r["micro"]) for r in rows] == [
        ("1f1b", 1, 2, 4), ("interleaved", 2, 2, 4)]
    p, m = 2, 4
    for r in rows:
        v = r["virtual_stages"]
        assert r["pp_bubble_theory"] == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
        assert 0 <= r["pp_idle_mean"] < 1
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["steps"] == 1  # 4 steps, the first 3 dropped as warm-up
    one, inter = rows
    assert inter["tokens_per_s_vs_1f1b"] == pytest.approx(inter["tokens_per_s"] / one["tokens_per_s"])
    assert "M=4: interleaved/1f1b tokens/s" in proc.stdout


@pytest.mark.slow
def test_bad_arguments_exit_2(tmp_path):
    proc = _run(tmp_path, "--smoke", "--gpus", "1")
    assert proc.returncode == 2 and "--gpus 1: a pipeline needs at least 2 ranks" in proc.stderr
    # The trainer's own config check, asked before any run starts.
    proc = _run(tmp_path, "--smoke", "--micro", "4,5")
    assert proc.returncode == 2 and "--micro 5 with the interleaved schedule on pp=2" in proc.stderr
    assert "micro-batches per step (5) to be a multiple of parallel.pp=2" in proc.stderr
    proc = _run(tmp_path, "--gpus", "999")  # more GPUs than the machine has
    assert proc.returncode == 2 and "GPUs are visible" in proc.stderr
    proc = _run(tmp_path, "--smoke", "--micro", "4,x")
    assert proc.returncode == 2 and "--micro takes micro-batch counts like 8 or 8,16, got '4,x'" in proc.stderr
    assert not (tmp_path / "summary.jsonl").exists()
