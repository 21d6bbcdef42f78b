"""Checkpoint-input offload (`train.offload_checkpoints`, core/parallel/checkpoint_offload.py).

Reference: the same run with the same recomputation and the inputs left on the device. The
offload moves bytes and changes no value, so losses and gradients are compared with tolerance 0:
in-process on the tiny models (the schedule's own record says which tensors went to the host, in
which order they came back, and which came back ahead of their use), and through `tessera-train`
at one process (eager and compiled, against the plain single-process `reference`, which full
recomputation leaves bit for bit unchanged), at pp=2 (1F1B and interleaved) and at tp=2 (against
the same layout without the offload); with `train.offload_checkpoints_layers` only the first N
recomputed blocks move (in process and through `tessera-train`), and the planner's host buffers and
bytes count those alone. On the CPU the copies are synchronous; the streams, events
and pinned buffers of the GPU path are proved by the `gpu` test at the end where there is a GPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, load_config
from core.parallel.checkpoint_offload import CheckpointOffload, HostPool
from core.parallel.recompute import apply_recompute
from core.planner.memory import checkpoint_host_buffers, estimate_memory
from core.planner.state import offloaded_input_layers
from core.train.host_memory import available_bytes, check_host_memory
from core.train.model import build_model
from core.validation import validate
from core.train.trainer import Trainer
from tests.support.batches import micro_batch
from tests.support.runs import NO_SAVE, losses, metrics, run_train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "launch" / "configs" / "tiny_dense.toml"


def _grads(model, micro_batches) -> list[torch.Tensor]:
    for m in micro_batches:
        model(m.tokens, m.position_ids, m.meta).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _passes(events, kind):
    """{(chunk, micro): [positions in event order]} of one kind of event."""
    out: dict[tuple[int, int], list[int]] = {}
    for event in events:
        if event[0] == kind:
            chunk, micro, position = event[1]
            out.setdefault((chunk, micro), []).append(position)
    return out


def test_every_block_input_goes_to_the_host_and_comes_back_one_block_ahead():
    config = load_config(TINY, [])
    micro = [micro_batch(i, config.model.vocab_size) for i in range(2)]
    want = _grads(apply_recompute(build_model(config.model, seed=0), "full"), micro)
    schedule = CheckpointOffload(HostPool({}, pin=False), record=True)
    model = apply_recompute(build_model(config.model, seed=0), "full", checkpoint_offload=schedule,
                            offload_kinds={"block"})
    got = _grads(model, micro)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    blocks = list(range(config.model.num_layers))
    events = schedule.events
    # Gradient accumulation: each micro-batch is its own pass, stored in forward order, used in reverse.
    assert _passes(events, "store") == {(0, 0): blocks, (0, 1): blocks}
    assert _passes(events, "use") == {(0, 0): blocks[::-1], (0, 1): blocks[::-1]}
    assert _passes(events, "load") == {(0, 0): blocks[::-1], (0, 1): blocks[::-1]}
    for micro_index in (0, 1):
        last = (0, micro_index, blocks[-1])
        assert ("load", last, "demand") in events  # the first backward has nothing to overlap with
        for position in blocks[:-1]:  # the others come back as the next block's backward starts
            use_next = events.index(("use", (0, micro_index, position + 1)))
            assert events[use_next - 1] == ("load", (0, micro_index, position), "prefetch"), events
    assert schedule.stats["tensors"] == 2 * len(blocks)
    # One micro-batch at a time: the pool grew to one pass's blocks and every buffer came back.
    assert schedule.pool.made == len(blocks) and len(schedule.pool.free) == len(blocks)


def test_the_first_n_blocks_alone_go_to_the_host_in_the_planned_buffers():
    """train.offload_checkpoints_layers=2 of 4 recomputed blocks: blocks 0 and 1 store and load
    their inputs, 2 and 3 keep theirs; the gradients are those of no offload (tolerance 0: the
    copies change no value); the pool the planner sized holds exactly what moved, and the planner's
    host bytes are what the schedule stored in one micro-batch."""
    config = load_config(TINY, ["train.recompute=full", "train.offload_checkpoints=true",
                                "train.offload_checkpoints_layers=2", "train.precision=fp32"])
    validate(config, 1)
    t = config.train
    micro = [micro_batch(i, config.model.vocab_size, seq=t.seq_len, rows=t.micro_batch_size) for i in range(2)]
    want = _grads(apply_recompute(build_model(config.model, seed=0), "full"), micro)
    schedule = CheckpointOffload(HostPool(checkpoint_host_buffers(config), pin=False), record=True)
    model = apply_recompute(build_model(config.model, seed=0), "full", checkpoint_offload=schedule,
                            offload_kinds={"block"}, offload_layers=t.offload_checkpoints_layers)
    assert all(torch.equal(g, w) for g, w in zip(_grads(model, micro), want))
    first = [0, 1]
    assert _passes(schedule.events, "store") == {(0, 0): first, (0, 1): first}
    assert _passes(schedule.events, "load") == {(0, 0): first[::-1], (0, 1): first[::-1]}
    # Block 1's backward is the first with a moved input: it asks, block 0's comes ahead of its use.
    assert ("load", (0, 0, 1), "demand") in schedule.events and ("load", (0, 0, 0), "prefetch") in schedule.events
    assert schedule.stats["tensors"] == 2 * len(first)
    assert schedule.pool.planned == len(first) and schedule.pool.grown == 0
    estimate = estimate_memory(config, 0)
    assert estimate.offloaded == schedule.stats["bytes"] // len(micro)
    everything = load_config(TINY, ["train.recompute=full", "train.offload_checkpoints=true", "train.precision=fp32"])
    validate(everything, 1)
    moved_all = estimate_memory(everything, 0)
    # Each block left on the device keeps its input there: the device holds what the host does not.
    assert estimate.activations - moved_all.activations == moved_all.offloaded - estimate.offloaded \
        == 2 * estimate.offloaded // len(first)


def test_several_micro_batches_in_flight_come_back_to_their_own_backward():
    """A pipeline's order on one rank: two chunks, forwards of two micro-batches before their
    backwards, the first micro-batch's backward first. Each pass gets its own inputs back."""
    config = load_config(TINY, [])
    micro = [micro_batch(i, config.model.vocab_size) for i in range(2)]
    ref = [apply_recompute(build_model(config.model, seed=0), "full") for _ in range(2)]
    schedule = CheckpointOffload(HostPool({}, pin=False), record=True)
    chunks = [apply_recompute(build_model(config.model, seed=0), "full", checkpoint_offload=schedule,
                              offload_kinds={"block"}, chunk=c) for c in range(2)]

    def run(models):
        outs = [models[c](m.tokens, m.position_ids, m.meta).sum() for m in micro for c in range(2)]
        for out in outs:  # micro 0 chunk 0, micro 0 chunk 1, micro 1 ...
            out.backward()
        return [p.grad.clone() for model in models for p in model.parameters()]

    assert all(torch.equal(g, w) for g, w in zip(run(chunks), run(ref)))
    blocks = list(range(config.model.num_layers))
    keys = {(c, m): blocks for c in range(2) for m in range(2)}
    assert _passes(schedule.events, "store") == keys
    assert _passes(schedule.events, "use") == {k: v[::-1] for k, v in keys.items()}
    # All four passes were in host memory at once before the first backward.
    assert schedule.pool.made == 4 * len(blocks)


def test_eager_attention_core_moves_q_k_and_v():
    config = load_config(TINY, ["train.recompute_modules=['attention_core']", "train.offload_checkpoints=true",
                                "train.precision=fp32"])
    validate(config, 1)
    micro = [micro_batch(0, config.model.vocab_size)]
    want = _grads(apply_recompute(build_model(config.model, seed=0), modules=["attention_core"]), micro)
    schedule = CheckpointOffload(HostPool(checkpoint_host_buffers(config), pin=False), record=True)
    model = apply_recompute(build_model(config.model, seed=0), modules=["attention_core"], checkpoint_offload=schedule,
                            offload_kinds={"attention_core"})
    assert all(torch.equal(g, w) for g, w in zip(_grads(model, micro), want))
    assert schedule.stats["tensors"] == 3 * config.model.num_layers
    assert schedule.pool.grown == 0  # the planner's buffers held them (fp32 model, train.precision fp32)


def test_the_planner_moves_the_recomputed_inputs_to_host_bytes():
    base = ["train.recompute=full", "parallel.pp=2", "model.num_layers=4", "train.global_batch_size=32",
            "train.precision=bf16"]
    config = load_config(TINY, base)
    validate(config, 2)
    on = load_config(TINY, base + ["train.offload_checkpoints=true"])
    validate(on, 2)
    off, moved = estimate_memory(config, 0), estimate_memory(on, 0)
    block = config.train.micro_batch_size * config.train.seq_len * config.model.dim * 2
    flight = 2  # 1F1B, stage 0 of 2
    assert off.offloaded == 0 and moved.offloaded == flight * 2 * block
    assert off.activations - moved.activations == flight * 2 * block
    assert moved.breakdown()["host_offload"] == pytest.approx(flight * 2 * block / 2 ** 30)
    assert checkpoint_host_buffers(on, 0) == {block: flight * 2}
    assert checkpoint_host_buffers(config, 0) == {}


def test_the_planner_counts_the_first_n_recomputed_blocks_of_each_chunk():
    base = ["train.recompute=full", "train.offload_checkpoints=true", "parallel.pp=2", "model.num_layers=8",
            "train.global_batch_size=32", "train.precision=bf16"]

    def plan(*extra):
        config = load_config(TINY, base + list(extra))
        validate(config, 2)
        return config

    t, dim = plan().train, plan().model.dim
    block = t.micro_batch_size * t.seq_len * dim * 2  # one block's input in bf16
    flight = 2  # 1F1B, stage 0 of 2
    assert checkpoint_host_buffers(plan(), 0) == {block: flight * 4}
    assert checkpoint_host_buffers(plan("train.offload_checkpoints_layers=1"), 0) == {block: flight * 1}
    # More than a chunk's blocks is all of them.
    assert checkpoint_host_buffers(plan("train.offload_checkpoints_layers=9"), 0) == {block: flight * 4}
    # Interleaved: stage 0 holds layers 0-1 and 4-5; the first of each chunk offloads.
    inter = plan("parallel.pp_virtual_stages=2", "parallel.pp_schedule=interleaved",
                 "train.offload_checkpoints_layers=1")
    assert offloaded_input_layers(inter, 0) == {0, 4} and offloaded_input_layers(inter, 1) == {2, 6}
    # Of the recomputed blocks only: two recomputed per chunk, three asked for.
    assert offloaded_input_layers(plan("train.recompute_num_layers=2", "train.offload_checkpoints_layers=3"), 0) == {0, 1}
    one, every = estimate_memory(plan("train.offload_checkpoints_layers=1"), 0), estimate_memory(plan(), 0)
    assert (one.offloaded, every.offloaded) == (flight * block, flight * 4 * block)
    assert one.activations - every.activations == flight * 3 * block


@pytest.mark.parametrize("settings, match", [
    (["train.offload_checkpoints_layers=2"], "limits a checkpoint offload that is off; set train.offload_checkpoints"),
    (["train.offload_checkpoints=true", "train.recompute=full", "train.offload_checkpoints_layers=-1"], "must be >= 0"),
])
def test_offload_checkpoints_layers_is_checked(settings, match):
    with pytest.raises(ConfigError, match=match):
        validate(load_config(TINY, settings), 1)


@pytest.mark.parametrize("settings, match", [
    ([], "none it covers is recomputed; recompute train.recompute='full'"),
    (["train.recompute_modules=['attention']", "train.compile=true"], "recompute whole blocks"),
    (["train.recompute_modules=['mlp']"], "none it covers is recomputed"),
])
def test_offload_without_a_recomputed_block_is_refused(settings, match):
    config = load_config(TINY, ["train.offload_checkpoints=true", *settings])
    with pytest.raises(ConfigError, match=match):
        validate(config, 1)


def test_a_host_without_room_is_one_line(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000000 kB\nMemAvailable:     800000 kB\n")
    assert available_bytes(meminfo) == 800000 * 1024
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_host_memory({"x": 200000 * 1024}, meminfo)  # exactly the share fits
    with pytest.raises(ConfigError, match=r"needs 0\.19 GiB \(x 0\.19 GiB\) but has 0\.19 GiB .* / 4 processes"):
        check_host_memory({"x": 200001 * 1024}, meminfo)


@pytest.mark.slow
def test_a_run_whose_buffers_do_not_fit_stops_at_start(tmp_path, dataset):
    # A model wide enough that the two blocks' inputs of 2^20 tokens take twice this host's
    # available memory (the check runs before the model is built).
    tokens = 2 ** 20
    dim = 2 ** math.ceil(math.log2(2 * available_bytes() / (2 * tokens * 4)))
    proc = run_train(tmp_path / "run", dataset, 1, "train.recompute=full", "train.offload_checkpoints=true",
                     f"train.seq_len={tokens}", "train.micro_batch_size=1", "train.global_batch_size=1",
                     f"model.dim={dim}", "train.precision=fp32", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "host memory: this process needs" in lines[0] and "train.offload_checkpoints" in lines[0]
    assert "Traceback" not in proc.stderr


def _offloaded(run: Path) -> list[float]:
    return [r["offload_mib"] for r in metrics(run)]


BLOCK_MIB = 2 * 64 * 64 * 4 / 2 ** 20  # one micro-batch's block input: 2 rows of 64 tokens, dim 64, fp32


@pytest.mark.slow
@pytest.mark.parametrize("extra, blocks", [([], 2), (["train.compile=true"], 2),
                                           (["train.offload_checkpoints_layers=1"], 1)],
                         ids=["eager", "compiled", "first-block"])
def test_one_process_follows_the_reference_bit_for_bit(tmp_path, dataset, reference, extra, blocks):
    run_train(tmp_path / "run", dataset, 1, "train.recompute=full", "train.offload_checkpoints=true", *extra)
    assert losses(tmp_path / "run") == reference
    assert _offloaded(tmp_path / "run") == [blocks * 4 * BLOCK_MIB] * 4  # blocks x 4 micro-batches a step


@pytest.mark.slow
@pytest.mark.parametrize("layout, blocks", [
    (["parallel.pp=2"], 1),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2", "model.num_layers=4"], 1),
    (["parallel.tp=2"], 1),
], ids=["pp2-1f1b", "pp2-interleaved", "tp2"])
def test_layouts_are_bit_for_bit_the_same_with_the_offload(tmp_path, dataset, layout, blocks):
    """Rank 0's offloaded bytes, in blocks of the whole stream: at pp=2 its one block
    (interleaved: its second chunk starts from a received activation, which stays), at tp=2 both
    blocks, each its half of the stream (sequence parallelism)."""
    run_train(tmp_path / "off", dataset, 2, "train.recompute=full", *layout, NO_SAVE)
    run_train(tmp_path / "on", dataset, 2, "train.recompute=full", "train.offload_checkpoints=true", *layout)
    assert losses(tmp_path / "on") == losses(tmp_path / "off")
    assert _offloaded(tmp_path / "on") == [blocks * 4 * BLOCK_MIB] * 4


def _train_in_process(device: str, *extra: str):
    config = load_config(TINY, [f"train.device={device}", "train.micro_batch_size=2", "train.global_batch_size=4",
                                "train.seq_len=128", "train.recompute=full", *extra])
    trainer = Trainer(config)
    out = []
    for step in range(2):
        micro = [micro_batch(10 * step + i, config.model.vocab_size, device=device) for i in range(2)]
        result = trainer.step(micro)
        out.append((float(result.loss_sum), float(result.grad_norm), result.metrics.get("offload_mib")))
    return out, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer.inputs_offload


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [[], ["train.compile=true"]], ids=["eager", "compiled"])
def test_pinned_side_stream_copies_leave_training_identical_on_gpu(extra):
    """The copies run on side streams into pinned buffers, the compute stream waits on events
    only: a missing wait (a copy back read before it landed, a buffer reused before its copy
    read it) shows as a different loss or weight."""
    want, want_weights, _ = _train_in_process("cuda", *extra)
    got, weights, schedule = _train_in_process("cuda", "train.offload_checkpoints=true", *extra)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(torch.equal(weights[k], v) for k, v in want_weights.items())
    assert all(g[2] > 0 for g in got)
    assert schedule.pool.free and all(s.buffer.is_pinned() for s in schedule.pool.free)
    assert schedule.pool.grown == 0  # the planner's count held what the step kept in flight
