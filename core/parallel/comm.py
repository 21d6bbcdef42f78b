"""Autograd-aware collectives along the token dimension (dim 0) over one process group.

Each forward collective is paired with the collective its gradient needs (Megatron's
"mappings"), so a parallel layer is written as ordinary autograd code:

| function                 | forward                         | backward                          |
|--------------------------|---------------------------------|-----------------------------------|
| `all_gather_tokens`      | all-gather along dim 0          | reduce-scatter (or take own chunk)|
| `reduce_scatter_tokens`  | reduce-scatter along dim 0      | all-gather                        |
| `split_tokens`           | take own chunk of dim 0         | all-gather                        |
| `copy_to_group`          | identity                        | all-reduce                        |
| `reduce_from_group`      | all-reduce                      | identity                          |

With `group=None` or a group of one rank every function is the identity. Chunks are equal
and in rank order of the group: rank r holds rows [r*n, (r+1)*n) of the gathered tensor.

The plain (non-autograd) helpers `all_gather_dim0`, `reduce_scatter_dim0` and `all_reduce`
are public too, for code that writes its own autograd Function (vocab-parallel loss, MoE
dispatch, ring attention).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Backends found to lack a native single-tensor reduce-scatter (probed on first use).
_no_reduce_scatter: set[str] = set()


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(x: torch.Tensor, size: int, what: str) -> int:
    if x.shape[0] % size:
        raise ValueError(
            f"{what}: dim 0 has {x.shape[0]} tokens, not divisible by the group size {size}; "
            f"pad the micro-batch to a multiple of {size} tokens"
        )
    return x.shape[0] // size


def all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's x along dim 0, in group rank order (no autograd)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum x over the group and keep this rank's chunk of dim 0 (no autograd).

    Uses the backend's reduce-scatter; only a backend that reports it unsupported falls
    back to all-reduce plus slicing (tp times the traffic), and that is logged once."""
    size = group_size(group)
    if size == 1:
        return x
    chunk = _check_divisible(x, size, "reduce-scatter")
    x = x.contiguous()
    backend = dist.get_backend(group)
    if backend not in _no_reduce_scatter:
        out = torch.empty((chunk, *x.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            _reduce_scatter_single(out, x, group=group)
            return out
        except (RuntimeError, NotImplementedError) as err:
            text = str(err).lower()
            if "support" not in text and "implement" not in text:
                raise
            _no_reduce_scatter.add(backend)
            log.warning("backend %s has no reduce-scatter (%s); using all-reduce + slice", backend, err)
    summed = x.clone()
    dist.all_reduce(summed, group=group)
    rank = group_rank(group)
    return summed[rank * chunk:(rank + 1) * chunk].clone()


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce into a new tensor (x is left untouched: autograd may have saved it)."""
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


def _own_chunk(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    chunk = _check_divisible(x, group_size(group), "split")
    rank = group_rank(group)
    return x[rank * chunk:(rank + 1) * chunk].contiguous()


class _AllGatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return _own_chunk(grad, ctx.group), None, None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _SplitTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_chunk(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a view, so autograd sees a new output of this node

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_gather_tokens(x: torch.Tensor, group: dist.ProcessGroup | None, reduce_grad: bool = True) -> torch.Tensor:
    """Forward: gather every rank's token shard ([n, ...] -> [size*n, ...]).

    Backward: reduce-scatter when each rank's gradient of the gathered tensor is a partial
    sum (the consumer is sharded along features, as in tensor parallelism: the default);
    with `reduce_grad=False` just take this rank's chunk (the gradient is already complete
    and identical on every rank)."""
    if group_size(group) == 1:
        return x
    return _AllGatherTokens.apply(x, group, reduce_grad)


def reduce_scatter_tokens(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Forward: sum partial [size*n, ...] tensors and keep this rank's [n, ...] chunk.
    Backward: all-gather the chunk gradients."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterTokens.apply(x, group)


def split_tokens(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's chunk of a tensor replicated over the group.
    Backward: all-gather the chunk gradients."""
    if group_size(group) == 1:
        return x
    return _SplitTokens.apply(x, group)


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Forward: identity (x is replicated). Backward: sum the partial gradients of the
    feature-sharded consumers on each rank."""
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Forward: sum the partial results of every rank. Backward: identity (the gradient of
    the replicated sum is already complete on each rank)."""
    if group_size(group) == 1:
        return x
    return _ReduceFromGroup.apply(x, group)
