"""Activation recomputation: none, selective (the attention core only) or full (each block)."""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


def _recompute_forward(module: nn.Module) -> None:
    """Run `module` under non-reentrant checkpointing: its activations are dropped after
    forward and recomputed in backward. Replacing the instance's forward keeps parameter
    names (and so checkpoints) unchanged."""
    original = module.forward

    def forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Selective saves the most memory per FLOP recomputed: attention's work is recomputed,
    the projections (most FLOPs) are not."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute mode must be none, selective or full, got {mode!r}")
    if mode == "none":
        return model
    for block in model.layers.values():
        _recompute_forward(block.attention.core_attention if mode == "selective" else block)
    return model
