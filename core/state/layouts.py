"""Tensor layouts the model has since changed, and how the older one maps onto today's.

The routed experts' gate and up projections were two tensors, `experts.w1` and `experts.w3`
[E, dim, hidden]; the model holds them as one, `experts.w13` [E, dim, 2, hidden], whose dim
FUSED_DIM indexes them. Whatever reads saved tensors by name (DCP checkpoints, conversions,
`checkpoint.init_from` folders) asks `older_parts` for the keys a missing tensor was saved under,
and stacks those along FUSED_DIM; `GroupedExperts` does the same for its own state dict.
"""

from __future__ import annotations

import re

# A tensor the model holds whole, and the names older layouts hold its slices under.
FUSED_TENSORS = {"experts.w13": ("experts.w1", "experts.w3")}
FUSED_DIM = 2


def _component(name: str) -> re.Pattern:
    """`name` as whole dotted components of a key (experts.w1 matches in a.experts.w1.master, not in a.experts.w13)."""
    return re.compile(r"(?<![^.])" + re.escape(name) + r"(?![^.])")


def older_parts(key: str, saved) -> list[str] | None:
    """The keys a checkpoint from before a fusion holds `key`'s slices under, when `saved` (any
    container of keys) lacks `key` and holds all of those."""
    if key in saved:
        return None
    for fused, parts in FUSED_TENSORS.items():
        pattern = _component(fused)
        if pattern.search(key):
            keys = [pattern.sub(part, key) for part in parts]
            if all(k in saved for k in keys):
                return keys
    return None


def fused_name(key: str) -> str | None:
    """The fused tensor's key when `key` names its first slice in the older layout, else None."""
    for fused, parts in FUSED_TENSORS.items():
        pattern = _component(parts[0])
        if pattern.search(key):
            return pattern.sub(fused, key)
    return None


def older_slices(names) -> dict[str, list[str]]:
    """{fused tensor: its slices' names} for every fused tensor that `names` holds apart."""
    out = {}
    for name in names:
        whole = fused_name(name)
        keys = older_parts(whole, names) if whole else None
        if keys:
            out[whole] = keys
    return out


def fused_shape(slice_shape, count: int) -> tuple[int, ...]:
    return tuple(slice_shape[:FUSED_DIM]) + (count,) + tuple(slice_shape[FUSED_DIM:])


def without_fused_dim(items) -> tuple:
    """A shape (or a region's slices) of the fused tensor without its dim FUSED_DIM: one slice's."""
    return tuple(x for d, x in enumerate(items) if d != FUSED_DIM)
