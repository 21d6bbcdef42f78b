"""bench.context_parallel: its smoke mode (2 CPU processes, gloo) runs every mode; the ring
check finds the ring equal to one-process attention on documents of different and of equal
lengths (the layout says which), and the dynamic mode compares both plans on the same documents."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_smoke_runs_every_mode():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "-m", "bench.context_parallel", "--smoke"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    checks = {r["case"]: r for r in rows if r.get("mode") == "check"}
    assert checks["varlen"]["equal_docs"] == 0 and checks["equal"]["equal_docs"] == 3
    for r in checks.values():
        assert max(r["max_rel_err"].values()) < 1e-5, r  # float32 on CPU
    attention = [r for r in rows if r.get("mode") == "attention"]
    assert attention and all(r["t_cp_s"] > 0 and r["t_cp1_part_s"] > 0 for r in attention)
    plans = {r["plan"]: r for r in rows if r.get("mode") == "dynamic"}
    assert set(plans) == {"dynamic", "static_cp2"}
    assert plans["dynamic"]["tokens"] == plans["static_cp2"]["tokens"] > 0  # the same documents
    assert any(r.get("mode") == "dynamic_vs_static" for r in rows)
