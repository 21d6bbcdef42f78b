"""Validation loss (`[eval]`): `Trainer.evaluate()` against a hand computation over the same
held-out rows, `val_loss` in metrics.jsonl at the intervals, the same value at the same step
in two runs and under the parallel layouts (the tolerance of tests/test_train.py), and the
config's refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core.config import ConfigError, load_config
from core.validation import validate
from core.train.data import LocalServer, to_inputs
from core.train.trainer import Trainer, position_buckets
from dataservice.build import build_dataset, make_corpus
from dataservice.client import DataClient
from moe.layer import moe_layers
from tests.support.runs import CONFIG, MOE_CONFIG, RTOL, run_train, val_records

EVAL = ["eval.interval=2", "eval.steps=2", "eval.seed=7"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("eval-data")
    train = build_dataset([make_corpus(tmp, n_docs=300, seed=3, min_len=16, max_len=600)], tmp / "train-shards")
    held = build_dataset([make_corpus(tmp, n_docs=100, seed=11, min_len=16, max_len=600)], tmp / "held-shards")
    return train, held


def test_position_buckets():
    assert position_buckets(64) == [0, 64]
    assert position_buckets(100) == [0, 64, 100]
    assert position_buckets(4096) == [0, 64, 256, 1024, 4096]


def test_evaluate_equals_the_mean_token_loss_of_the_same_rows(tmp_path, datasets):
    _, held = datasets
    server = LocalServer(str(held))
    try:
        config = load_config(CONFIG, ["model.dim=64", "model.num_layers=2", "model.ffn_dim=128", "train.seq_len=128",
                                      "train.micro_batch_size=2", "train.global_batch_size=4", "train.device=cpu",
                                      f"train.run_dir={tmp_path}", f"eval.address={server.address}", *EVAL])
        validate(config, 1)
        trainer = Trainer(config)
        try:
            first, again = trainer.evaluate(), trainer.evaluate()
        finally:
            trainer.close()
        assert first == again  # the same rows each time, nothing in the model moved
        sums, counts = {}, {}
        with DataClient([server.address], dp_rank=0, dp_size=1, seq_len=128, micro_batch_size=2, seed=7) as client:
            batches = iter(client)
            with torch.no_grad():
                for _ in range(2 * 2):  # eval.steps global batches of 2 micro-batches
                    m = to_inputs(next(batches), torch.device("cpu"))
                    logits = trainer.model(m.tokens, m.position_ids, m.meta)
                    per_token = F.cross_entropy(logits.double(), m.labels, ignore_index=-100, reduction="none")
                    for low, high in [(None, None), (0, 64), (64, 128)]:
                        keep = m.labels != -100
                        if low is not None:
                            keep &= (m.position_ids >= low) & (m.position_ids < high)
                        key = "all" if low is None else f"{low}-{high}"
                        sums[key] = sums.get(key, 0.0) + float(per_token[keep].sum())
                        counts[key] = counts.get(key, 0) + int(keep.sum())
        assert first["val_loss"] == pytest.approx(sums["all"] / counts["all"], rel=1e-5)
        assert set(first["val_loss_by_position"]) == {"0-64", "64-128"}
        for key, loss in first["val_loss_by_position"].items():
            assert loss == pytest.approx(sums[key] / counts[key], rel=1e-5), key
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, datasets) -> dict[int, dict]:
    train, held = datasets
    run_dir = tmp_path_factory.mktemp("eval-ref")
    run_train(run_dir, train, 1, *EVAL, "train.max_steps=5", f"eval.dataset={held}")
    return val_records(run_dir)


@pytest.mark.slow
def test_val_loss_at_the_intervals_and_the_end_and_equal_across_runs(tmp_path, datasets, reference):
    train, held = datasets
    assert sorted(reference) == [2, 4, 5]
    for record in reference.values():
        assert record["val_loss"] > 0 and set(record["val_loss_by_position"]) == {"0-64"}
    assert reference[5]["val_loss"] < reference[2]["val_loss"]
    run_train(tmp_path, train, 1, *EVAL, "train.max_steps=5", f"eval.dataset={held}", "train.plot=true")
    again = val_records(tmp_path)
    assert {s: r["val_loss"] for s, r in again.items()} == {s: r["val_loss"] for s, r in reference.items()}
    assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.slow
# Context parallelism (static and dynamic) is proved on fine-tuning data in tests/test_sft_train.py.
@pytest.mark.parametrize("overrides", [["parallel.tp=2"], []], ids=["tp2", "dp2"])
def test_layouts_give_the_single_process_val_loss(tmp_path, datasets, reference, overrides):
    train, held = datasets
    run_train(tmp_path, train, 2, *EVAL, "train.max_steps=5", f"eval.dataset={held}", *overrides)
    got = val_records(tmp_path)
    assert got.keys() == reference.keys()
    for step, record in reference.items():
        assert got[step]["val_loss"] == pytest.approx(record["val_loss"], rel=RTOL), (step, got, reference)
        for key, loss in record["val_loss_by_position"].items():
            assert got[step]["val_loss_by_position"][key] == pytest.approx(loss, rel=RTOL), (step, key)


@pytest.mark.parametrize("items, words", [
    (["eval.interval=-1"], "eval.interval=-1 must be >= 0"),
    (["eval.steps=0"], "eval.steps=0 must be >= 1"),
    (["eval.interval=5"], "eval.interval=5 needs held-out data"),
    (["eval.interval=5", "eval.dataset=/no/such/folder"], "eval.dataset='/no/such/folder': no such folder"),
    (["eval.interval=5", "eval.address=127.0.0.1:1", "parallel.pp=2"], "parallel.pp > 1 is not supported"),
])
def test_config_misuse(items, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate(load_config(CONFIG, items), 2 if "parallel.pp=2" in items else 1)


def test_moe_evaluation_leaves_the_routing_statistics_alone(tmp_path, datasets):
    # Eval mode: no per-expert loads for the bias update, no statistics for the step's metrics.
    _, held = datasets
    config = load_config(MOE_CONFIG, ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=4",
                                      "parallel.ep=1", "train.device=cpu", "model.moe.bias_update_rate=0.01",
                                      f"train.run_dir={tmp_path}", f"eval.dataset={held}", *EVAL])
    validate(config, 1)
    trainer = Trainer(config)
    try:
        first, again = trainer.evaluate(), trainer.evaluate()
        layers = moe_layers(trainer.model)
        assert layers and trainer.model.training
        for layer in layers:
            assert not layer._stats and int(layer._bias_load.sum()) == 0
        assert first == again and first["val_loss"] > 0
    finally:
        trainer.close()
