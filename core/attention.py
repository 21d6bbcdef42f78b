"""One attention interface for packed batches: causal within each document, never across.

q [T, Hq, D], k/v [T, Hkv, D] (Hq a multiple of Hkv: grouped-query attention), with
`cu_seqlens` [segments + 1] marking document boundaries in the flattened tokens.

Backends, chosen per call:
- CUDA, all segments the same length (an unpacked batch): SDPA on [B, H, S, D], cuDNN first
  (it measured 1.9x the flash backend's forward on H100);
- CUDA, packed: `torch.nn.attention.varlen.varlen_attn` (FlashAttention varlen); when the
  host knows the document lengths (`doc_lengths`), documents of at least `CUDNN_MIN_DOC`
  tokens go through cuDNN SDPA instead (1.6-1.7x flash varlen's speed on H100, BENCHMARKS.md),
  batched by length rounded up to `CUDNN_BUCKET` (causal masking makes the padding exact:
  real queries never see the keys after them, and padded queries are dropped, so they get no
  gradient), and only the shorter ones through flash varlen. `TESSERA_VARLEN_KERNEL=flash`
  keeps every document on flash;
- CPU: an exact reference that runs SDPA per distinct segment length, batching the
  segments of equal length, so it stays exact and cheap enough for tests.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections import defaultdict
from dataclasses import dataclass

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


VARLEN_KERNEL_ENV = "TESSERA_VARLEN_KERNEL"
CUDNN_MIN_DOC = 8192  # shorter documents: flash varlen (per-call costs outweighed the gain at 2048-4096: BENCHMARKS.md)
CUDNN_BUCKET = 512  # long documents pad up to a multiple of this: a few shapes, few cuDNN graphs


@dataclass(frozen=True)
class _SplitPlan:
    """Index tensors of one packed batch's split (the same for every layer: cached)."""

    buckets: tuple  # (padded length, gather [n*padded]) per bucket of long documents
    short_rows: torch.Tensor | None  # token indices of the short documents
    short_cu: torch.Tensor | None
    short_max: int
    source: torch.Tensor  # [T]: each token's row in the concatenated results (buckets, then short)


@functools.lru_cache(maxsize=4)
def _split_plan(doc_lengths: tuple[int, ...], min_doc: int, bucket: int, device: torch.device) -> _SplitPlan:
    total = sum(doc_lengths)
    grouped: dict[int, list[tuple[int, int]]] = defaultdict(list)
    short: list[tuple[int, int]] = []
    start = 0
    for n in doc_lengths:
        if n >= min_doc:
            grouped[-(-n // bucket) * bucket].append((start, n))
        elif n:
            short.append((start, n))
        start += n
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    source = torch.empty(total, dtype=torch.long)
    buckets, row = [], 0
    for padded, docs in sorted(grouped.items()):
        # Padded runs read in-range rows past each document's end: finite values that causal
        # masking hides from the real queries; the padded queries' outputs are never read.
        starts = torch.tensor([s for s, _ in docs])
        buckets.append((padded, move((starts[:, None] + torch.arange(padded)[None, :]).clamp_max(total - 1).reshape(-1))))
        for s, n in docs:
            source[s:s + n] = torch.arange(row, row + n)
            row += padded
    rows = cu = None
    if short:
        rows = torch.cat([torch.arange(s, s + n) for s, n in short])
        source[rows] = torch.arange(row, row + rows.numel())
        rows = move(rows)
        cu = move(torch.tensor([0] + [n for _, n in short]).cumsum(0).to(torch.int32))
    return _SplitPlan(tuple(buckets), rows, cu, max((n for _, n in short), default=0), move(source))


def _split_by_length(q, k, v, doc_lengths: tuple[int, ...], scale: float | None,
                     min_doc: int = CUDNN_MIN_DOC, bucket: int = CUDNN_BUCKET) -> torch.Tensor:
    """Long documents through dense causal SDPA (bucketed), the rest through one varlen call;
    see the module docstring. Exact: the same attention as one varlen call over all. The
    results are put back in token order by one gather."""
    plan = _split_plan(tuple(doc_lengths), min_doc, bucket, q.device)
    if plan.source.numel() != q.shape[0]:
        raise ValueError(f"attention: doc_lengths cover {plan.source.numel()} tokens but q has {q.shape[0]}; "
                         "they must describe the same packed batch as cu_seqlens")
    parts = [_sdpa_dense(q.index_select(0, g), k.index_select(0, g), v.index_select(0, g), padded, scale)
             for padded, g in plan.buckets]
    if plan.short_rows is not None:
        rows = plan.short_rows
        sq, sk, sv = q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows)
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            parts.append(_flash_varlen(sq, sk, sv, plan.short_cu, plan.short_max, scale))
        else:  # CPU tests of the split itself
            parts.append(_reference_varlen(sq, sk, sv, plan.short_cu, scale))
    return torch.cat(parts).index_select(0, plan.source)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    doc_lengths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Document-causal attention over a packed batch; see the module docstring.
    `doc_lengths`: the segment lengths of cu_seqlens as host ints, when the caller has them."""
    total = q.shape[0]
    num_segments = cu_seqlens.numel() - 1
    uniform = num_segments > 0 and max_seqlen * num_segments == total
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if uniform:
            report_once("attention: dense causal SDPA (cuDNN preferred)")
            return _sdpa_dense(q, k, v, max_seqlen, scale)
        if (doc_lengths is not None and max_seqlen >= CUDNN_MIN_DOC
                and os.environ.get(VARLEN_KERNEL_ENV, "auto") != "flash"):
            report_once(f"attention: cuDNN SDPA for documents of >= {CUDNN_MIN_DOC} tokens, varlen_attn for the rest")
            return _split_by_length(q, k, v, doc_lengths, scale)
        report_once("attention: varlen_attn (packed documents)")
        return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    # CPU, or fp32 on CUDA (FlashAttention varlen takes 16-bit inputs only): exact paths.
    if uniform:
        return _sdpa_dense(q, k, v, max_seqlen, scale)
    return _reference_varlen(q, k, v, cu_seqlens, scale)
