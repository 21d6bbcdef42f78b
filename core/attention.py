"""One attention interface for packed batches: causal within each document, never across.

q [T, Hq, D], k/v [T, Hkv, D] (Hq a multiple of Hkv: grouped-query attention), with
`cu_seqlens` [segments + 1] marking document boundaries in the flattened tokens.

Backends, chosen per call:
- CUDA, all segments the same length (an unpacked batch): SDPA on [B, H, S, D], cuDNN first
  (it measured 1.9x the flash backend's forward on H100, see shared/PERFORMANCE.md);
- CUDA, packed: `torch.nn.attention.varlen.varlen_attn` (FlashAttention varlen);
- CPU: an exact reference that runs SDPA per distinct segment length, batching the
  segments of equal length, so it stays exact and cheap enough for tests.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_reported: set[str] = set()


def report_once(message: str) -> None:
    """Log which backend runs, once per distinct message (a fallback must be visible, not noisy)."""
    if message not in _reported:
        _reported.add(message)
        log.info(message)


def _sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_len: int, scale: float | None) -> torch.Tensor:
    """Causal SDPA over equal-length segments laid end to end: [n*S, H, D] -> same."""
    n = q.shape[0] // seg_len
    q4, k4, v4 = (t.view(n, seg_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # The math backend last: it is the only one for fp32 with grouped-query attention.
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends, set_priority=True):
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[2])


def _reference_varlen(q, k, v, cu_seqlens: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Exact document-causal attention: group segments by length, one SDPA call per length."""
    bounds = cu_seqlens.tolist()
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    for length in lengths.unique().tolist():
        if length == 0:
            continue
        seg_starts = starts[lengths == length]
        index = (seg_starts[:, None] + torch.arange(length)[None, :]).reshape(-1).to(q.device)
        out[index] = _sdpa_dense(q[index], k[index], v[index], length, scale)
    return out


_VARLEN_PARAMS: set[str] | None = None


def _flash_varlen(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None) -> torch.Tensor:
    global _VARLEN_PARAMS
    from torch.nn.attention.varlen import varlen_attn

    if _VARLEN_PARAMS is None:
        _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
    kwargs: dict = {"scale": scale}
    # The causal switch changed name between torch releases: is_causal, then window_size.
    if "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Document-causal attention over a packed batch; see the module docstring."""
    total = q.shape[0]
    num_segments = cu_seqlens.numel() - 1
    uniform = num_segments > 0 and max_seqlen * num_segments == total
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if uniform:
            report_once("attention: dense causal SDPA (cuDNN preferred)")
            return _sdpa_dense(q, k, v, max_seqlen, scale)
        report_once("attention: varlen_attn (packed documents)")
        return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    # CPU, or fp32 on CUDA (FlashAttention varlen takes 16-bit inputs only): exact paths.
    if uniform:
        return _sdpa_dense(q, k, v, max_seqlen, scale)
    return _reference_varlen(q, k, v, cu_seqlens, scale)
