"""bench/dataservice.py --secure at a small size on the CPU: the same streams read from a plain
and a secure server (bearer token, TLS, start-up checksums), both throughputs and their ratio
printed and recorded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.cli import ROOT, child_env


@pytest.mark.slow
def test_secure_runs_the_same_streams_plain_and_secure_and_gives_the_ratio():
    proc = subprocess.run([sys.executable, "-m", "bench.dataservice", "--secure", "--docs", "60", "--seq-len", "256",
                           "--micro-batch-size", "2", "--batches", "8", "--streams", "1", "--warm-steps", "2",
                           "--step-sleep", "0.01"], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    record = json.loads(lines[-1])
    assert record["bench"] == "dataservice" and record["mode"] == "secure"
    (row,) = record["streams"]
    plain, secure = row["plain"], row["secure"]
    assert plain["tokens_per_s"] > 0 and secure["tokens_per_s"] > 0
    assert row["secure_vs_plain"] == pytest.approx(secure["tokens_per_s"] / plain["tokens_per_s"])
    # The same rows on both: a secure server that sent other (or no) batches would differ here.
    assert plain["efficiency"] == secure["efficiency"] and plain["real_tokens_per_s"] / plain["tokens_per_s"] == \
        pytest.approx(secure["real_tokens_per_s"] / secure["tokens_per_s"])
    table = lines.index(next(line for line in lines if line.lstrip().startswith("streams")))
    assert "secure/plain" in lines[table] and lines[table + 1].split()[0] == "1"
    assert f"{row['secure_vs_plain']:.3f}" in lines[table + 1]
