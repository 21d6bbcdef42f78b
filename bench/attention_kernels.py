"""Attention kernels for packed batches on one GPU: which kernel runs a document fastest.

    python -m bench.attention_kernels                 # GPU: both modes
    python -m bench.attention_kernels --smoke         # CPU: tiny sizes, checks the script runs

`kernels`: forward and backward time of one attention block, FlashAttention varlen (what
`varlen_attn` runs) against cuDNN SDPA on [docs, H, S, D] views (`aten._scaled_dot_product_cudnn_attention`,
native GQA), and with `--ragged` cuDNN's own varlen (`cum_seq`) path; each backward is fed the flash
forward's output and LSE, as the ring feeds merged ones, and checked against flash's gradients.
`packed`: `core.attention.varlen_attention` on rows packed from a long-tail document mix,
with the long documents split off to cuDNN (the default when the host knows the lengths)
against every document on flash varlen (`TESSERA_VARLEN_KERNEL=flash`), forward+backward, and
the largest difference between the two. The kernels of one case are timed together in --iters
interleaved rounds (bench.harness); one record (JSON line) per measurement.
`memory` (GPU): one document of each `--memory-seqs` length through `core.attention.varlen_attention`,
forward and backward, and what the kernels take beyond their inputs, output and gradients: the
peak allocated above that, in bytes and per query element (token x head x head dim), which the
planner's memory model counts as the attention backward's transient.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from bench.harness import compare, emit, ratio
from core import attention
from core.parallel import ring_attention as ra


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def mode_kernels(args, device) -> None:
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    ra._flash_available(torch.empty(1, device=device, dtype=torch.bfloat16))
    # (name, docs, q length, k length, causal): the ring's diagonal and off-diagonal blocks
    for name, docs, sq, sk, causal in [("1 doc causal", 1, args.seq, args.seq, True),
                                       ("8 docs causal", 8, args.seq // 8, args.seq // 8, True),
                                       ("q 2x k, full", 1, args.seq, args.seq // 2, False)]:
        cq = torch.arange(0, (docs + 1) * sq, sq, dtype=torch.int32, device=device)
        ck = torch.arange(0, (docs + 1) * sk, sk, dtype=torch.int32, device=device)
        q = torch.randn(docs * sq, h, d, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(docs * sk, hk, d, device=device, dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        out, lse = ra._flash_fwd(q, k, v, cq, ck, sq, sk, causal, scale)
        grads = ra._flash_bwd(dout, q, k, v, out, lse, cq, ck, sq, sk, causal, scale)
        c_out, c_lse = ra._cudnn_fwd(q, k, v, docs, causal, scale)
        c_grads = ra._cudnn_bwd(dout, q, k, v, out, lse, docs, causal, scale)
        rec = {"mode": "kernels", "block": name, "docs": docs, "sq": sq, "sk": sk, "heads": h, "kv_heads": hk,
               "cudnn_out_err": rel_err(c_out, out), "cudnn_lse_err": float((c_lse - lse).abs().max()),
               "cudnn_grad_err": max(rel_err(a, b) for a, b in zip(c_grads, grads))}
        kernels = {
            "flash_fwd": lambda: ra._flash_fwd(q, k, v, cq, ck, sq, sk, causal, scale),
            "flash_bwd": lambda: ra._flash_bwd(dout, q, k, v, out, lse, cq, ck, sq, sk, causal, scale),
            "cudnn_fwd": lambda: ra._cudnn_fwd(q, k, v, docs, causal, scale),
            "cudnn_bwd": lambda: ra._cudnn_bwd(dout, q, k, v, out, lse, docs, causal, scale),
        }
        if args.ragged:  # cuDNN's ragged path, for the record: it can fault, so it runs last and opt-in
            ragged = lambda: torch.ops.aten._cudnn_attention_forward(  # noqa: E731
                q, k, v, None, cq, ck, sq, sk, True, 0.0, causal, False, scale=scale)
            r = ragged()
            rec["ragged_out_err"] = rel_err(r[0], out)
            lse_in = lse.t().contiguous().unsqueeze(-1)
            g = torch.ops.aten._cudnn_attention_backward(dout, q, k, v, out, lse_in, r[6], r[7], None, cq, ck, sq, sk,
                                                         0.0, causal, scale=scale)
            rec["ragged_grad_err"] = max(rel_err(a, b) for a, b in zip(g, grads))
            kernels["ragged_fwd"] = ragged
        times = compare(kernels, rounds=args.iters, warmup=2, device=device)
        for kernel, t in times.items():
            rec[f"{kernel}_ms"] = t.ms
            rec[f"{kernel}_ms_range"] = (t.min_ms, t.max_ms)
        rec["cudnn_speedup_fwd"] = ratio(times["flash_fwd"], times["cudnn_fwd"])["median"]
        rec["cudnn_speedup_bwd"] = ratio(times["flash_bwd"], times["cudnn_bwd"])["median"]
        emit("attention_kernels", rec, device)


def long_tail(total: int, mu: float, sigma: float, cap: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while used < total:
        n = int(min(cap, max(1, math.exp(mu + sigma * float(torch.randn(1, generator=g))))))
        n = min(n, total - used)
        lengths.append(n)
        used += n
    return tuple(lengths)


def mode_packed(args, device, dtype) -> None:
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    for seq in args.packed_seqs:
        lengths = long_tail(seq, args.mix_mu, args.mix_sigma, seq, args.seed)
        cu = torch.tensor([0, *lengths]).cumsum(0).to(device, torch.int32)
        q = torch.randn(seq, h, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(seq, hk, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        outs, steps = {}, {}
        for kernel in ("flash", "split"):

            def step(kernel=kernel):
                # Each call sets the kernel choice itself: the two are timed in alternation.
                os.environ[attention.VARLEN_KERNEL_ENV] = "flash" if kernel == "flash" else "auto"
                for t in (q, k, v):
                    t.grad = None
                if device.type == "cuda":
                    out = attention.varlen_attention(q, k, v, cu, max(lengths), doc_lengths=lengths)
                elif kernel == "split":  # CPU smoke: the split's own code with small thresholds
                    out = attention._split_by_length(q, k, v, lengths, None, args.min_doc, args.bucket)
                else:
                    out = attention._reference_varlen(q, k, v, cu, None)
                out.backward(dout)
                return out

            outs[kernel] = [step().detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
            steps[kernel] = step
        times = compare(steps, rounds=args.iters, warmup=2, device=device)
        os.environ.pop(attention.VARLEN_KERNEL_ENV, None)
        long_tokens = sum(n for n in lengths if n >= attention.CUDNN_MIN_DOC)
        emit("attention_kernels", {
            "mode": "packed", "seq": seq, "docs": len(lengths), "longest": max(lengths),
            "tokens_in_long_docs": long_tokens, "min_doc": attention.CUDNN_MIN_DOC, "bucket": attention.CUDNN_BUCKET,
            "flash_ms": times["flash"].ms, "split_ms": times["split"].ms,
            "flash_ms_range": (times["flash"].min_ms, times["flash"].max_ms),
            "split_ms_range": (times["split"].min_ms, times["split"].max_ms),
            "speedup": ratio(times["flash"], times["split"])["median"],
            "max_rel_diff": max(rel_err(a, b) for a, b in zip(outs["split"], outs["flash"]))}, device)


def mode_memory(args, device) -> None:
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    for seq in args.memory_seqs:
        q = torch.randn(seq, h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(seq, hk, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        cu = torch.tensor([0, seq], device=device, dtype=torch.int32)
        records = {}
        for phase in ("forward", "backward"):
            torch.cuda.synchronize(device)
            if phase == "forward":
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                out = attention.varlen_attention(q, k, v, cu, seq, doc_lengths=(seq,))
                torch.cuda.synchronize(device)
                # beyond the inputs: the output and what the kernel saves (lse), then its scratch
                records["forward"] = torch.cuda.max_memory_allocated(device) - base
                records["forward_kept"] = torch.cuda.memory_allocated(device) - base
            else:
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                out.backward(dout)
                torch.cuda.synchronize(device)
                grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
                records["backward"] = torch.cuda.max_memory_allocated(device) - base
                records["backward_beyond_grads"] = records["backward"] - grads
        elements = seq * h * d
        emit("attention_kernels", {
            "mode": "memory", "seq": seq, "heads": h, "kv_heads": hk, "head_dim": d,
            **{f"{key}_bytes": value for key, value in records.items()},
            **{f"{key}_per_q_element": value / elements for key, value in records.items()}}, device)
        del q, k, v, dout, out
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", nargs="+", default=["kernels", "packed"], choices=["kernels", "packed", "memory"])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (packed mode only)")
    p.add_argument("--seq", type=int, default=32768, help="kernels mode: tokens of the query block")
    p.add_argument("--ragged", action="store_true", help="kernels mode: also cuDNN's ragged path (run it last: "
                   "it faulted on some shapes in torch 2.11)")
    p.add_argument("--packed-seqs", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--memory-seqs", type=int, nargs="+", default=[131072, 262144, 524288])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5, help="interleaved timing rounds per case")
    p.add_argument("--mix-mu", type=float, default=7.5, help="log-normal document lengths (as bench.context_parallel)")
    p.add_argument("--mix-sigma", type=float, default=1.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-doc", type=int, default=attention.CUDNN_MIN_DOC, help="documents this long go to cuDNN")
    p.add_argument("--bucket", type=int, default=attention.CUDNN_BUCKET)
    args = p.parse_args()
    if args.min_doc < 1 or args.bucket < 1:
        p.error("--min-doc and --bucket must be >= 1")
    if args.iters < 1:
        p.error("--iters must be >= 1")
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        p.error("needs a CUDA GPU (or --smoke for the CPU check)")
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.mode, args.packed_seqs, args.heads, args.kv_heads, args.head_dim = ["packed"], [512], 4, 2, 16
        args.mix_mu, args.mix_sigma, args.min_doc, args.bucket, args.iters = 3.5, 1.0, 32, 16, 1
    attention.CUDNN_MIN_DOC, attention.CUDNN_BUCKET = args.min_doc, args.bucket
    if "kernels" in args.mode:
        mode_kernels(args, device)
    if "packed" in args.mode:
        mode_packed(args, device, torch.bfloat16 if cuda else torch.float64)
    if "memory" in args.mode and cuda:
        mode_memory(args, device)


if __name__ == "__main__":
    main()
