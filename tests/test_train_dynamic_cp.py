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
from tests.support.runs import CONFIG, MOE_CONFIG, NO_SAVE, RTOL, SMALL, losses, metrics, run_train
from tests.support.service import start_server

# seq_len 64 over 4 ranks: pieces of up to 16 tokens may run on one rank, up to 32 need a
# group of 2, longer ones a group of 4 (the test checks the plans do mix them).
DYNAMIC = ["parallel.cp=2", "parallel.dynamic_cp=true", "parallel.cp_token_budget=16"]


def read_plans(dataset) -> list:
    """The first 4 steps' plan entries as dp_cp ranks 0-3 of the run read them: [rank] -> batches."""
    srv, address = start_server([dataset])
    try:
        plans = []
        for rank in range(4):
            with DataClient(address, dp_rank=rank // 2, dp_size=2, cp_rank=rank % 2, cp_size=2,
                            seq_len=64, micro_batch_size=2, seed=1234, dynamic_cp=True, cp_token_budget=16,
                            rows_per_step=8, max_batches=4) as client:
                plans.append(list(client))
    finally:
        srv.stop(0)
    return plans


def group_sizes(dataset) -> set[int]:
    """CP group sizes in the first 4 steps' plans."""
    return {b.cp_group_size for batches in read_plans(dataset) for b in batches if b.cp_group_size}


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
def test_dynamic_cp_with_all_to_all_matches_the_ring_and_the_single_process(tmp_path, dataset, reference):
    """`parallel.cp_comm=a2a`: each entry's attention is an all-to-all over its own sub-group
    (tiny_dense: 4 query / 2 key-value heads, so groups of 4 repeat the key/value heads, groups
    of 2 do not, groups of 1 attend plainly). The plans are the ring's (the same requests), and
    both runs must follow the single process to RTOL (fp32, reduction order only); against each
    other too, as both are that close to one reference."""
    assert group_sizes(dataset) == {1, 2, 4}
    runs = {}
    for comm in ("a2a", "ring"):
        run_train(tmp_path / comm, dataset, 4, *DYNAMIC, f"parallel.cp_comm={comm}")
        runs[comm] = losses(tmp_path / comm)
    assert runs["a2a"].keys() == runs["ring"].keys() == reference.keys() and len(reference) == 4
    for step, loss in reference.items():
        assert runs["a2a"][step] == pytest.approx(loss, rel=RTOL), (step, runs, reference)
        assert runs["ring"][step] == pytest.approx(loss, rel=RTOL), (step, runs, reference)
        assert runs["a2a"][step] == pytest.approx(runs["ring"][step], rel=RTOL), (step, runs)


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
    # All-to-all: the default model's heads split over every group size of 4 ranks; at cp=1 too.
    heads = ["model.num_heads=4", "model.num_kv_heads=2", "parallel.cp_comm=a2a"]
    validate(load_config(None, dyn + heads), 4)
    validate(load_config(None, [*dyn[1:], *heads]), 4)
    for extra, message in ((["parallel.pp=2"], "parallel.pp > 1 is not supported"),
                           (["model.moe.num_experts=4", "model.moe.capacity_factor=1.0"], "capacity_factor > 0"),
                           (["parallel.cp_token_budget=-1"], "must be >= 0"),
                           (["parallel.cp_token_budget=63"], "needs 64 tokens per rank"),
                           (["parallel.cp_comm=a2a+ring", "parallel.cp_a2a=2"], "use cp_comm='a2a'"),
                           # 4 query heads: groups of 2 and 4 split them, the 8 of dp*cp = 8 would not.
                           (["parallel.cp_comm=a2a", "parallel.dp=4"], "over 8 ranks")):
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, dyn + extra), 8 if {"parallel.pp=2", "parallel.dp=4"} & set(extra) else 4)


# The MoE model (layers 1-3 MoE: top-2 of 8 experts, a shared expert, per-sequence balancing and
# z-loss) with its experts over pairs of the 4 ranks (ep=2), static and dynamic CP against one
# process. The per-sequence balancing loss, the z-loss and the loads are defined over the step's
# sequences and document tokens (moe/layer.py), which every layout holds alike.
MOE = ["model.num_layers=4", "model.moe.aux_loss_per_sequence=true"]


@pytest.mark.slow
def test_moe_with_expert_parallelism_under_dynamic_cp_matches_static_cp_and_single_process(tmp_path, dataset):
    """Loss to RTOL; each layer's loads exactly (the same routing: a flip would fail loudly);
    balancing and z-losses, the worst load and the aux term to 1e-5 relative (fp32 sums over
    another grouping of the tokens; measured about 1e-7). The plans really differ per rank:
    groups of 1, 2 and 4, ranks with different numbers of entries, so some run empty
    micro-batches in the waves where they have none; a mismatch of MoE calls would hang (the
    run's hang timeout ends it) or fail, not pass. Dynamic CP runs with the ring and with
    `cp_comm=a2a` (each entry's all-to-all over its sub-group, between the waves' MoE all-to-alls)."""
    plans = read_plans(dataset)
    assert {b.cp_group_size for batches in plans for b in batches if b.cp_group_size} == {1, 2, 4}
    counts, empty = [], 0
    for step in range(4):
        mine = [[b for b in batches if b.step == step] for batches in plans]
        waves = {b.cp_step_waves for m in mine for b in m}
        assert len(waves) == 1  # every rank is told the same number of waves
        counts.append([m[0].cp_microbatches_in_step for m in mine])
        w = waves.pop()
        empty += sum(w - c for c in counts[-1])
    assert any(len(set(c)) > 1 for c in counts), counts  # ranks run different numbers of entries
    assert empty > 0  # and some wave finds a rank without an entry
    runs = {}
    for name, nproc, extra in (("single", 1, ["parallel.ep=1", NO_SAVE]), ("static", 4, ["parallel.ep=2", "parallel.cp=2"]),
                               ("dynamic", 4, ["parallel.ep=2", *DYNAMIC]),
                               ("dynamic_a2a", 4, ["parallel.ep=2", *DYNAMIC, "parallel.cp_comm=a2a"])):
        run_train(tmp_path / name, dataset, nproc, *extra, *MOE, "train.hang_timeout_s=120", config=MOE_CONFIG)
        runs[name] = metrics(tmp_path / name)
    want = runs["single"]
    for name in ("static", "dynamic", "dynamic_a2a"):
        got = runs[name]
        assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
        for g, w in zip(got, want):
            assert g["loss"] == pytest.approx(w["loss"], rel=RTOL), (name, g["step"])
            moe = {k for k in w if k.startswith("moe/")}
            assert len([k for k in moe if k.endswith("/tokens_per_expert")]) == 3, sorted(moe)
            assert {k for k in g if k.startswith("moe/")} - {"moe/all_to_all_s"} == moe, (name, sorted(g))
            for key in moe:
                if key.endswith("/tokens_per_expert"):
                    assert g[key] == w[key], (name, g["step"], key, g[key], w[key])
                else:
                    assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-12), (name, g["step"], key)
            assert 0 < g["moe/all_to_all_s"] < g["step_s"], g
