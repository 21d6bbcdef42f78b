"""launch/scaling.sh (one node's scaling runs): its CPU smoke mode runs the real trainer
and data service at cp=1 and cp=2 and writes one summary row per run; bad arguments exit 2."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launch" / "scaling.sh"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TESSERA_NO_VENV="1", TESSERA_SCALING_DIR=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_smoke_longseq_writes_a_summary_row_per_run(tmp_path):
    proc = _run(tmp_path, "longseq", "--smoke", "--gpus", "2", "--steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [(r["run"], r["gpus"]) for r in rows] == [("longseq-cp1-seq256", 1), ("longseq-cp2-seq512", 2)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 <= r["data_wait_s"] < r["step_s"]
        assert r["tokens_per_s_per_gpu"] == r["tokens_per_s"] / r["gpus"]


@pytest.mark.slow
def test_bad_arguments_exit_2(tmp_path):
    proc = _run(tmp_path, "everything")
    assert proc.returncode == 2 and "unknown argument 'everything'" in proc.stderr
    proc = _run(tmp_path, "moe", "--gpus", "999")  # more GPUs than the machine has
    assert proc.returncode == 2 and "GPUs are visible" in proc.stderr
    proc = _run(tmp_path, "moe", "--gpus", "4,eight")
    assert proc.returncode == 2 and "--gpus takes GPU counts like 8 or 4,8, got '4,eight'" in proc.stderr
