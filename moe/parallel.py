"""Expert parallelism as a step applied to a plain model: `apply_ep(model, mesh, ...)`.

Expert parallelism is folded onto the dp x cp ranks (core.mesh): the "ep" group holds the
ranks that split the experts between them, each rank keeping experts
[ep_rank * E/ep, (ep_rank + 1) * E/ep); those ranks hold different tokens (they are
data-parallel ranks), and the dispatcher trades tokens over the group. Expert gradients are
then complete for this rank's experts once summed over "edp" (the ranks holding the same
experts), which the data-parallel step does for parameters tagged `expert_parallel`.

With tensor parallelism (tp > 1), two expert layouts:
- etp = 1 ("split"): every TP rank routes its own share of the tokens (its sequence-parallel
  shard, or a 1/tp slice of the replicated tokens) through an ep group of its TP coordinate;
  experts are replicated over TP. Router, expert and shared-expert parameters then see
  different tokens on each TP rank: they carry `sequence_parallel_partial = True`, so
  `core.parallel.tensor.sync_sequence_parallel_grads` sums them over TP. The only TP traffic
  is one all-reduce of the balancing statistics (2 x E floats), so the aux loss is that of
  the whole micro-batch. Capacity, if set, applies to each TP rank's share of the tokens.
- etp = tp ("sharded"): TP ranks gather the same tokens, route them identically, and each
  computes a 1/tp slice of every expert's (and the shared experts') hidden size; the partial
  outputs are all-reduced (or reduce-scattered under SP) once, after the combine. The router's
  gradient is then a partial sum too (tagged), and the aux loss gradient is divided by tp on
  each rank so the TP sum counts it once.

Every parameter gets checkpoint tags: expert weights `ep_shard_dim = 0` and
`ep_full_shape` (all E experts), and like core.parallel.tensor `tp_shard_dim` / `tp_full_shape`
(shape before the TP split, after the EP split).
Call after `build_model` and before the optimizer and data-parallel wrapping (it replaces
expert parameters); its order relative to `apply_tp` does not matter.
"""

from __future__ import annotations

import torch
from torch import nn

from core import placement
from core.mesh import ParallelMesh
from moe.comm import ExchangeTimer
from moe.dispatcher import build_dispatcher
from moe.layer import MoELayer, moe_layers


def _slice(full: nn.Parameter, dim: int, rank: int, size: int, what: str) -> nn.Parameter:
    if full.shape[dim] % size:
        raise ValueError(f"{what}: size {full.shape[dim]} along dim {dim} is not divisible by {size}")
    chunk = full.shape[dim] // size
    param = nn.Parameter(full.detach().narrow(dim, rank * chunk, chunk).clone(), requires_grad=full.requires_grad)
    return placement.copy_expert_tags(full, param)


def _shard_layer(layer: MoELayer, name: str, ep: int, ep_rank: int, tp: int, tp_rank: int, etp: int) -> None:
    experts = layer.experts
    if experts.num_experts % ep:
        raise ValueError(f"{name}: parallel.ep={ep} must divide num_experts={experts.num_experts}")
    for pname, tp_dim in (("w13", 3), ("w2", 1)):  # the hidden size: w13 [E, dim, 2, hidden], w2 [E, hidden, dim]
        full = getattr(experts, pname)
        placement.tag_expert(full, 0, full.shape)
        param = _slice(full, 0, ep_rank, ep, f"{name}.experts.{pname}") if ep > 1 else full
        before_tp = param.shape
        if etp > 1:
            param = _slice(param, tp_dim, tp_rank, etp, f"{name}.experts.{pname}")
        placement.tag_tp(param, tp_dim if etp > 1 else None, before_tp, partial_grad=tp > 1 and etp == 1)
        setattr(experts, pname, param)
    experts.num_experts //= ep
    if etp > 1:
        experts.hidden //= etp
    placement.tag_tp(layer.router.weight, None, layer.router.weight.shape, partial_grad=tp > 1)
    shared = layer.shared_experts
    if shared is not None:
        for pname, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            linear = getattr(shared, pname)
            full = linear.weight
            if etp > 1:
                linear.weight = _slice(full, dim, tp_rank, etp, f"{name}.shared_experts.{pname}.weight")
            placement.tag_tp(linear.weight, dim if etp > 1 else None, full.shape, partial_grad=tp > 1 and etp == 1)


def apply_ep(model: nn.Module, mesh: ParallelMesh, etp: int = 1, sequence_parallel: bool = True,
             dispatcher: str | None = None, exchange_timer: ExchangeTimer | None = None) -> nn.Module:
    """Give every MoE layer of `model` its experts' share and dispatcher (module docstring).

    etp: 1 or mesh.size("tp"). sequence_parallel: whether apply_tp runs with SP (the layer
    then receives its TP shard of the tokens). dispatcher: override of model.moe.dispatcher.
    exchange_timer: the run's timer of the dispatchers' token all-to-alls (None: untimed)."""
    ep, tp = mesh.size("ep"), mesh.size("tp")
    if (ep > 1 or tp > 1) and not mesh.distributed:
        raise ValueError(f"ep={ep}, tp={tp} need torch.distributed initialised and a ParallelMesh built on it")
    if etp not in (1, tp):
        raise ValueError(
            f"parallel.etp={etp} is not supported with tp={tp}: use etp=1 (experts replicated over TP, "
            f"each TP rank routes its own tokens) or etp=tp={tp} (expert hidden sizes split over TP)"
        )
    ep_group = mesh.group("ep") if ep > 1 else None
    ep_rank = mesh.coordinate("ep")
    tp_group = mesh.group("tp") if tp > 1 else None
    tp_rank = mesh.coordinate("tp")
    for name, layer in model.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        if getattr(layer, "_ep_applied", False):
            raise ValueError(f"{name}: apply_ep was applied twice")
        _shard_layer(layer, name, ep, ep_rank, tp, tp_rank, etp)
        layer.dispatcher = build_dispatcher(dispatcher or layer.moe.dispatcher, layer.moe.num_experts, ep_group,
                                            timer=exchange_timer, align=layer.dispatcher.align)
        if tp > 1:
            layer.tp_mode = "split" if etp == 1 else "sharded"
            layer.tp_group, layer.tp_size, layer.sequence_parallel = tp_group, tp, sequence_parallel
        layer._ep_applied = True
    return model


def expert_param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(expert-parallel parameters, all others): the first reduce over "edp", the rest over "dp_cp"."""
    expert, other = [], []
    for param in model.parameters():
        (expert if placement.is_expert(param) else other).append(param)
    return expert, other


@torch.no_grad()
def reduce_moe_grads(model: nn.Module, mesh: ParallelMesh) -> None:
    """Sum gradients over data-parallel ranks the EP way: expert parameters over "edp",
    the rest over "dp_cp". A plain reference for tests and for loops without the
    data-parallel step (core.parallel.data does this with buckets)."""
    import torch.distributed as dist

    expert, other = expert_param_groups(model)
    for params, name in ((expert, "edp"), (other, "dp_cp")):
        if mesh.size(name) == 1:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=mesh.group(name))
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


__all__ = ["apply_ep", "expert_param_groups", "reduce_moe_grads", "moe_layers"]
