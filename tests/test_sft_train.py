"""End to end: fine-tuning data (loss only on the answers) with yarn-scaled RoPE, trained and
validated under context parallelism, CP x TP and dynamic CP, against the single process.

Every layout reads the same rows and divides the summed token loss by the global label count,
and the masks travel as labels (-100), so per-step training losses and the validation losses
must equal the reference within test_train's tolerance (fp32, reduction order only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dataservice.build import build_dataset
from tests.support.runs import RTOL, losses, run_train, val_records
from tests.support.sft import conversations

YARN = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0",
        "model.rope_scaling.original_max_position_embeddings=16"]
EVAL = ["eval.interval=2", "eval.steps=2", "eval.seed=7"]
LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"]),
    "cp2xtp2": (4, ["parallel.cp=2", "parallel.tp=2"]),
    "dynamic-cp2xdp2": (4, ["parallel.cp=2", "parallel.dynamic_cp=true", "parallel.cp_token_budget=16"]),
}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("sft-train-data")
    train = build_dataset([conversations(tmp / "train.jsonl", 300, seed=1)], tmp / "train")
    held = build_dataset([conversations(tmp / "held.jsonl", 80, seed=2)], tmp / "held")
    return train, held


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory, sft_data) -> Path:
    train, held = sft_data
    run_dir = tmp_path_factory.mktemp("sft-ref")
    run_train(run_dir, train, 1, *YARN, *EVAL, f"eval.dataset={held}")
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sft_losses_and_val_losses_match_single_process(tmp_path, sft_data, sft_reference, name):
    train, held = sft_data
    nproc, overrides = LAYOUTS[name]
    run_train(tmp_path, train, nproc, *YARN, *EVAL, f"eval.dataset={held}", *overrides)
    want, got = losses(sft_reference), losses(tmp_path)
    assert got.keys() == want.keys() == {1, 2, 3, 4}
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (name, step, got, want)
    want_val, got_val = val_records(sft_reference), val_records(tmp_path)
    assert sorted(got_val) == sorted(want_val) == [2, 4]
    for step, record in want_val.items():
        assert got_val[step]["val_loss"] == pytest.approx(record["val_loss"], rel=RTOL), (name, step)
        for key, loss in record["val_loss_by_position"].items():
            assert got_val[step]["val_loss_by_position"][key] == pytest.approx(loss, rel=RTOL), (name, step, key)
