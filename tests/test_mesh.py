"""The mesh hands out the groups the layout promises (4 gloo processes)."""

import pytest
import torch
import torch.distributed as dist

from core.mesh import ParallelMesh
from tests.support.distributed import run_distributed


def _groups(rank, world):
    mesh = ParallelMesh.build(pp=1, dp=2, cp=1, tp=2, ep=2)
    out = {}
    for name in ("tp", "dp", "dp_cp", "ep", "edp"):
        group = mesh.group(name)
        members = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([rank]), group=group)
        out[name] = sorted(int(m) for m in members)
    out["coords"] = (mesh.coordinate("dp"), mesh.coordinate("tp"), mesh.coordinate("ep"))
    # What host_group("dp_cp") builds under NCCL: gloo groups over the same ranks.
    group, _ = dist.new_subgroups_by_enumeration(mesh.dp_cp_rank_lists(), backend="gloo")
    members = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(members, torch.tensor([rank]), group=group)
    out["host_dp_cp"] = sorted(int(m) for m in members)
    return out


@pytest.mark.slow
def test_mesh_groups_follow_the_layout():
    results = run_distributed(_groups, 4)
    # tp fastest: ranks (0,1) and (2,3) are tensor-parallel peers; dp pairs (0,2), (1,3).
    assert [r["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["dp_cp"] for r in results] == [r["dp"] for r in results] == [r["host_dp_cp"] for r in results]
    # ep=2 folded onto dp=2: experts split over the data-parallel pair, edp size 1.
    assert [r["ep"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["edp"] for r in results] == [[0], [1], [2], [3]]
    assert [r["coords"] for r in results] == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
