"""bench/peers.py --tiny on the CPU: every workload runs Tessera and the installed peers on the
same model and batches, records one line per workload in bench.harness's format, and every
system learns. Where the initial weights are Tessera's (dense and packed long rows in Llama,
the MoE in Glm4Moe), transformers' first loss equals Tessera's (fp32, rel 1e-5; 1e-4 for the MoE): the same model,
data, targets and document boundaries; so do its losses after optimizer steps (1e-3 for the MoE). Peers not installed here
(TorchTitan, torchao) are reported as not run; TorchTitan 0.2 runs on CUDA only, and so does Megatron-Core's training step:
its model, holding Tessera's weights through the bench's name and layout map, is checked here
against Tessera's (same logits and token losses) where megatron-core is importable."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from bench.peer_systems import (_counts, _tessera_counts, copy_by_name, megatron_distributed, megatron_gpt,
                                megatron_gpt_weights, reference_weights)
from bench.peers import make_pool, workloads
from core.train.model import build_model

WORKLOADS = ("dense", "dense-fp8", "moe", "longseq")


@pytest.mark.slow
def test_tiny_run_records_every_workload_and_every_system_learns(tmp_path):
    pytest.importorskip("transformers")
    records = tmp_path / "peers.jsonl"
    systems = ["tessera", "hf"] + (["torchao-rowwise", "torchao-tensorwise"]
                                   if importlib.util.find_spec("torchao") else [])
    systems += ["megatron"] if importlib.util.find_spec("megatron") else []
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--tiny", "--rounds", "2", "--warmup", "3",
                           "--systems", ",".join(systems), "--tessera-recompute", "mlp"], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "TESSERA_BENCH_RECORDS": str(records)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["workload"] for r in lines] == list(WORKLOADS)
    for r in lines:
        assert r["bench"] == "peers" and r["device"] == "cpu" and r["commit"] and r["argv"][0] == "--tiny"
        ran = r["results"]
        assert r["micro_batches"] == 5 * r["spec"]["accum"]  # one for every micro-batch the 5 steps read
        assert "tessera" in ran and set(ran) | set(r["unavailable"]) == set(systems)
        assert ran["tessera"]["setup"].count("recompute_modules mlp,") == 1 and r["spec"]["tessera_modules"] == ["mlp"]
        for name, figures in ran.items():
            losses = figures["losses"]
            assert len(losses) == 5 and len(figures["rounds_ms"]) == 2  # warm-up steps, then the timed rounds
            # it learns: every step reads new micro-batches, so this is learning, not memorising
            assert losses[-1] < losses[0] - 0.1, (r["workload"], name, losses)
            assert figures["tokens_per_s"] > 0 and figures["flops_per_token"] > 0 and figures["params"] > 0
        for name in ran:
            if name != "tessera":
                assert set(r["tessera_speedup"][name]) == {"median", "min", "max"}
        if "hf" in ran:  # same initial weights and batches: the same first loss
            tol = 1e-4 if r["workload"] == "moe" else 1e-5  # the MoE's routing sums in another order
            assert ran["hf"]["loss_first"] == pytest.approx(ran["tessera"]["loss_first"], rel=tol)
            assert ran["hf"]["params"] == ran["tessera"]["params"]
            # and the same steps after it (gradients, clipping, AdamW): the MoE within 1e-3, as
            # transformers adds no auxiliary loss and leaves the router's expert bias unbalanced
            tol = 1e-3 if r["workload"] == "moe" else 1e-5
            assert ran["hf"]["losses"] == pytest.approx(ran["tessera"]["losses"], rel=tol), r["workload"]
    by_name = {r["workload"]: r for r in lines}
    assert "hf" in by_name["dense-fp8"]["unavailable"]  # bf16 only: one line says why
    assert by_name["longseq"]["spec"]["packed"] and by_name["longseq"]["results"]["hf"]["setup"].count("position_ids")
    assert "not run:" in proc.stdout
    if "megatron" in systems:  # its DDP, optimizer and schedules are CUDA-only: one line says so
        assert all(r["unavailable"]["megatron"].startswith("megatron: its DDP") for r in lines)


def test_bad_recompute_module_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--tiny", "--tessera-recompute", "mlp,ffn"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.peers: --tessera-recompute: unknown module 'ffn' (known: ")


@pytest.mark.parametrize("args, line", [
    (["--tessera-recompute-layers", "3"],
     "bench.peers: --tessera-recompute-layers 3 needs --tessera-recompute with modules to recompute, and N >= 0"),
    (["--tessera-split-masters"], "bench.peers: --tessera-split-masters needs bf16 parameters; --tiny runs fp32"),
    (["--systems", "tessera,nemo"],
     "bench.peers: unknown system 'nemo' (known: tessera, megatron, torchtitan, torchao-rowwise, torchao-tensorwise, hf)"),
])
def test_bad_option_is_one_line_and_exit_2(args, line):
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--tiny", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]


def test_megatron_model_holding_the_mapped_weights_is_tesseras_model(monkeypatch):
    """Megatron-Core's GPTModel (its local layer spec, fp32, CPU) holding Tessera's initial weights
    through megatron_gpt_weights gives Tessera's logits and token losses on the same rows: the
    fused QKV's per-group layout, [gate; up], the norms and rotary layout all agree (rel 1e-5).
    On a CPU-only torch three CUDA-bound details are answered: the rotary embedding's move of its
    frequencies to `torch.cuda.current_device()` (the CPU here), the RNG-state fork around its
    attention dropout (p = 0), and the default causal mask, made on CUDA (passed in instead, as
    Megatron's data loaders can); everything computed is Megatron's own code."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state, tensor_parallel  # an optional peer: present only where installed

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        # its attention dropout (p = 0 here) runs inside a fork of the CUDA generator's state
        monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    dense = workloads(tiny=True, device=torch.device("cpu"))["dense"]
    spec = dense.spec
    assert spec.precision == "fp32" and spec.model.num_heads // spec.model.num_kv_heads > 1  # GQA groups of heads
    weights = reference_weights(spec)
    micro = make_pool(dense, count=1)[0]
    tessera = build_model(spec.model, seed=0)
    flat = micro.flat()
    causal = torch.ones(spec.seq, spec.seq, dtype=torch.bool).triu(1)[None, None]  # True: masked out
    megatron_distributed(spec)
    try:
        _, model = megatron_gpt(spec, transformer_engine=False)
        copy_by_name(model, megatron_gpt_weights(spec.model, weights))
        with torch.no_grad():
            want = tessera(flat.tokens, flat.position_ids, flat.meta).reshape(*micro.tokens.shape, -1)
            got = model(micro.tokens, micro.positions, causal)  # [b, s, vocab]
            token_losses = model(micro.tokens, micro.positions, causal, labels=micro.targets.clamp(min=0))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        mask = micro.targets != -100
        loss = (token_losses * mask).sum() / mask.sum()
        reference = torch.nn.functional.cross_entropy(want.reshape(-1, want.shape[-1]), micro.targets.reshape(-1))
        assert float(loss) == pytest.approx(float(reference), rel=1e-5)
        assert _counts(model, model.embedding.word_embeddings, spec) == _tessera_counts(spec)
        # a wrong grouping of the fused QKV would be another model: the check can fail
        shuffled = megatron_gpt_weights(spec.model, weights)
        key = "decoder.layers.0.self_attention.linear_qkv.weight"
        shuffled[key] = shuffled[key].reshape(spec.model.num_kv_heads, -1, spec.model.dim).flip(0).reshape_as(
            shuffled[key])
        copy_by_name(model, shuffled)
        with torch.no_grad():
            assert not torch.allclose(model(micro.tokens, micro.positions, causal), want, rtol=1e-3, atol=1e-3)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
