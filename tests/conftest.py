"""Test-wide settings: GPU tests are skipped where there is no GPU (CI); the reference runs that
several modules compare against, run once per test run."""

import pytest
import torch

from tests import test_run_lifecycle as lifecycle
from tests import test_train as train


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A fixture imported into a second module is a second fixture there (its own run); these are
# defined once, here, and each module's `dataset` / `reference` fixture hands them on.

@pytest.fixture(scope="session")
def train_dataset(tmp_path_factory):
    return train.build_small_dataset(tmp_path_factory.mktemp("train-data"))


@pytest.fixture(scope="session")
def train_reference(tmp_path_factory, train_dataset):
    """tests/test_train.py's single-process run (test_train_dynamic_cp.py's reference too)."""
    run_dir = tmp_path_factory.mktemp("ref")
    train.run_train(run_dir, train_dataset, 1)
    return train.losses(run_dir)


@pytest.fixture(scope="session")
def lifecycle_dataset(tmp_path_factory):
    return lifecycle.build_small_dataset(tmp_path_factory.mktemp("lifecycle-data"))


@pytest.fixture(scope="session")
def lifecycle_reference(tmp_path_factory, lifecycle_dataset):
    """tests/test_run_lifecycle.py's uninterrupted 2-process run (test_faults.py's reference too)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = lifecycle.run(lifecycle.train_cmd(run_dir, lifecycle_dataset))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["step"]: r["loss"] for r in lifecycle.metrics(run_dir)}
