"""`tessera-plan --longest`: the longest sequence a config trains at, by the planner's own model.

What must hold: the answer grows with the GPU's and the host's memory (never shrinks); every
answer validates as a config (`core.validation`) and fits by the memory model, GPU and host
(and the next multiple fits no candidate); the 8B model on 8 H100s with 1 TiB of host memory
reaches its length for the reason the model gives (at 4M tokens the checkpoint inputs alone fill
the host; 8 H200s, with room on the GPU for the optimizer and the last blocks' inputs, pass it
by offloading only the first blocks' inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import load_config
from core.planner.calibration import SHIPPED, Calibration
from core.planner.cli import main
from core.planner.longest import Longest, _fitting_at, apply_longest, longest, planning_copy
from core.planner.memory import checkpoint_host_buffers, estimate_memory
from core.planner.search import checkable
from core.validation import validate

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100 = Calibration.load(SHIPPED["h100"])
H200 = Calibration.load(SHIPPED["h200"])
LLAMA = ROOT / "launch/configs/llama3_8b_long.toml"
# A ~0.4B dense model: long rows in seconds of planning.
SMALL = ["model.vocab_size=32000", "model.dim=1024", "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=4",
         "model.ffn_dim=2816", "train.precision=bf16", "train.global_batch_size=4", "train.micro_batch_size=1",
         "parallel.distributed_optimizer=true"]


def _check_answer(found: Longest, config, world: int, gpu: int, host: int) -> None:
    plan = validate(checkable(apply_longest(config, found)), world)
    memory = estimate_memory(plan, allocator=H100.allocator)
    assert memory.device_total <= gpu, (memory.device_total, gpu)
    assert plan.train.seq_len == found.seq_len and plan.train.micro_batch_size == 1
    ckpt = sum(n * c for n, c in checkpoint_host_buffers(plan).items())
    if plan.parallel.pp == 1:  # every rank of the node holds as much as rank 0 (at most)
        assert (ckpt + memory.state.host) * min(world, 8) <= host
    assert found.best.host.node <= host
    if found.closest is not None:  # the next multiple: no candidate fits
        c = found.closest
        assert c.memory.device_total > gpu or c.host.node > host


@pytest.mark.parametrize("vary", ["device_memory", "host_memory"])
def test_the_longest_grows_with_memory_and_every_answer_fits(vary):
    config = load_config(None, SMALL)
    world, answers = 4, []
    for budget in ([6, 10, 16] if vary == "device_memory" else [0, 16, 64]):
        gpu, host = (budget * GIB, 32 * GIB) if vary == "device_memory" else (10 * GIB, budget * GIB)
        found = longest(config, world, gpu, host, H100, 8)
        assert isinstance(found, Longest), found
        _check_answer(found, config, world, gpu, host)
        answers.append(found.seq_len)
    assert answers == sorted(answers) and answers[0] < answers[-1], answers


def test_host_memory_turns_the_offloads_on_only_when_needed():
    config = load_config(None, SMALL)
    without = longest(config, 4, 10 * GIB, 0, H100, 8)
    assert not without.best.config.train.offload_checkpoints and not without.best.config.train.optimizer_offload
    with_host = longest(config, 4, 10 * GIB, 64 * GIB, H100, 8)
    t = with_host.best.config.train
    assert with_host.seq_len > without.seq_len and (t.offload_checkpoints or t.optimizer_offload)
    # At a length the GPU holds with room to spare, the fastest plan needs none of the features.
    easy = longest(config, 4, 10 * GIB, 64 * GIB, H100, 8, at=4096)
    t = easy.best.config.train
    assert not (t.offload_checkpoints or t.optimizer_offload or t.recompute_modules == ["block"]), t


def test_a_host_too_small_for_every_block_offloads_the_first_ones():
    config = load_config(None, SMALL)
    world, gpu, host = 4, 10 * GIB, 4 * GIB
    without = longest(config, world, gpu, 0, H100, 8)
    found = longest(config, world, gpu, host, H100, 8)
    _check_answer(found, config, world, gpu, host)
    t = found.best.config.train
    assert found.seq_len > without.seq_len, (found.seq_len, without.seq_len)
    assert t.offload_checkpoints and 0 < t.offload_checkpoints_layers < config.model.num_layers, t
    # Every block's input (8 blocks of the whole row, bf16, over the node's 4 ranks) would not fit.
    assert found.seq_len * config.model.dim * 2 * config.model.num_layers > host
    # One block more would not either: the largest N that fits.
    more = apply_longest(config, found)
    more.train.offload_checkpoints_layers += 1
    assert sum(n * c for n, c in checkpoint_host_buffers(validate(checkable(more), world)).items()) * world > host


def test_llama_8b_on_8_h100s_and_why_it_stops_short_of_4m():
    config = load_config(LLAMA)
    found = longest(config, 8, int(79.6 * GIB), 1024 * GIB, H100, 8)
    assert isinstance(found, Longest)
    _check_answer(found, config, 8, int(79.6 * GIB), 1024 * GIB)
    assert 2**21 <= found.seq_len < 2**22, found.seq_len  # 3.13M tokens
    # The next multiple misses on the GPU, by the backward's transients (a recomputed block with
    # the attention kernels' scratch), with the host not full.
    assert found.closest.memory.device_total > 79.6 * GIB and found.closest.host.node <= 1024 * GIB
    # At 4M tokens the host alone rules it out: every candidate's offloaded block inputs (32
    # layers x 4096 x 2 bytes a token: 1 TiB) fill the 1 TiB, with nothing left for the optimizer.
    base, _ = planning_copy(config)
    ok, closest = _fitting_at(base, 8, 8, 2**22, int(79.6 * GIB), 1024 * GIB, H100)
    assert not ok
    assert 32 * 4096 * 2 * 2**22 == 1024 * GIB
    # 8 H200s hold the optimizer and the last blocks' inputs on the GPU and pass 4M, the host full.
    found = longest(config, 8, 140 * GIB, 1024 * GIB, H200, 8)
    _check_answer(found, config, 8, 140 * GIB, 1024 * GIB)
    t = found.best.config.train
    assert found.seq_len > 2**22 and found.best.host.node > 1000 * GIB, (found.seq_len, found.best.host.node)
    assert not t.optimizer_offload and t.offload_checkpoints and 0 < t.offload_checkpoints_layers < 32, t


def test_longest_from_the_command_line_writes_a_config_that_validates(tmp_path, capsys):
    out = tmp_path / "long.toml"
    args = ["--longest", "--config", str(LLAMA), "--gpus", "1", "--gpu-memory-gib", "140", "--host-memory-gib", "1024",
            "--gpu", "h200", "--seq-len", "524288", "--write-config", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "train.seq_len on 1 GPUs of 140 GiB with 1024 GiB of host memory per node" in printed
    assert "calibration: " in printed and "h200_default.json" in printed and "micro-batch 1" in printed
    plan = validate(load_config(out), 1)
    assert plan.train.seq_len == 524288 and plan.train.micro_batch_size == 1
    assert estimate_memory(plan, allocator=H200.allocator).device_total <= 140 * GIB


@pytest.mark.parametrize("extra, says", [
    (["--longest"], "--longest needs --host-memory-gib"),
    (["--host-memory-gib", "64"], "plan with --longest"),
    (["--longest", "--host-memory-gib", "64", "--seq-len", "1000"], "--seq-len 1000 must be"),
    (["--longest", "--host-memory-gib", "64", "--measure", "1"], "--measure"),
    (["--longest", "--host-memory-gib", "-1"], "--host-memory-gib -1"),
    (["--longest", "--host-memory-gib", "0", "--gpu-memory-gib", "0.5"], "nothing trains 1024 tokens per row"),
])
def test_longest_misuse_is_one_line_and_exit_2(extra, says, capsys):
    argv = ["--config", str(ROOT / "launch/configs/tiny_dense.toml"), "--gpus", "2", "--gpu-memory-gib", "80"] + extra
    if extra.count("--gpu-memory-gib"):
        argv = argv[:4] + argv[6:]
    assert main(argv) == 2
    err = capsys.readouterr()
    assert not err.out and len(err.err.strip().splitlines()) == 1 and says in err.err, err.err
