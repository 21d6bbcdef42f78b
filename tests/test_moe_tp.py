"""Expert parallelism combined with tensor (+ sequence) parallelism equals the single-process
MoE model: ep=2 x tp=2 on 4 gloo processes, both expert layouts (etp=1: TP ranks route their
own token shards with replicated experts; etp=tp: expert hidden sizes split over TP), with and
without sequence parallelism.

Reference, procedure and tolerance: as in tests/test_moe_parallel.py (the same worker,
tests/support/moe_parity.py), plus `sync_sequence_parallel_grads` before the data-parallel
reduction and TP shards compared along `tp_shard_dim`.
"""

from __future__ import annotations

import pytest

from tests.support.distributed import run_distributed
from tests.support.moe_parity import parity_worker, report


@pytest.mark.slow
def test_ep2_x_tp2_match_single_process():
    pytest.importorskip("core.parallel.tensor", reason="tensor parallelism (apply_tp) not present")
    scenarios = {
        "ep2 x tp2, SP, etp=1 (split)": dict(ep=2, tp=2, sp=True, etp=1, moe=dict(num_shared_experts=1, aux_loss_per_sequence=True)),
        "ep2 x tp2, SP, etp=2 (sharded)": dict(ep=2, tp=2, sp=True, etp=2, moe=dict(num_shared_experts=1)),
        "ep2 x tp2, no SP, etp=1": dict(ep=2, tp=2, sp=False, etp=1),
        "ep2 x tp2, no SP, etp=2, allgather": dict(ep=2, tp=2, sp=False, etp=2, moe=dict(dispatcher="allgather", num_shared_experts=1)),
    }
    report(run_distributed(parity_worker, 4, scenarios))
