"""Synthetic micro-batches for the trainer's `step` in this process: random tokens packed as
several documents per row, every position a label."""

from __future__ import annotations

import torch

from core.layers import AttentionMeta
from core.train.data import StepInputs


def micro_batch(seed: int, vocab: int, seq: int = 128, rows: int = 2, device: str = "cpu") -> StepInputs:
    """`rows` rows of `seq` tokens, each row three documents (a quarter, a half, a quarter), the
    labels the next tokens; the same `seed` gives the same batch."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows * seq,), generator=g)
    lengths = [seq // 4, seq // 2, seq // 4] * rows  # several documents per row
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    meta = AttentionMeta(cu_seqlens=cu.to(device), max_seqlen=max(lengths), doc_lengths=tuple(lengths))
    return StepInputs(tokens.to(device), torch.roll(tokens, -1).to(device), positions.to(device), meta,
                      num_tokens=float(tokens.numel()), num_labels=float(tokens.numel()))
