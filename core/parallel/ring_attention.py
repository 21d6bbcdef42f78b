"""Ring attention over a context-parallel group, on packed (varlen) batches in zigzag layout.

Layout (made by `core.parallel.context.shard_for_cp`): every document of the packed batch is
padded to a multiple of 2*cp tokens and cut into 2*cp equal chunks; group rank r holds chunks
r and 2*cp-1-r of every document, laid out per document as [chunk r | chunk 2cp-1-r]. All
ranks therefore hold the same number of tokens per document (2*c_d), so one `CPLayout`
describes every rank's buffer, and the causal work per rank is equal.

Ring step s: rank r holds the keys/values of rank j = (r - s) mod cp. By chunk order:
- s = 0 (j = r): causal attention on the local buffer (its chunks are in increasing order);
- j < r: every local query sees only the first chunk (chunk j) of each document, unmasked;
- j > r: only the second chunk of each query document (2cp-1-r) sees keys, all of them, unmasked.
Partial results merge by log-sum-exp in fp32. The next block's K/V travel (isend/irecv to the
ring neighbours) while the current block computes. Backward runs the same ring, with each
block's dK/dV accumulator travelling with it; after cp hops it is home.

Block kernels, all fed the *final* output and LSE in the backward (what makes blockwise
gradients exact):
- CUDA, fp16/bf16, every document of the batch split into equal chunks (one long document, the
  long-context case): cuDNN SDPA on [docs, H, S, D] views, 1.6-1.7x FlashAttention varlen's
  speed on H100 in both directions (BENCHMARKS.md). cuDNN's own varlen (ragged) path is not
  used: in torch 2.11 / cuDNN 9.19 it was slower than flash and its backward returned garbage;
- CUDA, fp16/bf16, documents of different lengths: FlashAttention varlen (`varlen_attn` with
  the LSE for the forward, the op its autograd uses for the backward);
- otherwise an exact dense kernel in fp32 (fp64 for fp64 inputs): masks from segment ids,
  O(Tq*Tk) memory -- meant for CPU tests. On CUDA it runs only for blocks of at most
  DENSE_MAX_SCORES scores (heads x Tq x Tk); a larger block (fp32 inputs, or a torch without
  FlashAttention) is refused with one line rather than a [H, Tq, Tk] allocation.
`TESSERA_RING_KERNEL=flash` keeps the flash kernel for equal documents too (benchmarks).

Value heads may be narrower than the query/key heads (multi-head latent attention): K and V
travel as one flat buffer (their bytes back to back, each a contiguous view on arrival), the
dense and cuDNN blocks take the two sizes as they are, and FlashAttention's blocks pad v (and,
in the backward, the output and its gradient) with zero features to the q/k size and slice
the results back, which is exact (core.attention.padded_values).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.attention import report_backend


@dataclass(frozen=True)
class CPLayout:
    """One rank's share of a zigzag-split packed batch (identical sizes on every group rank)."""

    cp_rank: int
    cp_size: int
    cu_seqlens: torch.Tensor  # int32 [docs + 1] over local tokens, 2*c_d per document
    cu_half: torch.Tensor  # int32 [docs + 1], c_d per document (one chunk)
    max_seqlen: int  # max 2*c_d
    max_half: int  # max c_d
    first_idx: torch.Tensor  # long [T/2]: local positions of each document's first chunk
    second_idx: torch.Tensor  # long [T/2]: local positions of each document's second chunk
    equal_docs: int = 0  # the document count when all have the same chunk size (dense blocks), else 0

    def to(self, device: torch.device) -> "CPLayout":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return CPLayout(self.cp_rank, self.cp_size, move(self.cu_seqlens), move(self.cu_half), self.max_seqlen,
                        self.max_half, move(self.first_idx), move(self.second_idx), self.equal_docs)


# ---- block kernels ------------------------------------------------------------------------


def _dense_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, tq: int, tk: int) -> torch.Tensor:
    """[Tq, Tk] bool: same segment (and, if causal, key position <= query position in it)."""
    dev = cu_q.device
    cu_q, cu_k = cu_q.long(), cu_k.long()
    n = cu_q.numel() - 1
    seg_q = torch.repeat_interleave(torch.arange(n, device=dev), cu_q.diff(), output_size=tq)
    seg_k = torch.repeat_interleave(torch.arange(n, device=dev), cu_k.diff(), output_size=tk)
    mask = seg_q[:, None] == seg_k[None, :]
    if causal:
        pos_q = torch.arange(tq, device=dev) - cu_q[seg_q]
        pos_k = torch.arange(tk, device=dev) - cu_k[seg_k]
        mask &= pos_q[:, None] >= pos_k[None, :]
    return mask


DENSE_MAX_SCORES = 2**28  # 1 GiB of fp32 scores, a few such tensors live at once in the backward


def check_dense_block(device_type: str, heads: int, tq: int, tk: int) -> None:
    """Refuse the dense block kernel on CUDA past DENSE_MAX_SCORES (see the module docstring)."""
    if device_type == "cuda" and heads * tq * tk > DENSE_MAX_SCORES:
        raise ValueError(
            f"ring attention: a block of {tq} queries x {tk} keys x {heads} heads would take the exact dense kernel "
            f"({heads * tq * tk * 4 / 2**30:.0f} GiB of fp32 scores); long blocks need cuDNN or FlashAttention "
            "varlen: bf16/fp16 inputs (train.precision bf16) on a torch with FlashAttention")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _dense_scores(q, k, cu_q, cu_k, causal, scale):
    ct = _compute_dtype(q)
    group = q.shape[1] // k.shape[1]
    qf, kf = q.to(ct), k.to(ct).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    mask = _dense_mask(cu_q, cu_k, causal, q.shape[0], k.shape[0])
    return s.masked_fill(~mask, float("-inf")), qf, kf, group


def _dense_fwd(q, k, v, cu_q, cu_k, causal, scale):
    s, _, _, group = _dense_scores(q, k, cu_q, cu_k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [H, Tq]; -inf for a query with no key
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, v.to(s.dtype).repeat_interleave(group, dim=1))
    return out, lse


def _dense_bwd(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    s, qf, kf, group = _dense_scores(q, k, cu_q, cu_k, causal, scale)
    ct = s.dtype
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse.to(ct))[..., None])
    do, vf = dout.to(ct), v.to(ct).repeat_interleave(group, dim=1)
    delta = (do * out.to(ct)).sum(-1).t()  # [H, Tq]: rowsum(dO * O) with the final O
    ds = p * (torch.einsum("qhd,khd->hqk", do, vf) - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kf) * scale
    tk, hkv, d = k.shape
    dk = (torch.einsum("hqk,qhd->khd", ds, qf) * scale).view(tk, hkv, group, d).sum(2)
    dv = torch.einsum("hqk,qhd->khd", p, do).view(tk, hkv, group, v.shape[2]).sum(2)
    return dq, dk, dv


_VARLEN: dict | None = None


def _flash_available(q: torch.Tensor) -> bool:
    """FlashAttention varlen on CUDA for half types; probed once (signatures moved between releases)."""
    global _VARLEN
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if _VARLEN is None:
        _VARLEN = {}
        try:
            from torch.nn.attention import varlen as varlen_mod

            params = set(inspect.signature(varlen_mod.varlen_attn).parameters)
            if "return_aux" in params and hasattr(varlen_mod, "AuxRequest"):
                _VARLEN.update(fn=varlen_mod.varlen_attn, aux=varlen_mod.AuxRequest, params=params)
        except ImportError:
            pass
        _VARLEN["bwd"] = hasattr(torch.ops.aten, "_flash_attention_backward")
        _VARLEN["aten_fwd"] = hasattr(torch.ops.aten, "_flash_attention_forward")
    return _VARLEN["bwd"] and ("fn" in _VARLEN or _VARLEN["aten_fwd"])


def _pad_to(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def _flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    dv = v.shape[-1]  # FlashAttention takes one head size: narrower value heads are zero-padded
    out, lse = _flash_fwd_equal(q, k, _pad_to(v, q.shape[-1]), cu_q, cu_k, max_q, max_k, causal, scale)
    return out[..., :dv], lse


def _flash_fwd_equal(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    window = (-1, 0) if causal else (-1, -1)
    gqa = q.shape[1] != k.shape[1]
    # The public wrapper first; the op under it where the wrapper cannot say GQA (torch 2.11).
    if "fn" in _VARLEN and (not gqa or "enable_gqa" in _VARLEN["params"]):
        kwargs = {"return_aux": _VARLEN["aux"](lse=True), "scale": scale}
        if "window_size" in _VARLEN["params"]:
            kwargs["window_size"] = window
        else:
            kwargs["is_causal"] = causal
        if gqa:
            kwargs["enable_gqa"] = True
        out, lse = _VARLEN["fn"](q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    else:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
            window_size_left=window[0], window_size_right=window[1])
    if lse.shape[0] != q.shape[1]:  # the documented [T, H] layout; the kernel's own is [H, T]
        lse = lse.t()
    return out, lse.float().contiguous()


def _flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d:  # zero features in v, in the output and in its gradient: the real ones' gradients are unchanged
        dout, v, out = _pad_to(dout, d).contiguous(), _pad_to(v, d), _pad_to(out, d)
    dq, dk, dv_full = _flash_bwd_equal(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    return dq, dk, dv_full[..., :dv]


def _flash_bwd_equal(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
    unused = torch.empty(0, device=q.device)
    window = (-1, 0) if causal else (-1, -1)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
        scale=scale, window_size_left=window[0], window_size_right=window[1])
    return dq, dk, dv


RING_KERNEL_ENV = "TESSERA_RING_KERNEL"
_cudnn_broken = False  # set once cuDNN's SDPA failed here: a fact of this process's libraries, not of a run


def _cudnn_usable(q: torch.Tensor, docs: int) -> bool:
    return (docs > 0 and not _cudnn_broken and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and os.environ.get(RING_KERNEL_ENV, "auto") != "flash"
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"))


def _docs_view(t: torch.Tensor, docs: int) -> torch.Tensor:
    """[docs*S, H, D] -> [docs, H, S, D] (a view: the BSHD strides cuDNN reads natively)."""
    return t.view(docs, t.shape[0] // docs, t.shape[1], t.shape[2]).transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _rng_words(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # The backward op takes the dropout seed/offset; without dropout they are not read. One
    # pair per device, not an allocation per block.
    z = torch.zeros(1, dtype=torch.int64, device=device)
    return z, z


def _cudnn_fwd(q, k, v, docs, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _docs_view(q, docs), _docs_view(k, docs), _docs_view(v, docs), None, True, 0.0, causal, False, scale=scale)
    t, h = q.shape[:2]
    out = out.transpose(1, 2).reshape(t, h, v.shape[2])
    lse = lse.reshape(docs, h, t // docs).transpose(0, 1).reshape(h, t)  # -> [H, Tq]
    return out, lse.float()


def _cudnn_bwd(dout, q, k, v, out, lse, docs, causal, scale):
    t, h = q.shape[:2]
    lse4 = lse.reshape(h, docs, t // docs).transpose(0, 1).unsqueeze(-1).contiguous()
    seed, offset = _rng_words(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _docs_view(dout, docs), _docs_view(q, docs), _docs_view(k, docs), _docs_view(v, docs),
        _docs_view(out, docs), lse4, seed, offset, None, None, None, t // docs, k.shape[0] // docs, 0.0, causal,
        scale=scale)
    flat = lambda g, like: g.transpose(1, 2).reshape(like.shape)  # noqa: E731
    return flat(dq, q), flat(dk, k), flat(dv, v)


def _cudnn_failed(exc: Exception) -> None:
    global _cudnn_broken
    _cudnn_broken = True
    report_backend(f"ring attention: cuDNN SDPA blocks failed ({str(exc).splitlines()[0][:200]}); "
                "using FlashAttention varlen blocks from now on")


def block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, docs: int = 0):
    """Attention of one (query block, key block) pair: (out [Tq,H,D], lse [H,Tq] fp32/fp64).
    `docs` > 0: q and k each hold that many equal-length documents back to back."""
    if _cudnn_usable(q, docs):
        try:
            out = _cudnn_fwd(q, k, v, docs, causal, scale)
            report_backend("ring attention: cuDNN SDPA blocks (documents of equal length)")
            return out
        except RuntimeError as exc:
            _cudnn_failed(exc)
    if _flash_available(q):
        report_backend("ring attention: FlashAttention varlen blocks")
        return _flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    check_dense_block(q.device.type, q.shape[1], q.shape[0], k.shape[0])
    if q.is_cuda:
        report_backend("ring attention: exact dense blocks on CUDA (FlashAttention varlen unavailable or fp32)")
    return _dense_fwd(q, k, v, cu_q, cu_k, causal, scale)


def block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, docs: int = 0):
    """Gradients of one block given the merged (final) output and LSE of its queries."""
    if _cudnn_usable(q, docs):
        try:
            return _cudnn_bwd(dout, q, k, v, out.to(q.dtype), lse, docs, causal, scale)
        except RuntimeError as exc:
            _cudnn_failed(exc)
    if _flash_available(q):
        return _flash_bwd(dout, q, k, v, out.to(q.dtype), lse, cu_q, cu_k, max_q, max_k, causal, scale)
    check_dense_block(q.device.type, q.shape[1], q.shape[0], k.shape[0])
    return _dense_bwd(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


# ---- merging and ring traffic -------------------------------------------------------------


def _merge(out_acc, lse_acc, out, lse):
    """Combine two softmax-normalised partials of the same queries by their log-sum-exp."""
    new = torch.logaddexp(lse_acc, lse)
    w_old = torch.exp(lse_acc - new).t().unsqueeze(-1)
    w_new = torch.exp(lse - new).t().unsqueeze(-1)
    return out_acc * w_old + out.to(out_acc.dtype) * w_new, new


class _Ring:
    """Neighbour exchange on a group: send to rank+1, receive from rank-1 (global ranks)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int):
        ranks = dist.get_process_group_ranks(group)
        self.group, self.size = group, len(ranks)
        if dist.get_rank(group) != cp_rank:
            raise ValueError(
                f"the batch was sharded for cp_rank={cp_rank} but this process is rank "
                f"{dist.get_rank(group)} of its context-parallel group; shard with the group's rank"
            )
        self.next = ranks[(cp_rank + 1) % self.size]
        self.prev = ranks[(cp_rank - 1) % self.size]

    def start(self, send: torch.Tensor, tag: int):
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending) -> torch.Tensor:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


_KV_TAG, _DKV_TAG = 11, 12


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one flat message (they may differ in head size); for equal sizes the same
    bytes as torch.stack((k, v))."""
    return torch.cat((k.reshape(-1), v.reshape(-1)))


def _unpack(flat: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous views of a `_pack`ed message."""
    n = math.prod(k_shape)
    return flat[:n].view(k_shape), flat[n:].view(v_shape)


class RingAttentionFn(torch.autograd.Function):
    """out = document-causal attention of the whole (sharded) sequence, for this rank's queries."""

    @staticmethod
    def forward(ctx, q, k, v, layout: CPLayout, group, scale: float):
        L = layout
        ring = _Ring(group, L.cp_rank)
        r, cp = L.cp_rank, ring.size
        n = L.equal_docs
        kv = _pack(k, v)
        out_acc = lse_acc = None
        for s in range(cp):
            pending = ring.start(kv, _KV_TAG) if s + 1 < cp else None  # overlaps the block below
            j = (r - s) % cp
            kb, vb = _unpack(kv, k.shape, v.shape)
            if s == 0:
                o, lse = block_forward(q, k, v, L.cu_seqlens, L.cu_seqlens, L.max_seqlen, L.max_seqlen, True, scale, n)
                out_acc, lse_acc = o.to(lse.dtype), lse
            elif j < r:
                k1, v1 = kb.index_select(0, L.first_idx), vb.index_select(0, L.first_idx)
                o, lse = block_forward(q, k1, v1, L.cu_seqlens, L.cu_half, L.max_seqlen, L.max_half, False, scale, n)
                out_acc, lse_acc = _merge(out_acc, lse_acc, o, lse)
            else:
                idx = L.second_idx
                o, lse = block_forward(q.index_select(0, idx), kb, vb, L.cu_half, L.cu_seqlens, L.max_half,
                                     L.max_seqlen, False, scale, n)
                o2, l2 = _merge(out_acc.index_select(0, idx), lse_acc.index_select(1, idx), o, lse)
                out_acc.index_copy_(0, idx, o2)
                lse_acc.index_copy_(1, idx, l2)
            if pending is not None:
                kv = ring.finish(pending)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.layout, ctx.group, ctx.scale = L, group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        L, scale = ctx.layout, ctx.scale
        ring = _Ring(ctx.group, L.cp_rank)
        r, cp = L.cp_rank, ring.size
        n = L.equal_docs
        dout = dout.contiguous()
        acc = lse.dtype  # fp32 (fp64 for fp64 inputs): gradients summed over cp blocks
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = _pack(k, v)
        pending_dkv = None
        for s in range(cp):
            pending_kv = ring.start(kv, _KV_TAG) if s + 1 < cp else None
            j = (r - s) % cp
            kb, vb = _unpack(kv, k.shape, v.shape)
            if s == 0:
                dq_b, dk, dv = block_backward(dout, q, k, v, out, lse, L.cu_seqlens, L.cu_seqlens,
                                              L.max_seqlen, L.max_seqlen, True, scale, n)
                dq += dq_b
                part = _pack(dk.to(acc), dv.to(acc))
            elif j < r:
                idx = L.first_idx
                k1, v1 = kb.index_select(0, idx), vb.index_select(0, idx)
                dq_b, dk, dv = block_backward(dout, q, k1, v1, out, lse, L.cu_seqlens, L.cu_half,
                                              L.max_seqlen, L.max_half, False, scale, n)
                dq += dq_b
                part = torch.zeros(kv.shape, dtype=acc, device=q.device)
                pk, pv = _unpack(part, k.shape, v.shape)
                pk.index_add_(0, idx, dk.to(acc))
                pv.index_add_(0, idx, dv.to(acc))
            else:
                idx = L.second_idx
                dq_b, dk, dv = block_backward(dout.index_select(0, idx), q.index_select(0, idx), kb, vb,
                                              out.index_select(0, idx), lse.index_select(1, idx).contiguous(),
                                              L.cu_half, L.cu_seqlens, L.max_half, L.max_seqlen, False, scale, n)
                dq.index_add_(0, idx, dq_b.to(acc))
                part = _pack(dk.to(acc), dv.to(acc))
            # This block's dK/dV accumulator arrives from the previous rank (which added its
            # share one step earlier); add ours and pass it on. After cp hops it is home.
            dkv = part if pending_dkv is None else ring.finish(pending_dkv) + part
            pending_dkv = ring.start(dkv, _DKV_TAG)
            if pending_kv is not None:
                kv = ring.finish(pending_kv)
        dk, dv = _unpack(ring.finish(pending_dkv), k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout,
                   group: dist.ProcessGroup, scale: float | None = None) -> torch.Tensor:
    """Document-causal attention over a zigzag-sharded packed batch (see the module docstring).

    q/k [T, Hq|Hkv, D], v [T, Hkv, Dv] (Hq a multiple of Hkv; Dv may differ from D) are this rank's
    tokens in `layout`; every rank of `group` calls it at the same time with its own shard.
    Returns [T, Hq, Dv]."""
    if q.shape[0] != int(layout.cu_seqlens[-1]) or k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2] \
            or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match the "
            f"layout's {int(layout.cu_seqlens[-1])} local tokens; shard the batch with shard_for_cp"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} key/value heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttentionFn.apply(q.contiguous(), k.contiguous(), v.contiguous(), layout, group, scale)
