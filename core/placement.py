"""Where a parameter lives across the parallel groups, declared once.

The parallelize steps tag each parameter (attributes on the tensor, so they follow it through
`model.to` and into the optimizer's slots); data parallelism, the optimizer and checkpoints
read the tags through the functions here, never by attribute name.

- tensor parallelism: `tp_shard_dim` (the dimension sliced over tp, None when replicated) and
  `tp_full_shape` (the shape before the tp split);
- `sequence_parallel_partial`: each tp rank's gradient covers only its own tokens (norms and
  routers under sequence parallelism) or its own heads (qk-norm gains, column-parallel biases),
  so gradients are summed over tp;
- expert parallelism: `expert_parallel` (gradients reduced over "edp", not "dp_cp"),
  `ep_shard_dim` (the expert dimension) and `ep_full_shape` (all E experts).
"""

from __future__ import annotations

import torch

_EXPERT = "expert_parallel"
_EP_DIM = "ep_shard_dim"
_EP_SHAPE = "ep_full_shape"
_TP_DIM = "tp_shard_dim"
_TP_SHAPE = "tp_full_shape"
_SP_PARTIAL = "sequence_parallel_partial"


def tag_tp(param: torch.Tensor, shard_dim: int | None, full_shape, partial_grad: bool = False) -> torch.Tensor:
    """Mark `param` as the tp slice along `shard_dim` (None: replicated) of a `full_shape` tensor."""
    setattr(param, _TP_DIM, shard_dim)
    setattr(param, _TP_SHAPE, tuple(full_shape))
    if partial_grad:
        setattr(param, _SP_PARTIAL, True)
    return param


def tag_expert(param: torch.Tensor, shard_dim: int | None = None, full_shape=None) -> torch.Tensor:
    """Mark `param` as expert weights; with `full_shape`, also where the experts are split."""
    setattr(param, _EXPERT, True)
    if full_shape is not None:
        setattr(param, _EP_DIM, shard_dim)
        setattr(param, _EP_SHAPE, tuple(full_shape))
    return param


def copy_expert_tags(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    for tag in (_EXPERT, _EP_DIM, _EP_SHAPE):
        if hasattr(source, tag):
            setattr(target, tag, getattr(source, tag))
    return target


def has_tp_tags(param: torch.Tensor) -> bool:
    return hasattr(param, _TP_DIM)


def tp_shard_dim(param: torch.Tensor) -> int | None:
    return getattr(param, _TP_DIM, None)


def tp_full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, _TP_SHAPE, None) or param.shape)


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, _EXPERT, False)


def ep_shard_dim(param: torch.Tensor) -> int:
    return getattr(param, _EP_DIM, 0)


def ep_full_shape(param: torch.Tensor) -> tuple[int, ...] | None:
    return getattr(param, _EP_SHAPE, None)


def is_sequence_parallel_partial(param: torch.Tensor) -> bool:
    return getattr(param, _SP_PARTIAL, False)
