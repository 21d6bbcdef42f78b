"""End to end: `tessera-train` with dynamic context parallelism on a real data service.

Reference: the single-process run of tests/test_train.py (same config, same data). With
`parallel.dynamic_cp` the data service plans every global step over the dp*cp = 4 ranks and
the trainer runs the plan on CP sub-groups; the step's documents are the rows' documents
whatever the plan, and the loss is divided by the global label count, so per-step losses
must equal the reference. Tolerance as in test_train (fp32, reduction order only): 2e-4.
"""

from __future__ import annotations

import pytest

from core.config import ConfigError, load_config
from core.validation import validate
from dataservice.client import DataClient
from tests.support.cli import run_entry_point
from tests.support.runs import CONFIG, RTOL, SMALL, losses, run_train
from tests.support.service import start_server

# seq_len 64 over 4 ranks: pieces of up to 16 tokens may run on one rank, up to 32 need a
# group of 2, longer ones a group of 4 (the test checks the plans do mix them).
DYNAMIC = ["parallel.cp=2", "parallel.dynamic_cp=true", "parallel.cp_token_budget=16"]


def group_sizes(dataset) -> set[int]:
    """CP group sizes in the first 4 steps' plans, read as dp_cp ranks 0-3 of the run read them."""
    srv, address = start_server([dataset])
    sizes = set()
    try:
        for rank in range(4):
            with DataClient(address, dp_rank=rank // 2, dp_size=2, cp_rank=rank % 2, cp_size=2,
                            seq_len=64, micro_batch_size=2, seed=1234, dynamic_cp=True, cp_token_budget=16,
                            rows_per_step=8, max_batches=4) as client:
                sizes |= {b.cp_group_size for b in client if b.cp_group_size}
    finally:
        srv.stop(0)
    return sizes


@pytest.mark.slow
def test_dynamic_cp_on_4_processes_matches_single_process_and_resumes(tmp_path, dataset, reference):
    assert group_sizes(dataset) == {1, 2, 4}
    # Steps 1-2, checkpoint, then steps 3-4 after a restart: the resume token lands on a step boundary.
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, 4, *DYNAMIC, "train.stop_at_step=2")
    first = losses(run_dir)
    run_train(run_dir, dataset, 4, *DYNAMIC, resume=True)
    got = {**first, **losses(run_dir)}
    assert got.keys() == reference.keys()
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (step, got, reference)


@pytest.mark.slow
def test_budget_too_small_for_a_row_exits_2_with_one_clear_line(tmp_path, dataset):
    # Refused before any training: the entry point in this process (tests/support/cli.py).
    args = ["--config", CONFIG]
    for item in [*SMALL, f"data.dataset={dataset}", f"train.run_dir={tmp_path}", "parallel.dynamic_cp=true",
                 "parallel.cp_token_budget=10"]:
        args += ["--set", item]
    proc = run_entry_point("core.train.cli", *args)
    assert proc.returncode == 2
    assert "tessera-train: error:" in proc.stderr and "parallel.cp_token_budget >= 64" in proc.stderr, proc.stderr


def test_config_derives_the_budget_and_refuses_what_dynamic_cp_cannot_run():
    dyn = ["parallel.cp=2", "parallel.dynamic_cp=true", "train.seq_len=256", "train.micro_batch_size=2"]
    config = validate(load_config(None, dyn), 4)
    assert config.parallel.cp_token_budget == 256  # micro_batch_size*seq_len/cp: static CP's per-rank tokens
    for extra, message in ((["parallel.pp=2"], "parallel.pp > 1 is not supported"),
                           (["model.moe.num_experts=4"], "MoE"),
                           (["parallel.cp_token_budget=-1"], "must be >= 0"),
                           (["parallel.cp_token_budget=63"], "needs 64 tokens per rank")):
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, dyn + extra), 8 if "parallel.pp=2" in extra else 4)
