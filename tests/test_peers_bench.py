"""bench/peers.py --tiny on the CPU: every workload runs Tessera and the installed peers on the
same model and batches, records one line per workload in bench.harness's format, and every
system learns. Where the initial weights are Tessera's (dense and packed long rows in Llama,
the MoE in Glm4Moe), transformers' first loss equals Tessera's (fp32, rel 1e-5; 1e-4 for the MoE): the same model,
data, targets and document boundaries. Peers not installed here (TorchTitan, torchao) are
reported as not run; TorchTitan 0.2 runs on CUDA only."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

WORKLOADS = ("dense", "dense-fp8", "moe", "longseq")


@pytest.mark.slow
def test_tiny_run_records_every_workload_and_every_system_learns(tmp_path):
    records = tmp_path / "peers.jsonl"
    systems = ["tessera", "hf"] + (["torchao-rowwise", "torchao-tensorwise"]
                                   if importlib.util.find_spec("torchao") else [])
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--tiny", "--rounds", "1", "--warmup", "2",
                           "--systems", ",".join(systems), "--tessera-recompute", "mlp"], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "TESSERA_BENCH_RECORDS": str(records)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["workload"] for r in lines] == list(WORKLOADS)
    for r in lines:
        assert r["bench"] == "peers" and r["device"] == "cpu" and r["commit"] and r["argv"][0] == "--tiny"
        ran = r["results"]
        assert "tessera" in ran and set(ran) | set(r["unavailable"]) == set(systems)
        assert ran["tessera"]["setup"].count("+ mlp") == 1 and r["spec"]["tessera_modules"] == ["mlp"]
        for name, figures in ran.items():
            losses = figures["losses"]
            assert len(losses) == 3 and figures["rounds"] == 1  # warm-up steps, then the timed round
            assert losses[-1] < losses[0] - 0.1, (r["workload"], name, losses)  # it learns
            assert figures["tokens_per_s"] > 0 and figures["flops_per_token"] > 0 and figures["params"] > 0
        for name in ran:
            if name != "tessera":
                assert set(r["tessera_speedup"][name]) == {"median", "min", "max"}
        if "hf" in ran:  # same initial weights and batches: the same first loss
            tol = 1e-4 if r["workload"] == "moe" else 1e-5  # the MoE's routing sums in another order
            assert ran["hf"]["loss_first"] == pytest.approx(ran["tessera"]["loss_first"], rel=tol)
            assert ran["hf"]["params"] == ran["tessera"]["params"]
    by_name = {r["workload"]: r for r in lines}
    assert "hf" in by_name["dense-fp8"]["unavailable"]  # bf16 only: one line says why
    assert by_name["longseq"]["spec"]["packed"] and by_name["longseq"]["results"]["hf"]["setup"].count("position_ids")
    assert "not run:" in proc.stdout


def test_bad_recompute_module_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--tiny", "--tessera-recompute", "mlp,ffn"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.peers: --tessera-recompute: unknown module 'ffn' (known: ")


def test_bad_system_name_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--tiny", "--systems", "tessera,megatron"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["bench.peers: unknown system 'megatron' (known: tessera, torchtitan, "
                                                "torchao-rowwise, torchao-tensorwise, hf)"]
