"""Context-parallel benchmarks: ring attention scaling, dynamic vs static CP, cost calibration.

Run under torchrun (GPU: NCCL, bf16, FlashAttention varlen blocks):
    torchrun --nproc-per-node 4 -m bench.context_parallel --mode all
CPU smoke test (gloo, fp32, tiny sizes, exact dense blocks):
    torchrun --nproc-per-node 2 -m bench.context_parallel --smoke

Timing: bench.harness over the whole world (a barrier before each measurement, the slowest
rank's time), the candidates of one comparison in interleaved rounds. Modes (one record, a
JSON line, per measurement on rank 0):
- check: ring attention vs `core.attention.varlen_attention` on the whole packed batch
  (outputs and q/k/v grads, GQA, odd document lengths).
- attention: ring attention forward+backward, one document of S tokens, CP = 1, 2, 4 (every
  CP size dividing the world; groups of consecutive ranks run at once). Reported:
  `eff_part` = t(CP=1 on S/cp) / t(CP=cp on S) (per-rank efficiency; ideal 1/cp for
  attention alone, since CP=cp on S does cp times the pairs of CP=1 on S/cp per rank),
  `eff_work` = cp * t(CP=1 on S/cp) / t(CP=cp on S) (the same, normalised by work; ideal 1),
  `eff_strong` = t(CP=1 on S) / (cp * t(CP=cp on S)) (ideal 1).
- calibrate: fits the planner's CostModel on one GPU (least squares over micro-batches of
  short and long documents) and the ring terms from a measured neighbour exchange.
- dynamic: a long-tail mix of document lengths, planned by `plan_cp_step` (dynamic) and by
  `plan_static` (every micro-batch on the whole world), both run on the same documents
  with a small GPT forward+backward; tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

from bench import harness
from core.attention import varlen_attention
from core.config import ModelConfig
from core.layers import AttentionMeta
from core.train.loss import cross_entropy_sum
from core.mesh import ParallelMesh
from core.train.model import build_model
from core.parallel.context import CPSubgroups, apply_cp, dynamic_cp_inputs, shard_for_cp
from core.parallel.ring_attention import block_backward, block_forward, ring_attention
from dataservice.cp_plan import CostModel, H200_COST, plan_static, plan_cp_step
from dataservice.packing import IGNORE_INDEX


def emit(record: dict, device) -> None:
    harness.emit("context_parallel", {**record, "world": dist.get_world_size()}, device)


def timed(candidates: dict, device, warmup: int, rounds: int, iters: int = 1) -> dict[str, float]:
    """Seconds per call of each candidate: interleaved rounds over the whole world, each
    measurement the slowest rank's; the median over rounds."""
    times = harness.compare(candidates, rounds=rounds, iters=iters, warmup=warmup, device=device,
                            group=dist.group.WORLD)
    return {name: t.ms / 1e3 for name, t in times.items()}


def consecutive_groups(cp: int):
    """Groups of cp consecutive ranks (a collective: every rank makes every group)."""
    world, mine = dist.get_world_size(), None
    for start in range(0, world, cp):
        g = dist.new_group(list(range(start, start + cp)))
        if start <= dist.get_rank() < start + cp:
            mine = g
    return mine


def qkv(n, heads, kv_heads, dim, dtype, device, grad=True):
    return [torch.randn(n, h, dim, dtype=dtype, device=device).requires_grad_(grad) for h in (heads, kv_heads, kv_heads)]


def mode_check(args, device, dtype):
    """Ring vs one-GPU attention on the same packed batch: documents of different lengths
    (FlashAttention varlen blocks) and of equal lengths (cuDNN blocks on GPU)."""
    cases = {"varlen": [1023, 17, 4097, 1, 2500, 333], "equal": [4096] * 3} if not args.smoke else \
        {"varlen": [13, 5, 1, 22], "equal": [16] * 3}
    for case, lengths in cases.items():
        check_one(args, device, dtype, case, lengths)


def check_one(args, device, dtype, case, lengths):
    world, rank = dist.get_world_size(), dist.get_rank()
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=device)
    torch.manual_seed(0)
    q, k, v = qkv(sum(lengths), args.heads, args.kv_heads, args.head_dim, dtype, device)
    dout = torch.randn_like(q)
    ref = varlen_attention(q, k, v, cu, max(lengths))
    ref.backward(dout)
    ids = torch.arange(sum(lengths), device=device)
    s = shard_for_cp(ids, ids, ids, cu, rank, world)
    real, src = s.source >= 0, s.source.clamp(min=0)
    loc = [x.detach()[src].clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*loc, s.meta.extra["cp"], dist.group.WORLD)
    out.backward(torch.where(real[:, None, None], dout[src], 0))
    errs = {}
    for name, a, b in [("out", out, ref), ("dq", loc[0].grad, q.grad), ("dk", loc[1].grad, k.grad), ("dv", loc[2].grad, v.grad)]:
        a, b = a.detach()[real].float(), b.detach()[s.source[real]].float()
        errs[name] = float((a - b).abs().max() / b.abs().max())
    t = torch.tensor(list(errs.values()), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    emit({"mode": "check", "case": case, "equal_docs": s.meta.extra["cp"].equal_docs, "cp": world,
          "dtype": str(dtype), "max_rel_err": dict(zip(errs, t.tolist()))}, device)


def mode_attention(args, device, dtype):
    """Per sequence length, every CP size and its CP=1 references timed in the same rounds."""
    world = dist.get_world_size()
    sizes = [c for c in (1, 2, 4, 8) if c <= world and world % c == 0]
    groups = {c: consecutive_groups(c) if c > 1 else None for c in sizes}

    def attention_step(cp: int, seq: int, kernel: str = "model"):
        group = groups[cp]
        rank = dist.get_rank(group) if group is not None else 0
        ids = torch.arange(seq, device=device)
        doc = args.doc_len or seq
        cu = torch.tensor(list(range(0, seq, doc)) + [seq], dtype=torch.int32, device=device)
        s = shard_for_cp(ids, ids, ids, cu, rank, cp)
        q, k, v = qkv(s.tokens.numel(), args.heads, args.kv_heads, args.head_dim, dtype, device)
        dout = torch.randn_like(q)
        blocks = cp == 1 and kernel == "blocks"
        equal_docs = seq // doc if seq % doc == 0 else 0  # as the ring's layout would say

        def step():
            if cp > 1:
                out = ring_attention(q, k, v, s.meta.extra["cp"], group)
            elif blocks:  # the ring's own block kernel on one GPU: isolates the parallel cost
                out = _BlockAttention.apply(q, k, v, s.meta.cu_seqlens, s.meta.max_seqlen, equal_docs)
            else:  # the model's default path (cuDNN SDPA for one document, flash varlen if packed)
                out = varlen_attention(q, k, v, s.meta.cu_seqlens, s.meta.max_seqlen)
            out.backward(dout)

        return step

    for seq in args.seqs:
        cps = [cp for cp in sizes if cp > 1 and seq % (2 * cp) == 0]
        if not cps:
            continue
        steps = {}  # (cp, tokens, kernel) -> step; CP=1 references are shared between CP sizes
        keys = [(cp, seq, "model") for cp in cps]
        for cp in cps:
            keys += [(1, seq // cp, kernel) for kernel in ("model", "blocks")]
            keys += [] if args.no_strong else [(1, seq, kernel) for kernel in ("model", "blocks")]
        for key in keys:
            if key not in steps:
                steps[key] = attention_step(*key)
        times = timed({f"cp{c}_{n}_{k}": fn for (c, n, k), fn in steps.items()}, device, args.warmup, args.iters)
        t = lambda c, n, k: times[f"cp{c}_{n}_{k}"]  # noqa: E731
        for cp in cps:
            t_cp = t(cp, seq, "model")
            for kernel in ("model", "blocks"):
                t_part = t(1, seq // cp, kernel)
                t_full = t(1, seq, kernel) if not args.no_strong else float("nan")
                emit({"mode": "attention", "seq": seq, "doc_len": args.doc_len or seq, "cp": cp, "cp1_kernel": kernel,
                      "t_cp_s": t_cp, "t_cp1_part_s": t_part, "t_cp1_full_s": t_full, "eff_part": t_part / t_cp,
                      "eff_work": cp * t_part / t_cp, "eff_strong": t_full / (cp * t_cp), "heads": args.heads,
                      "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": str(dtype)}, device)


class _BlockAttention(torch.autograd.Function):
    """Causal varlen attention through the ring's block kernels, on one rank."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, docs):
        scale = q.shape[-1] ** -0.5
        out, lse = block_forward(q, k, v, cu, cu, max_len, max_len, True, scale, docs)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len, ctx.scale, ctx.docs = max_len, scale, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, True,
                                    ctx.scale, ctx.docs)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def model_config(args) -> ModelConfig:
    if args.smoke:
        return ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)
    return ModelConfig(vocab_size=32000, dim=args.heads * args.head_dim, num_layers=args.layers, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, ffn_dim=int(args.heads * args.head_dim * 8 / 3) // 64 * 64)


def make_step(model_cfg, lengths, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = int(sum(lengths))
    tokens = torch.randint(0, model_cfg.vocab_size, (total,), generator=g)
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
    starts = torch.repeat_interleave(cu[:-1].long(), torch.as_tensor(lengths))
    positions = torch.arange(total) - starts
    labels = torch.roll(tokens, -1)
    labels[cu[1:].long() - 1] = IGNORE_INDEX
    return [t.to(device) for t in (tokens, labels, positions, cu)]


def plan_runner(model, plan, step, subgroups, device, dtype):
    """One training step's forward and backward of the plan's micro-batches on this rank."""
    tokens, labels, positions, cu = step

    def once():
        for entry in plan.for_rank(subgroups.index):
            s = dynamic_cp_inputs(entry, tokens, labels, positions, cu, subgroups)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss, _ = cross_entropy_sum(model(s.tokens, s.position_ids, s.meta), s.labels)
            loss.backward()
        model.zero_grad(set_to_none=True)

    return once


def mode_calibrate(args, device, dtype):
    """Least-squares fit of t = per_microbatch + per_token*T + per_pair*sum(L^2) on one GPU."""
    cfg = model_config(args)
    model = build_model(cfg, seed=0).to(device)
    short = 512 if not args.smoke else 8
    rows, ts = [], []
    for total in args.calib_tokens:
        for doc in sorted({short, total // 4, total}):
            lengths = [doc] * (total // doc)
            step = make_step(cfg, lengths, device)
            meta = AttentionMeta(step[3], doc)

            def once():
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss, _ = cross_entropy_sum(model(step[0], step[2], meta), step[1])
                loss.backward()

            t = timed({"step": once}, device, args.warmup, args.iters)["step"]
            rows.append([1.0, total, float(sum(x * x for x in lengths))])
            ts.append(t)
            emit({"mode": "calibrate_point", "tokens": total, "doc_len": doc, "t_s": t}, device)
    coef, *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(ts), rcond=None)
    fit = np.asarray(rows) @ coef
    # Ring traffic per token per ring step, forward+backward: K/V (bf16) forward; K/V and
    # dK/dV (fp32) backward = 2*Hkv*D*(2+2+4) bytes, per layer.
    bytes_per_token = 2 * args.kv_heads * args.head_dim * 8 * cfg.num_layers
    bw, lat = p2p_bandwidth(device, args)
    cost = {"per_microbatch": max(0.0, float(coef[0])), "per_token": max(0.0, float(coef[1])),
            "per_pair": max(0.0, float(coef[2])), "ring_per_token": bytes_per_token / bw if bw else 0.0,
            "ring_step": 3 * lat * cfg.num_layers}  # 1 exchange forward, 2 backward, per layer
    emit({"mode": "calibrate_exchange", "cost": dict(cost)}, device)
    if dist.get_world_size() >= 2 and not args.smoke:
        cost.update(fit_ring_terms(args, device, dtype, cfg, model, CostModel(**cost)))
    emit({"mode": "calibrate", "cost": cost, "max_fit_err": float(np.max(np.abs(fit - ts) / ts)), "p2p_GBps": bw / 1e9,
          "p2p_latency_us": lat * 1e6, "model": {"dim": cfg.dim, "layers": cfg.num_layers, "heads": cfg.num_heads,
                                                   "kv_heads": cfg.num_kv_heads, "ffn": cfg.ffn_dim}}, device)
    return CostModel(**cost)


def fit_ring_terms(args, device, dtype, cfg, model, cost: CostModel) -> dict:
    """ring_step and ring_per_token from whole-model micro-batches run over 2 ranks: what
    they take beyond the model's no-ring time (a*T/2 + b*Q/2 + e), fitted on short documents
    (attention hides little there), checked on one long-document point."""
    group = consecutive_groups(2)
    model = apply_cp(model, None)
    points = [(32768, 512), (65536, 512), (65536, 8192)]
    over, tokens, checks = [], [], []
    for total, doc in points:
        tok, lab, pos, cu = make_step(cfg, [doc] * (total // doc), device)
        s = shard_for_cp(tok, lab, pos, cu, dist.get_rank(group), 2)
        s.meta.extra["cp_group"] = group

        def once():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss, _ = cross_entropy_sum(model(s.tokens, s.position_ids, s.meta), s.labels)
            loss.backward()

        t = timed({"step": once}, device, args.warmup, args.iters)["step"]
        plain = CostModel(cost.per_token, cost.per_pair, per_microbatch=cost.per_microbatch).time([doc] * (total // doc), 2)
        emit({"mode": "calibrate_ring_point", "tokens": total, "doc_len": doc, "t_s": t, "no_ring_model_s": plain},
             device)
        if doc == 512:
            over.append(t - plain)
            tokens.append(total / 2)
        else:
            checks.append((total, doc, t))
    c = max(0.0, (over[1] - over[0]) / (tokens[1] - tokens[0]))
    d = max(0.0, over[0] - c * tokens[0])
    fitted = CostModel(cost.per_token, cost.per_pair, c, d, cost.per_microbatch)
    for total, doc, t in checks:
        emit({"mode": "calibrate_ring_check", "tokens": total, "doc_len": doc, "t_s": t,
              "model_s": fitted.time([doc] * (total // doc), 2)}, device)
    return {"ring_per_token": c, "ring_step": d}


def p2p_bandwidth(device, args) -> tuple[float, float]:
    """Ring exchange bandwidth (bytes/s each way) and latency (s) over the whole world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return 0.0, 0.0
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    big = (64 << 20) if not args.smoke else 1 << 16
    exchanges = {}
    for n in (1024, big):
        send, recv = torch.ones(n // 4, device=device), torch.empty(n // 4, device=device)

        def once(send=send, recv=recv):
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                w.wait()

        exchanges[n] = once
    out = timed(exchanges, device, 3, 5, iters=20)
    lat = out[1024]
    return big / max(out[big] - lat, 1e-9), lat


def mode_dynamic(args, device, dtype, cost: CostModel):
    for seed in args.seeds:
        dynamic_one(args, device, dtype, cost, seed)


def dynamic_one(args, device, dtype, cost: CostModel, seed: int):
    world = dist.get_world_size()
    cfg = model_config(args)
    rng = np.random.default_rng(seed)
    budget = args.budget
    lengths = []
    while sum(lengths) < world * budget * args.steps_tokens:  # a long tail: lognormal, capped
        lengths.append(int(min(max(1, rng.lognormal(args.mix_mu, args.mix_sigma)), world * budget)))
    step = make_step(cfg, lengths, device, seed=seed)
    model = apply_cp(build_model(cfg, seed=0).to(device), None)
    subgroups = CPSubgroups.build(ParallelMesh.build(cp=world))
    plans = {"dynamic": plan_cp_step(lengths, world, budget, cost), f"static_cp{world}": plan_static(lengths, world, world, budget, cost)}
    total = float(sum(lengths))
    runners = {name: plan_runner(model, plan, step, subgroups, device, dtype) for name, plan in plans.items()}
    times = harness.compare(runners, rounds=args.dynamic_rounds, iters=1, warmup=1, device=device,
                            group=dist.group.WORLD)
    for name, plan in plans.items():
        t = times[name].ms / 1e3
        emit({"mode": "dynamic", "plan": name, "step_s": t, "step_s_range": (times[name].min_ms / 1e3,
              times[name].max_ms / 1e3), "tokens_per_s": total / t, "modelled_s": plan.makespan,
              "microbatches": len(plan.microbatches), "group_sizes": sorted({m.group_size for m in plan.microbatches}),
              "docs": len(lengths), "tokens": int(total), "max_doc": max(lengths), "budget": budget}, device)
    speedup = harness.ratio(times[f"static_cp{world}"], times["dynamic"])
    emit({"mode": "dynamic_vs_static", "seed": seed, "speedup": speedup["median"],
          "speedup_range": (speedup["min"], speedup["max"]),
          "modelled_speedup": plans[f"static_cp{world}"].makespan / plans["dynamic"].makespan}, device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", nargs="+", default=["all"], choices=["all", "check", "attention", "calibrate", "dynamic"])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU/gloo friendly")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="interleaved timing rounds per comparison")
    p.add_argument("--dynamic-rounds", type=int, default=3, help="dynamic mode: timing rounds of the two plans")
    p.add_argument("--no-strong", action="store_true", help="skip CP=1 on the whole sequence")
    p.add_argument("--doc-len", type=int, default=0, help="attention mode: documents of this length (0: one document)")
    p.add_argument("--calib-tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--budget", type=int, default=32768, help="tokens per rank per micro-batch (dynamic mode)")
    p.add_argument("--steps-tokens", type=float, default=2.0, help="step tokens = this * world * budget")
    p.add_argument("--mix-mu", type=float, default=7.5)
    p.add_argument("--mix-sigma", type=float, default=1.6)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="dynamic mode: one document mix per seed")
    args = p.parse_args()
    use_cuda = torch.cuda.is_available() and not args.smoke
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    if args.smoke:
        args.seqs, args.heads, args.kv_heads, args.head_dim = [64, 128], 4, 2, 8
        args.calib_tokens, args.budget, args.warmup, args.iters = [64, 128], 64, 1, 1
        args.mix_mu, args.mix_sigma, args.dynamic_rounds = 3.0, 1.0, 1
    try:
        if {"all", "check"} & set(args.mode):
            mode_check(args, device, dtype)
        if {"all", "attention"} & set(args.mode):
            mode_attention(args, device, dtype)
        cost = H200_COST
        if {"all", "calibrate"} & set(args.mode):
            cost = mode_calibrate(args, device, dtype)
        if {"all", "dynamic"} & set(args.mode):
            mode_dynamic(args, device, dtype, cost)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
