"""Transformer Engine's fused block modules against the te backend's per-linear calls, on the
sublayers of one dense block, forward + backward, each recipe in turn.

At the ~1B model's shapes (d 2048, ffn 5632, 16 query heads and 4 kv heads of 128; --tokens rows):

    mlp        RMSNorm, te.Linear w1 and w3, SwiGLU, te.Linear w2: what model.dense_backend="te"
               runs with model.te_norm_fusion=false (core.precision.te_backend.TeLinear; the norm and
               SwiGLU compiled with --compile) against te.LayerNormMLP (RMSNorm, swiglu), what
               it runs by default, holding the same weights
    qkv        RMSNorm and te.Linear wq, wk, wv against te.LayerNormLinear over [wq; wk; wv]
    attention  Tessera's core attention (varlen cuDNN / flash) against te.DotProductAttention,
               bf16, and with --fp8-attention also TE's FP8 attention (the recipe's fp8_dpa)

Weight gradients go into fp32 main grads (fuse_wgrad_accumulation) on both sides, as in the
trainer; each call quantises its weights (no weight cache on either side). Before timing, each
pair's outputs are compared (the fused modules hold the same weights; FP8 differs by its own error). Prints ms per
forward + backward and fused/unfused ratios; one JSON record.

    python -m bench.te_fusions [--recipes bf16,tensorwise,delayed,blockwise] [--tokens 16384] [--compile]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib

import torch
from torch import nn

from bench.harness import compare, emit
from core.precision import te_backend
from core.attention import varlen_attention
from core.layers import FeedForward, RMSNorm

DIM, FFN, HEADS, KV_HEADS, HEAD_DIM, EPS = 2048, 5632, 16, 4, 128, 1e-5


def _with_main_grads(*params: nn.Parameter) -> None:
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
        # TE hands autograd a placeholder gradient; drop it so the next call does not add into it
        p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _step(forward, x: torch.Tensor, dy: tuple[torch.Tensor, ...]):
    def run():
        x.grad = None
        torch.autograd.backward(_as_tuple(forward(x)), dy)
    return run


def _autocast(te, recipe):
    return te.autocast(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()


def mlp_pair(te, recipe, compiled: bool, device):
    """(unfused, fused) forward callables of the FFN sublayer, on the same weights."""
    norm = RMSNorm(DIM, EPS).to(device, torch.bfloat16)
    ffn = FeedForward(DIM, FFN).to(device, torch.bfloat16)
    for name in ("w1", "w3", "w2"):
        setattr(ffn, name, te_backend.TeLinear(getattr(ffn, name), recipe, fuse_wgrad=True))
    norm_fn = torch.compile(norm) if compiled else norm
    act = torch.compile(ffn.act) if compiled else ffn.act
    _with_main_grads(ffn.w1.weight, ffn.w3.weight, ffn.w2.weight)

    def unfused(x):
        h = norm_fn(x)
        with _autocast(te, recipe):
            a, b = ffn.w1(h), ffn.w3(h)
        y = act(a, b)
        with _autocast(te, recipe):
            return ffn.w2(y)

    fused = te.LayerNormMLP(DIM, FFN, eps=EPS, bias=False, normalization="RMSNorm", activation="swiglu",
                            params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True, device=device)
    with torch.no_grad():
        fused.layer_norm_weight.copy_(norm.weight)
        fused.fc1_weight.copy_(torch.cat([ffn.w1.weight, ffn.w3.weight]))
        fused.fc2_weight.copy_(ffn.w2.weight)
    _with_main_grads(fused.fc1_weight, fused.fc2_weight)

    def fused_fn(x):
        with _autocast(te, recipe):
            return fused(x)
    return unfused, fused_fn


def qkv_pair(te, recipe, compiled: bool, device):
    norm = RMSNorm(DIM, EPS).to(device, torch.bfloat16)
    shapes = {"wq": HEADS * HEAD_DIM, "wk": KV_HEADS * HEAD_DIM, "wv": KV_HEADS * HEAD_DIM}
    linears = {n: te_backend.TeLinear(nn.Linear(DIM, out, bias=False).to(device, torch.bfloat16), recipe, True)
               for n, out in shapes.items()}
    norm_fn = torch.compile(norm) if compiled else norm
    _with_main_grads(*(m.weight for m in linears.values()))

    def unfused(x):
        h = norm_fn(x)
        with _autocast(te, recipe):
            return tuple(m(h) for m in linears.values())

    fused = te.LayerNormLinear(DIM, sum(shapes.values()), eps=EPS, bias=False, normalization="RMSNorm",
                               params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True, device=device)
    with torch.no_grad():
        fused.layer_norm_weight.copy_(norm.weight)
        fused.weight.copy_(torch.cat([m.weight for m in linears.values()]))
    _with_main_grads(fused.weight)

    def fused_fn(x):
        with _autocast(te, recipe):
            return tuple(fused(x).split(list(shapes.values()), dim=-1))
    return unfused, fused_fn


def attention_candidates(te, recipes, tokens: int, seq: int, device) -> dict:
    """name -> forward of q [T, H, D] giving [T, H*D], over the same k and v."""
    docs = tokens // seq
    cu = torch.arange(0, tokens + 1, seq, device=device, dtype=torch.int32)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))

    def tessera(q):
        return varlen_attention(q, k, v, cu, seq).flatten(-2)

    out = {"attention tessera": tessera}
    dpa = te.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=KV_HEADS, attention_dropout=0.0, qkv_format="bshd",
                                 attn_mask_type="causal")

    def te_attention(recipe):
        def run(q):
            shape = (docs, seq, -1, HEAD_DIM)
            with _autocast(te, recipe):
                o = dpa(q.view(shape), k.view(shape), v.view(shape))
            return o.reshape(tokens, HEADS * HEAD_DIM)
        return run

    out["attention te bf16"] = te_attention(None)
    for name, recipe in recipes.items():
        if recipe is not None:
            out[f"attention te fp8 {name}"] = te_attention(recipe)
    return out


def _fp8_attention_recipe(name: str):
    recipes = importlib.import_module("transformer_engine.common.recipe")
    if name == "delayed":
        return recipes.DelayedScaling(reduce_amax=False, fp8_dpa=True)
    if name == "tensorwise":
        return recipes.Float8CurrentScaling(fp8_dpa=True)
    return None  # TE has no blockwise FP8 attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="bf16,tensorwise,delayed,blockwise")
    parser.add_argument("--parts", default="mlp,qkv,attention")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=4096, help="attention: document length")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fp8-attention", action="store_true")
    parser.add_argument("--host-ahead", action="store_true", help="the GPU's own time (bench.harness)")
    args = parser.parse_args()
    names = args.recipes.split(",")
    bad = [n for n in names if n != "bf16" and n not in te_backend.TE_FP8_RECIPES]
    if bad:
        parser.error(f"--recipes: unknown {', '.join(bad)}; choose from bf16, {', '.join(te_backend.TE_FP8_RECIPES)}")
    if args.tokens % args.seq or args.tokens % 16:
        parser.error("--tokens must be a multiple of --seq and of 16")
    reason = te_backend.unavailable_reason()
    if reason:
        parser.error(f"needs Transformer Engine: {reason}")
    te = importlib.import_module("transformer_engine.pytorch")
    device = torch.device("cuda")
    torch.manual_seed(0)
    parts = args.parts.split(",")
    results: dict[str, dict] = {}
    time_it = functools.partial(compare, rounds=args.rounds, warmup=3, host_ahead=args.host_ahead)
    for name in names:
        recipe = te_backend.build_recipe(None if name == "bf16" else name)
        for part, make in (("mlp", mlp_pair), ("qkv", qkv_pair)):
            if part not in parts:
                continue
            unfused, fused = make(te, recipe, args.compile, device)
            x = torch.randn(args.tokens, DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
            with torch.no_grad():
                a, b = torch.cat(_as_tuple(unfused(x)), -1).float(), torch.cat(_as_tuple(fused(x)), -1).float()
                diff = ((a - b).norm() / a.norm()).item()
                dy = tuple(torch.randn_like(t) for t in _as_tuple(unfused(x)))
            timing = time_it({"unfused": _step(unfused, x, dy), "fused": _step(fused, x, dy)})
            key = f"{part} {name}"
            results[key] = {"unfused": timing["unfused"].summary(), "fused": timing["fused"].summary(),
                            "fused_speedup": timing["unfused"].ms / timing["fused"].ms, "output_rel_diff": diff}
            print(f"{key:22s} unfused {timing['unfused'].ms:7.3f} ms  fused {timing['fused'].ms:7.3f} ms  "
                  f"x{results[key]['fused_speedup']:.3f}  (outputs differ by {diff:.2e})", flush=True)
            del unfused, fused
    if "attention" in parts:
        fp8 = {n: _fp8_attention_recipe(n) for n in names if n != "bf16"} if args.fp8_attention else {}
        candidates = attention_candidates(te, fp8, args.tokens, args.seq, device)
        q = torch.randn(args.tokens, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
        with torch.no_grad():
            ref = candidates["attention tessera"](q).float()
        dy = (torch.randn(args.tokens, HEADS * HEAD_DIM, device=device, dtype=torch.bfloat16),)
        timing = time_it({n: _step(f, q, dy) for n, f in candidates.items()})
        base = timing["attention tessera"].ms
        for n, f in candidates.items():
            with torch.no_grad():
                diff = ((f(q).float() - ref).norm() / ref.norm()).item()
            results[n] = {**timing[n].summary(), "speedup_over_tessera": base / timing[n].ms, "output_rel_diff": diff}
            print(f"{n:28s} {timing[n].ms:7.3f} ms  x{base / timing[n].ms:.3f} of tessera  (outputs differ by {diff:.2e})",
                  flush=True)
    emit("te_fusions", {"args": vars(args), "results": results}, device)


if __name__ == "__main__":
    main()
