"""bench.te_fusions where Transformer Engine cannot run: one clear line and exit 2 (the bench itself runs on GPUs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.precision import te_backend
from tests.support.cli import ROOT


@pytest.mark.skipif(te_backend.unavailable_reason() is None, reason="Transformer Engine runs here")
def test_te_fusions_without_te_says_why_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "bench.te_fusions", "--recipes", "bf16"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs Transformer Engine" in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


def test_te_fusions_refuses_an_unknown_recipe():
    proc = subprocess.run([sys.executable, "-m", "bench.te_fusions", "--recipes", "bf16,mxfp8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "mxfp8" in proc.stderr.strip().splitlines()[-1]
