"""End to end: `tessera-train` on a real data service, under several layouts.

Reference: the single-process run (tp=1, dp=1) on the same config and data. Every layout
reads the same global rows per step (the data service's elastic order) and divides the
summed token loss by the global label count, so per-step losses must agree. Tolerance:
fp32 on CPU, differences only from reduction order (TP splits matmuls and the softmax
normaliser; DP sums gradients in another order), compounded over a few AdamW steps:
2e-4 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.runs import MOE_CONFIG, RTOL, SMALL, losses, run_train

@pytest.mark.slow
def test_single_process_writes_metrics_checkpoint_and_loss_falls(tmp_path, dataset):
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, 1, "train.max_steps=12", "train.plot=true", "train.lr=1e-2")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_gb"):
        assert key in records[0]
    for r in records:  # the wait for data is part of the step (the first waits for the server's stream)
        assert 0 <= r["data_wait_s"] < r["step_s"], r
        assert 0.5 * 8 * 64 < r["tokens_per_s"] * r["step_s"] <= 8 * 64 * (1 + 1e-9)  # 8 packed rows of 64
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert (run_dir / "checkpoints" / "latest").exists()


# tp and dp alone are in tp2xdp2; each other layout adds one parallelism to tp.
LAYOUTS = {
    "tp2xdp2": (4, ["parallel.tp=2"]),
    "cp2xtp2": (4, ["parallel.cp=2", "parallel.tp=2"]),
    "pp2xtp2": (4, ["parallel.pp=2", "parallel.tp=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_parallel_layouts_match_single_process(tmp_path, dataset, reference, name):
    nproc, overrides = LAYOUTS[name]
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, nproc, *overrides)
    got = losses(run_dir)
    assert got.keys() == reference.keys()
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (step, got, reference)


@pytest.mark.slow
@pytest.mark.parametrize("resume_tp", [1], ids=["tp1xdp4"])
def test_resume_continues_the_loss_trajectory(tmp_path, dataset, reference, resume_tp):
    # Save at tp=2 x dp=2 after step 2, resume at tp=1 x dp=4 (resharding): steps 3-4 equal the
    # uninterrupted run. Resuming at the same layout: tests/test_run_lifecycle.py.
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, 4, "parallel.tp=2", "train.stop_at_step=2")
    run_train(run_dir, dataset, 4, f"parallel.tp={resume_tp}", resume=True)
    got = losses(run_dir)
    for step in (3, 4):
        assert got[step] == pytest.approx(reference[step], rel=RTOL), (step, got, reference)


@pytest.mark.slow
def test_tied_embedding_across_pipeline_stages_matches_single_process(tmp_path, dataset):
    # The embedding (first stage) and output head (last stage) share one weight: their
    # gradients are summed across stages after the data-parallel reduction (pp=2 x dp=2).
    tied = ("model.tie_embeddings=true",)
    run_train(tmp_path / "ref", dataset, 1, *tied)
    run_train(tmp_path / "pp", dataset, 4, *tied, "parallel.pp=2")
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "pp")
    assert got.keys() == ref.keys()
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (step, got, ref)


MOE_LAYOUTS = {
    "ep2xdp4": ["parallel.ep=2"],
    "ep2xtp2": ["parallel.ep=2", "parallel.tp=2"],
    "ep2xpp2": ["parallel.ep=2", "parallel.pp=2"],
    "ep2xcp2": ["parallel.ep=2", "parallel.cp=2"],
    # These (and the reference) write expert weight gradients straight into the fp32 main grads;
    # that the unfused path gives the same main grads is tests/test_moe.py's, in process.
}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, train_dataset) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("moe-ref")
    run_train(run_dir, train_dataset, 1, "parallel.ep=1", config=MOE_CONFIG)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert "moe/all_to_all_s" not in first  # no expert parallelism, no exchange to time
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        # A record is read after the next step is queued: its loads are still its own step's
        # (the document tokens of 8 rows of 64, top-2: padding is not counted), not the next
        # step's or none.
        loads = [v for k, v in record.items() if k.endswith("/tokens_per_expert")]
        tokens = round(record["tokens_per_s"] * record["step_s"])
        assert 0.5 * 8 * 64 < tokens <= 8 * 64
        assert loads and all(sum(load) == 2 * tokens for load in loads), (tokens, record)
    return losses(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_moe_layouts_match_single_process(tmp_path, dataset, moe_reference, name):
    # The MoE model (dropless top-2 of 8 experts, a shared expert, aux and z losses) with
    # experts folded onto data-parallel ranks, under tensor, pipeline and context parallelism.
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, 4, *MOE_LAYOUTS[name], config=MOE_CONFIG)
    got = losses(run_dir)
    assert got.keys() == moe_reference.keys()
    for step, loss in moe_reference.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (step, got, moe_reference)
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        # ep=2: every step spends some time in the token all-to-alls, and less than the step
        # (with pp=2 too: the metrics are every stage's, not rank 0's, whose holds no MoE layer).
        assert 0 < record["moe/all_to_all_s"] < record["step_s"], record


# Per-sequence balancing through the pipeline, and the MoE metrics of every rank and stage:
# 4 layers (0 dense, 1-3 MoE), so each of two stages holds MoE layers. One row per micro-batch:
# every layout then runs the reference's micro-batches (with two, dp=2 pairs other rows), and
# the auxiliary losses, which are per micro-batch, are the same ones.
PER_SEQUENCE = ["model.num_layers=4", "model.moe.aux_loss_per_sequence=true", "train.micro_batch_size=1"]
MOE_METRIC_LAYOUTS = {
    "pp2": (2, ["parallel.pp=2", "parallel.ep=1"]),
    "pp2_interleaved_recompute": (2, ["parallel.pp=2", "parallel.ep=1", "parallel.pp_schedule=interleaved",
                                      "parallel.pp_virtual_stages=2", "train.recompute=full"]),
    "pp2xep2": (4, ["parallel.pp=2", "parallel.ep=2"]),
    # Each micro-batch is balanced as one over its CP group, without the split's padding.
    "cp2xep2": (4, ["parallel.cp=2", "parallel.ep=2"]),
    "dp2": (2, ["parallel.ep=1"]),
}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def per_sequence_reference(tmp_path_factory, train_dataset) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("moe-per-sequence-ref")
    run_train(run_dir, train_dataset, 1, "parallel.ep=1", *PER_SEQUENCE, config=MOE_CONFIG)
    return records(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_METRIC_LAYOUTS)
def test_moe_metrics_and_per_sequence_aux_match_single_process(tmp_path, dataset, per_sequence_reference, name):
    """Per step, the loss and every logged MoE metric (each layer's loads, drops, aux and z
    losses; the worst load, the aux term) equal the single-process run's: the loss to RTOL,
    the MoE losses to 1e-5 relative (fp32 sums in another order; measured 2e-7), the loads
    exactly (the same routing: weights that differ by rounding flip no choice on this data, and
    a flip would fail loudly, not pass wrongly)."""
    nproc, overrides = MOE_METRIC_LAYOUTS[name]
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, nproc, *overrides, *PER_SEQUENCE, config=MOE_CONFIG)
    got, want = records(run_dir), per_sequence_reference
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=RTOL), (name, g["step"])
        moe = {k for k in w if k.startswith("moe/")}
        assert len([k for k in moe if k.endswith("/tokens_per_expert")]) == 3, sorted(moe)  # layers 1-3
        assert {k for k in g if k.startswith("moe/")} - {"moe/all_to_all_s"} == moe, (name, sorted(g))
        for key in moe:
            if key.endswith("/tokens_per_expert"):
                assert g[key] == w[key], (name, g["step"], key, g[key], w[key])
            else:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-12), (name, g["step"], key, g[key], w[key])
        if "parallel.ep=2" in overrides:  # both stages' exchanges, averaged over a stage's ranks
            assert 0 < g["moe/all_to_all_s"] < g["step_s"], g


@pytest.mark.slow
def test_records_read_after_the_next_step_is_queued_equal_records_read_at_once(tmp_path, dataset):
    """`run` on a GPU reads a step's record once the next step is queued; forced on the CPU it
    writes the records of reading each step at once: same steps, losses, norms, MoE loads,
    evaluations and checkpoint timings, in order."""
    from core.config import load_config
    from core.validation import validate
    from core.train.trainer import Trainer

    records = {}
    for lagged in (False, True):
        run_dir = tmp_path / f"lagged-{lagged}"
        config = load_config(MOE_CONFIG, [*SMALL, "train.max_steps=5", "parallel.ep=1", "train.device=cpu",
                                          f"data.dataset={dataset}", f"train.run_dir={run_dir}", "eval.interval=2",
                                          "eval.steps=1", f"eval.dataset={dataset}", "checkpoint.interval=3"])
        validate(config, 1)
        trainer = Trainer(config)
        trainer.lagged_records = lagged
        trainer.run()
        records[lagged] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plain, lagged = records[False], records[True]
    assert [r["step"] for r in lagged] == [1, 2, 3, 4, 5]
    def measured(key: str) -> bool:  # times and memory: not the same in two runs
        return key.endswith("_s") or key.startswith("busy_s") or key in ("tokens_per_s", "mfu", "mem_gb")

    for a, b in zip(plain, lagged):
        assert {k: v for k, v in a.items() if not measured(k)} == {k: v for k, v in b.items() if not measured(k)}
        assert b["step_s"] > 0 and b["tokens_per_s"] > 0 and "moe/max_mean_load" in b
    assert [("val_loss" in r, "save_blocking_s" in r) for r in lagged] == [
        (False, False), (True, False), (False, True), (True, False), (True, True)]
