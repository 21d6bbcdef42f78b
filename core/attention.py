"""One attention interface for packed batches: causal within each document, never across.

q [T, Hq, D], k/v [T, Hkv, D] (Hq a multiple of Hkv: grouped-query attention), with
`cu_seqlens` [segments + 1] marking document boundaries in the flattened tokens.

Backends, chosen per call:
- CUDA, all segments the same length (an unpacked batch): SDPA on [B, H, S, D], cuDNN first
  (it measured 1.9x the flash backend's forward on H100);
- CUDA, packed: `torch.nn.attention.varlen.varlen_attn` (FlashAttention varlen); when the
  host knows the document lengths (`doc_lengths`), documents of at least `CUDNN_MIN_DOC`
  tokens go through cuDNN SDPA instead (1.6-1.7x flash varlen's speed on H100, BENCHMARKS.md),
  each padded to a multiple of `CUDNN_BUCKET` (a few shapes, few cuDNN graphs; causal masking
  makes the padding exact: real queries never see the keys after them, and padded queries are
  dropped, so they get no gradient), and each run of shorter documents between them through
  one flash varlen call, all on views of the packed rows. `TESSERA_VARLEN_KERNEL=flash`
  keeps every document on flash;
- CPU: an exact reference that runs SDPA per distinct segment length, batching the
  segments of equal length, so it stays exact and cheap enough for tests.

No CUDA path builds a [T, T] mask or score matrix: SDPA's fallbacks past cuDNN and flash are
allowed by segment length only (`cuda_dense_backends`: the math backend, O(S^2) in memory, up
to MATH_MAX_LEN tokens; the memory-efficient one up to EFFICIENT_MAX_LEN), and the split's
boundaries are host ints and int32 token counts (documents < 2^31 tokens).

Value heads may be narrower than query/key heads (multi-head latent attention: 192 and 128 at
DeepSeek-V3's shapes). SDPA's cuDNN backend takes the two sizes as they are; FlashAttention
(`varlen_attn`) wants one head size, so on that path v is padded with zero features up to the
q/k size and the output sliced back (`padded_values`): exact, since the zero features only add
zero columns to the output and get no gradient into the real ones.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from core.kernels.library import report_once

log = logging.getLogger(__name__)
# Which attention kernel runs is said once per distinct choice, at info level.
report_backend = functools.partial(report_once, level=logging.INFO, logger=log)


# Segment lengths up to which SDPA may fall back to its other CUDA backends (cuDNN and flash are
# O(S) in memory at any length and always allowed): the math backend materialises [H, S, S]
# scores (256 MiB a head in fp32 at 8192 tokens, a terabyte at a million); the memory-efficient
# kernel has been reported upstream to return wrong values past 2^16 tokens.
MATH_MAX_LEN = 8192
EFFICIENT_MAX_LEN = 65536
_HALF = (torch.float16, torch.bfloat16)


def cuda_dense_backends(seg_len: int, dtype: torch.dtype) -> list[SDPBackend]:
    """The SDPA backends a causal segment of `seg_len` tokens may use on CUDA, preferred first
    (cuDNN: 1.9x the flash backend's forward on H100). Raises for a segment no allowed backend
    takes (fp32 past EFFICIENT_MAX_LEN): one line, not a terabyte allocation."""
    if dtype not in _HALF and seg_len > EFFICIENT_MAX_LEN:
        raise ValueError(f"attention: a document of {seg_len} tokens in {dtype} on CUDA has no kernel that is exact "
                         f"and O(tokens) in memory past {EFFICIENT_MAX_LEN} tokens (cuDNN and FlashAttention take "
                         "bf16/fp16 only); train in bf16 (train.precision)")
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    if seg_len <= EFFICIENT_MAX_LEN:
        backends.append(SDPBackend.EFFICIENT_ATTENTION)
    if seg_len <= MATH_MAX_LEN:
        backends.append(SDPBackend.MATH)  # the only one for fp32 with grouped-query attention
    return backends


def _sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_len: int, scale: float | None) -> torch.Tensor:
    """Causal SDPA over equal-length segments laid end to end: [n*S, H, D] -> same."""
    n = q.shape[0] // seg_len
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda and gqa and q.dtype not in _HALF and seg_len > MATH_MAX_LEN:
        # fp32 GQA past the math backend's length: whole key/value heads for the efficient kernel (O(S) copies)
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    q4, k4, v4 = (t.view(n, seg_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    if q.is_cuda:
        with sdpa_kernel(cuda_dense_backends(seg_len, q.dtype), set_priority=True):
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


def padded_values(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`attend(q, k, v, ...)` for a kernel that needs v's head size to equal q's: v padded with
    zero features to q's size, the output's extra features dropped (a view). Exact in both
    directions: softmax(q k^T) [v | 0] = [out | 0], and the zero features' output gradient is
    cut off by the slice. Unchanged call when the sizes agree."""
    dv, dq = v.shape[-1], q.shape[-1]
    if dv == dq:
        return attend(q, k, v, *args, **kwargs)
    if dv > dq:
        raise ValueError(f"attention: value heads of {dv} features are wider than the query/key heads ({dq}); "
                         "only narrower value heads are padded")
    return attend(q, k, F.pad(v, (0, dq - dv)), *args, **kwargs)[..., :dv]


_VARLEN_PARAMS: set[str] | None = None  # the installed torch's varlen_attn signature, read once per process


def _flash_varlen(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None) -> torch.Tensor:
    return padded_values(_flash_varlen_equal, q, k, v, cu_seqlens, max_seqlen, scale)


def _flash_varlen_equal(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None) -> torch.Tensor:
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
    # Releases without the enable_gqa switch hand fewer key/value heads straight to FlashAttention,
    # which shares each among its group of query heads: no repeated copies of k and v, nor the
    # sums of their gradients (~10 ms a step at 32k-token rows on an H100).
    if q.shape[1] != k.shape[1] and "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = True
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


VARLEN_KERNEL_ENV = "TESSERA_VARLEN_KERNEL"
CUDNN_MIN_DOC = 4096  # shorter documents: flash varlen (docs/performance-notes.md: the threshold's measurements)
CUDNN_BUCKET = 512  # long documents pad up to a multiple of this: a few shapes, few cuDNN graphs


@dataclass(frozen=True)
class _Piece:
    """A row range of a packed batch: one long document (dense SDPA, padded) or a run of short
    documents between long ones (one varlen call, `cu` their boundaries within the run)."""

    start: int
    length: int
    padded: int
    cu: torch.Tensor | None = None  # None: a long document
    max_len: int = 0


@functools.lru_cache(maxsize=4)
def _split_plan(doc_lengths: tuple[int, ...], min_doc: int, bucket: int, device: torch.device) -> tuple[_Piece, ...]:
    pieces: list[_Piece] = []
    run: list[int] = []  # the short documents since the last long one
    start = 0

    def close_run(end: int) -> None:
        if run:
            cu = torch.tensor([0, *run]).cumsum(0).to(torch.int32).to(device, non_blocking=True)
            pieces.append(_Piece(end - sum(run), sum(run), sum(run), cu, max(run)))
            run.clear()

    for n in doc_lengths:
        if n >= min_doc:
            close_run(start)
            pieces.append(_Piece(start, n, -(-n // bucket) * bucket))
        elif n:
            run.append(n)
        start += n
    close_run(start)
    return tuple(pieces)


class _Windows(torch.autograd.Function):
    """Each piece's rows of x: a view, or past the batch's end a zero-padded copy. A long
    document's padded rows are the next document's or zeros: causal masking hides them from
    the real queries, and the padded queries' outputs are dropped, so they get no gradient.
    The backward joins the pieces' real rows into one gradient (they tile the batch in order):
    no scatter-add, no full-size gradient per piece for autograd to sum, and one copy kernel
    where per-piece slice assignments were a device-to-device memcpy each (the 32k-token step
    0.987x with it on an H100)."""

    @staticmethod
    def forward(ctx, x, pieces):
        ctx.pieces = pieces
        windows = []
        for p in pieces:
            if p.start + p.padded <= x.shape[0]:
                windows.append(x[p.start:p.start + p.padded])
            else:
                window = x.new_zeros(p.padded, *x.shape[1:])
                window[:p.length] = x[p.start:p.start + p.length]
                windows.append(window)
        return tuple(windows)

    @staticmethod
    def backward(ctx, *grads):
        # An unused window's gradient arrives as zeros (autograd materialises them by default).
        return torch.cat([g[:p.length] for p, g in zip(ctx.pieces, grads)]), None


def _split_by_length(q, k, v, doc_lengths: tuple[int, ...], scale: float | None,
                     min_doc: int = CUDNN_MIN_DOC, bucket: int = CUDNN_BUCKET) -> torch.Tensor:
    """Each long document through dense causal SDPA (padded to a multiple of `bucket`), each
    run of short documents between them through one varlen call, on views of q, k, v; the
    results joined in token order. Exact: the same attention as one varlen call over all."""
    if sum(doc_lengths) != q.shape[0]:
        raise ValueError(f"attention: doc_lengths cover {sum(doc_lengths)} tokens but q has {q.shape[0]}; "
                         "they must describe the same packed batch as cu_seqlens")
    pieces = _split_plan(tuple(doc_lengths), min_doc, bucket, q.device)
    flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    outs = []
    for p, qw, kw, vw in zip(pieces, *(_Windows.apply(t, pieces) for t in (q, k, v))):
        if p.cu is None:
            outs.append(_sdpa_dense(qw, kw, vw, p.padded, scale)[:p.length])
        elif flash:
            outs.append(_flash_varlen(qw, kw, vw, p.cu, p.max_len, scale))
        else:  # CPU tests of the split itself
            outs.append(_reference_varlen(qw, kw, vw, p.cu, scale))
    return torch.cat(outs)


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
            report_backend("attention: dense causal SDPA (cuDNN preferred)")
            return _sdpa_dense(q, k, v, max_seqlen, scale)
        if (doc_lengths is not None and max_seqlen >= CUDNN_MIN_DOC
                and os.environ.get(VARLEN_KERNEL_ENV, "auto") != "flash"):
            report_backend(f"attention: cuDNN SDPA for documents of >= {CUDNN_MIN_DOC} tokens, varlen_attn for the rest")
            return _split_by_length(q, k, v, doc_lengths, scale)
        report_backend("attention: varlen_attn (packed documents)")
        return _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    # CPU, or fp32 on CUDA (FlashAttention varlen takes 16-bit inputs only): exact paths.
    if uniform:
        return _sdpa_dense(q, k, v, max_seqlen, scale)
    return _reference_varlen(q, k, v, cu_seqlens, scale)
