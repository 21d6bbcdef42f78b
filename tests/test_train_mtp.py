"""Multi-token prediction end to end: `tessera-train` with model.mtp_layers=2 on a real data service.

Reference: the single-process run of the same config and rows. Every layout reads the same
global rows, makes each depth's inputs and targets on the whole packed micro-batch before any
context-parallel split, and divides each depth's summed loss by that depth's global label
count, so per step the main loss (`loss`) and every depth's (`mtp_loss_k`, and their mean
`mtp_loss`) must agree. Tolerance: tests/test_train.py's, fp32 on CPU with differences from
reduction order only, over 4 AdamW steps: rel 2e-4 (RTOL). Measured at the time of writing:
at most 1.2e-7 on every layout below.

Layouts: cp=2 (ring), dynamic CP over 2 ranks (dense: dynamic CP refuses MoE), pp=2 (the MTP
modules on the last stage with a tied copy of the embedding), pp=2 with a tied output head,
interleaved and fully recomputed, tp=2 with sequence parallelism, ZeRO-1 throughout (the
configs' distributed_optimizer), and the MoE model (MTP blocks are MoE blocks) at ep=2 and
ep=2 x pp=2, with one row per micro-batch so that every layout runs the reference's
micro-batches (the balancing losses are per micro-batch). Then a checkpoint saved at pp=2
and resumed at pp=1, and `checkpoint.init_from` weights of a trained MTP model at 1 process
and at pp=2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

from core.state.checkpoint import latest_checkpoint
from core.state.pretrained import SINGLE_NAME
from interop.convert import CheckpointWeights
from tests.support.runs import MOE_CONFIG, NO_SAVE, RTOL, metrics, run_train

MTP = ("model.mtp_layers=2", "train.mtp_loss_weight=0.3")
KEYS = ("loss", "mtp_loss", "mtp_loss_0", "mtp_loss_1")
MOE = ("parallel.ep=1", "train.micro_batch_size=1")


def _losses(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: r[k] for k in KEYS} for r in metrics(run_dir)}


def _assert_match(got: dict, ref: dict, steps=None) -> None:
    steps = sorted(ref) if steps is None else steps
    for step in steps:
        for key in KEYS:
            assert got[step][key] == pytest.approx(ref[step][key], rel=RTOL), (step, key, got, ref)


@pytest.fixture(scope="module")
def mtp_reference(tmp_path_factory, train_dataset):
    run_dir = tmp_path_factory.mktemp("mtp-ref")
    run_train(run_dir, train_dataset, 1, *MTP)
    got = _losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    # MTP trains: each depth's loss falls, and the deeper depth is the harder one by the end.
    assert got[4]["mtp_loss_0"] < got[1]["mtp_loss_0"] - 0.3 and got[4]["mtp_loss_1"] < got[1]["mtp_loss_1"] - 0.3
    return run_dir, got


DENSE_LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"]),
    "dynamic_cp2": (2, ["parallel.cp=2", "parallel.dynamic_cp=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2_sp": (2, ["parallel.tp=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", DENSE_LAYOUTS)
def test_mtp_layouts_match_single_process(tmp_path, dataset, mtp_reference, name):
    nproc, overrides = DENSE_LAYOUTS[name]
    run_train(tmp_path / "run", dataset, nproc, *MTP, *overrides)
    _assert_match(_losses(tmp_path / "run"), mtp_reference[1])


@pytest.mark.slow
def test_mtp_with_a_tied_head_over_an_interleaved_recomputed_pipeline(tmp_path, dataset):
    # The last stage's embedding copy is then the tied head's weight itself.
    base = (*MTP, "model.tie_embeddings=true", "model.num_layers=4")
    run_train(tmp_path / "ref", dataset, 1, *base, NO_SAVE)
    run_train(tmp_path / "pp", dataset, 2, *base, "parallel.pp=2", "parallel.pp_schedule=interleaved",
              "parallel.pp_virtual_stages=2", "train.recompute=full")
    _assert_match(_losses(tmp_path / "pp"), _losses(tmp_path / "ref"))


@pytest.fixture(scope="module")
def mtp_moe_reference(tmp_path_factory, train_dataset):
    """{step: losses} of the MoE model with MTP on one process (both expert-parallel layouts')."""
    run_dir = tmp_path_factory.mktemp("mtp-moe-ref")
    run_train(run_dir, train_dataset, 1, *MTP, *MOE, NO_SAVE, config=MOE_CONFIG)
    return _losses(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, overrides", [(2, ["parallel.ep=2"]), (4, ["parallel.ep=2", "parallel.pp=2"])],
                         ids=["ep2", "ep2xpp2"])
def test_mtp_moe_blocks_under_expert_parallelism_match_single_process(tmp_path, dataset, mtp_moe_reference, nproc,
                                                                      overrides):
    run_train(tmp_path / "run", dataset, nproc, *MTP, *MOE, *overrides, config=MOE_CONFIG)
    _assert_match(_losses(tmp_path / "run"), mtp_moe_reference)
    # SMALL has 2 layers (0 dense, 1 MoE): the MTP blocks are layers 2 and 3, MoE blocks, and
    # their statistics are logged like the model's own.
    record = metrics(tmp_path / "run")[-1]
    assert {"moe/layer2/aux_loss", "moe/layer3/aux_loss"} <= record.keys(), sorted(record)


@pytest.mark.slow
def test_mtp_checkpoint_saved_at_pp2_resumes_at_pp1(tmp_path, dataset, mtp_reference):
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, 2, *MTP, "parallel.pp=2", "train.stop_at_step=2")
    run_train(run_dir, dataset, 2, *MTP, "parallel.pp=1", resume=True)
    _assert_match(_losses(run_dir), mtp_reference[1], steps=[3, 4])


@pytest.mark.slow
def test_init_from_weights_of_an_mtp_model_at_one_process_and_pp2(tmp_path, dataset, mtp_reference):
    # The reference run's last checkpoint as a weights folder (the model's own names): the MTP
    # modules under mtp.{k}, one embedding, which the last pipeline stage's copy reads too.
    weights = CheckpointWeights(latest_checkpoint(mtp_reference[0] / "checkpoints"))
    names = weights.names()
    assert "mtp.1.eh_proj.weight" in names and not any("embed" in n for n in names if n.startswith("mtp."))
    folder = tmp_path / "weights"
    folder.mkdir()
    save_file({name: weights.read(name).contiguous() for name in names}, str(folder / SINGLE_NAME))
    init = (*MTP, f"checkpoint.init_from={folder}", "train.max_steps=1")
    run_train(tmp_path / "one", dataset, 1, *init)
    run_train(tmp_path / "pp", dataset, 2, *init, "parallel.pp=2")
    one, pp = _losses(tmp_path / "one"), _losses(tmp_path / "pp")
    _assert_match(pp, one)
    # The trained weights were loaded, the MTP modules' too: step 1 starts from what the
    # reference reached, not from a fresh initialisation.
    fresh = mtp_reference[1][1]
    for key in KEYS:
        assert one[1][key] < fresh[key] - 0.3, (key, one, fresh)
