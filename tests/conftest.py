"""Test-wide settings: GPU tests are skipped where there is no GPU (CI); the fixtures several
modules share, among them the reference runs they compare against, run once per test run."""

from pathlib import Path

import pytest
import torch

from dataservice.build import build_dataset, make_corpus
from tests.support import lifecycle, runs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The expensive ones are session-wide, defined once here; a module's own fixture of the same
# name (tests/test_bad_input.py's `dataset`, tests/test_eval.py's `reference`, ...) overrides them.

@pytest.fixture(scope="session")
def train_dataset(tmp_path_factory):
    return runs.build_small_dataset(tmp_path_factory.mktemp("train-data"))


@pytest.fixture(scope="session")
def train_reference(tmp_path_factory, train_dataset):
    """tests/test_train.py's single-process run (the reference of every layout run of SMALL)."""
    run_dir = tmp_path_factory.mktemp("ref")
    runs.run_train(run_dir, train_dataset, 1)
    return runs.losses(run_dir)


@pytest.fixture(scope="session")
def lifecycle_dataset(tmp_path_factory):
    return runs.build_small_dataset(tmp_path_factory.mktemp("lifecycle-data"))


@pytest.fixture(scope="session")
def lifecycle_reference(tmp_path_factory, lifecycle_dataset):
    """tests/test_run_lifecycle.py's uninterrupted 2-process run (test_faults.py's reference too)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = lifecycle.run(lifecycle.train_cmd(run_dir, lifecycle_dataset))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["step"]: r["loss"] for r in runs.metrics(run_dir)}


@pytest.fixture
def dataset(train_dataset) -> Path:
    """The small dataset of `runs.run_train` (built once per session)."""
    return train_dataset


@pytest.fixture
def reference(train_reference) -> dict[int, float]:
    """{step: loss} of the single-process run of `runs.SMALL` (once per session)."""
    return train_reference


@pytest.fixture(scope="module")
def fresh_text(tmp_path_factory):
    """1.2M tokens: 500 steps of 8 x 256 read each document at most once, so the loss measures
    learning the text's statistics, not memorising a small set of documents (where runs drift
    apart by a few % whatever their precision: bf16 eager against compiled, 0.9% on the tests'
    small dataset). Built per module that asks (the GPU runs of long FP8 recipes)."""
    tmp = tmp_path_factory.mktemp("fresh-text")
    return build_dataset([make_corpus(tmp, n_docs=4000, seed=5, min_len=64, max_len=1200)], tmp / "shards")
