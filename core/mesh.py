"""The one object that builds and hands out process groups: pp x dp x cp x tp (+ experts).

Rank layout: tp varies fastest, then cp, then dp, then pp, so tensor-parallel peers sit on
the same node. Expert parallelism folds onto the dp x cp ranks of each (pp, tp) slice
(Megatron's "MoE parallel folding"): flattening dp x cp to one index i, the expert rank is
i % ep and the expert-data-parallel rank is i // ep.

Groups come from torch's DeviceMesh so DTensor (checkpoint resharding) sees the same
layout. Nothing reads global state: modules receive this object or a group from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelMesh:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    device_type: str = "cpu"
    mesh: DeviceMesh | None = field(default=None, repr=False)
    expert_mesh: DeviceMesh | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, device_type: str | None = None) -> "ParallelMesh":
        """Collective: every rank calls it with the same sizes, after init_process_group."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if pp * dp * cp * tp != world:
            raise ValueError(f"pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {pp * dp * cp * tp} != world size {world}")
        if (dp * cp) % ep:
            raise ValueError(f"ep={ep} must divide dp*cp={dp * cp}")
        if device_type is None:
            nccl = dist.is_initialized() and dist.get_backend() == "nccl"
            device_type = "cuda" if nccl else "cpu"
        self = cls(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, device_type=device_type)
        if not dist.is_initialized():
            return self
        ranks = torch.arange(world).view(pp, dp, cp, tp)
        self.mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "dp", "cp", "tp"))
        edp = dp * cp // ep
        expert_ranks = ranks.reshape(pp, edp, ep, tp)
        self.expert_mesh = DeviceMesh(device_type, expert_ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))
        return self

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    def coordinate(self, name: str) -> int:
        """This rank's index along pp/dp/cp/tp (from the main mesh) or ep/edp (expert mesh)."""
        if not self.distributed:
            return 0
        if name in ("ep", "edp"):
            return self.expert_mesh.get_local_rank(name)
        return self.mesh.get_local_rank(name)

    def size(self, name: str) -> int:
        if name == "edp":
            return self.dp * self.cp // self.ep
        if name == "dp_cp":
            return self.dp * self.cp
        return getattr(self, name)

    def group(self, name: str) -> dist.ProcessGroup | None:
        """Process group along one dimension, or along "dp_cp" (gradients are reduced over
        data and context ranks alike). None when not distributed."""
        if not self.distributed:
            return None
        if name not in self._cache:
            if name in ("ep", "edp"):
                self._cache[name] = self.expert_mesh.get_group(name)
            elif name == "dp_cp":
                self._cache[name] = self.submesh("dp", "cp").get_group() if self.dp * self.cp > 1 else self.mesh.get_group("dp")
            else:
                self._cache[name] = self.mesh.get_group(name)
        return self._cache[name]

    def host_group(self, name: str) -> dist.ProcessGroup | None:
        """A gloo group over the same ranks as `group(name)` ("dp_cp" or "world"), for reducing
        host values (label counts, metrics) without queueing anything on a GPU stream. A
        collective on first use: every rank must ask for the same names in the same order."""
        if not self.distributed:
            return None
        key = ("host", name)
        if key not in self._cache:
            if dist.get_backend() == "gloo":
                self._cache[key] = self.group(name) if name != "world" else dist.group.WORLD
            elif name == "world":
                self._cache[key] = dist.new_group(backend="gloo")
            elif name == "dp_cp":
                self._cache[key], _ = dist.new_subgroups_by_enumeration(self.dp_cp_rank_lists(), backend="gloo")
            else:
                raise ValueError(f"host_group: {name!r} is not one of 'dp_cp', 'world'")
        return self._cache[key]

    def dp_cp_rank_lists(self) -> list[list[int]]:
        """The ranks of every "dp_cp" group (one per pipeline stage and tensor-parallel rank)."""
        ranks = self.mesh.mesh  # [pp, dp, cp, tp]
        return [ranks[p, :, :, t].flatten().tolist() for p in range(ranks.shape[0]) for t in range(ranks.shape[3])]

    def submesh(self, *names: str) -> DeviceMesh:
        """A DeviceMesh over some dimensions; several names are flattened into one."""
        if len(names) == 1:
            return self.mesh[names[0]]
        key = "_".join(names)
        if ("submesh", key) not in self._cache:
            self._cache[("submesh", key)] = self.mesh[names]._flatten(key)
        return self._cache[("submesh", key)]

    @property
    def is_first_stage(self) -> bool:
        return self.coordinate("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coordinate("pp") == self.pp - 1


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """init_process_group from torchrun's environment; (rank, world, device). Single process
    without the environment stays undistributed."""
    if "RANK" not in os.environ or dist.is_initialized():
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        return rank, world, _device(backend)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), _device(backend)


def _device(backend: str | None) -> torch.device:
    if (backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
