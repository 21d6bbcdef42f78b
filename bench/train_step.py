"""Training-step throughput of Tessera's trainer against a plain single-GPU PyTorch loop.

Both run the same ~1B Llama-style model (vocab 32000, d 2048, 20 layers, 16 heads, GQA 4,
SwiGLU 5632) at seq 4096, micro-batch 2, bf16, on synthetic tokens, in the same process:
- baseline: the plain model, bf16 autocast, fused torch AdamW, SDPA (cuDNN) — what a user
  writes without a framework (optionally `torch.compile`d, --compile-baseline);
- tessera: the same model through `core.parallel.parallelize` on one rank (bf16 params, fp32
  master weights and grads in the optimizer, the configured recompute and compile).
MFU counts 6*(params - input embedding) + 6*layers*d*seq FLOPs per token against 989 TFLOP/s
(the usual 6N + attention accounting). --moe runs the DeepSeek-like fine-grained MoE
instead (4 layers by default, 64 experts, top-8), MFU on active parameters (top_k of E).

    python bench/train_step.py [--steps 10] [--layers 20] [--compile] [--accum 4] [--moe]

--accum N runs N micro-batches per optimizer step on both sides (one step per micro-batch
is the default; real global batches are many micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.config import Config, ModelConfig  # noqa: E402
from core.loss import cross_entropy_sum  # noqa: E402
from core.metrics import PEAK_FLOPS, flops_per_token  # noqa: E402
from core.layers import AttentionMeta  # noqa: E402
from core.model import build_model  # noqa: E402
from core.model import count_params  # noqa: E402


def model_config(layers: int, moe: bool) -> ModelConfig:
    if not moe:
        return ModelConfig(vocab_size=32000, dim=2048, num_layers=layers, num_heads=16, num_kv_heads=4, ffn_dim=5632,
                           rope_theta=500000.0)
    # launch/configs/deepseek_like.toml's model, fewer layers to fit one GPU with all 64 experts
    # (at ep=8 each GPU holds 8 experts but runs the same FLOPs per token).
    from core.config import load_config

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "configs",
                          "deepseek_like.toml")
    return load_config(config, [f"model.num_layers={layers}"]).model


def moe_step_hooks(model, cu_seqlens):
    """What the training loop does around a MoE step (no-ops for a dense model): per-sequence
    balancing boundaries before the forward, the expert-bias update after the optimizer."""
    from moe.layer import moe_layers, moe_metrics, set_moe_sequences, update_expert_bias

    if not moe_layers(model):
        return lambda: None, lambda: None

    def after():
        update_expert_bias(model)
        moe_metrics(model)

    num_tokens = int(cu_seqlens[-1])  # once, on the host, as the trainer knows it
    return lambda: set_moe_sequences(model, cu_seqlens, num_tokens), after


def synthetic_batch(batch: int, seq: int, vocab: int, device):
    tokens = torch.randint(0, vocab, (batch * seq,), device=device)
    labels = torch.roll(tokens, -1)
    positions = torch.arange(seq, device=device).repeat(batch)
    cu = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device)
    return tokens, labels, positions, AttentionMeta(cu_seqlens=cu, max_seqlen=seq)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step_fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step_fn()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        step_fn()
    _sync()
    return (time.perf_counter() - start) / steps


def print_profile(step_fn, rows: int = 25, trace: str | None = None) -> None:
    """Where one (warm) step's GPU time goes, by kernel: what to attack next; then when the GPU
    idled and what the host was doing meanwhile (bench/gpu_idle.py on the step's trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step_fn()
        _sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))
    import tempfile

    from bench.gpu_idle import summarise

    with tempfile.TemporaryDirectory() as tmp:
        path = trace or f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            print(summarise(json.load(f), min_gap_us=20, top=25))


def baseline_step_fn(cfg, batch, compile_model: bool, accum: int):
    device = batch[0].device
    model = build_model(cfg, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    run = torch.compile(model) if compile_model else model
    before, after = moe_step_hooks(model, batch[3].cu_seqlens)

    def step():
        for _ in range(accum):
            before()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = run(batch[0], batch[2], batch[3])
            loss = torch.nn.functional.cross_entropy(logits.float(), batch[1]) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after()

    return step, model


def tessera_step_fn(cfg, batch, args):
    from core.mesh import ParallelMesh
    from core.parallelize import parallelize

    config = Config(model=cfg)
    config.train.recompute = args.recompute
    config.train.compile = args.compile
    config.train.precision = args.precision
    config.parallel.dp = 1
    config.parallel.gradient_accumulation_fusion = not args.no_wgrad_fusion
    config.train.fp8_weight_cache = not args.no_fp8_weight_cache
    config.train.global_batch_size = config.train.micro_batch_size * args.accum  # what parallelize reads
    device = batch[0].device
    mesh = ParallelMesh.build(device_type=device.type)
    model, optimizer, scheduler, grads = parallelize(build_model(cfg, seed=0), mesh, config, device, args.precision)
    count = batch[0].numel()
    before, after = moe_step_hooks(model, batch[3].cu_seqlens)

    def step():
        for micro in range(args.accum):
            before()
            with grads.sync_context(last=micro == args.accum - 1):
                logits = model(batch[0], batch[2], batch[3])
                loss_sum, _ = cross_entropy_sum(logits, batch[1], compiled=args.compile)
                (loss_sum / (count * args.accum)).backward()
        grads.finish_and_clip(1.0)
        optimizer.step()
        scheduler.step()
        grads.zero_grad()
        after()

    return step, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="default 20 dense, 4 with --moe")
    parser.add_argument("--moe", action="store_true",
                        help="the DeepSeek-like fine-grained MoE (64 experts of 1408, top-8, 2 shared); MFU on active parameters")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compile Tessera's blocks")
    parser.add_argument("--compile-baseline", action="store_true")
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-batches per optimizer step (both sides): real global batches amortise the step")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one Tessera step")
    parser.add_argument("--trace", default=None, help="with --profile: also write that step's Chrome trace (JSON) here")
    parser.add_argument("--only", choices=["baseline", "tessera"], default=None)
    parser.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                        help="Tessera's precision (fp8: the blocks' linears and the experts; MFU still against bf16 peak)")
    parser.add_argument("--no-wgrad-fusion", action="store_true",
                        help="Tessera without gradient-accumulation fusion (expert wgrad in bf16, then an fp32 pass)")
    parser.add_argument("--no-fp8-weight-cache", action="store_true",
                        help="with --precision fp8: quantise the weights in every micro-batch (train.fp8_weight_cache off)")
    parser.add_argument("--dim", type=int, default=2048, help="smaller for a CPU smoke test")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    args.layers = args.layers or (4 if args.moe else 20)
    cfg = model_config(args.layers, args.moe)
    if args.dim != 2048:
        cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size = args.dim, args.dim * 2, 4, 2, 512
        cfg.moe.ffn_dim = args.dim // 2 if args.moe else 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = synthetic_batch(args.batch, args.seq, cfg.vocab_size, device)
    tokens = args.batch * args.seq * args.accum
    results = {}
    for name in ("baseline", "tessera"):
        if args.only and name != args.only:
            continue
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if name == "baseline":
            step, model = baseline_step_fn(cfg, batch, args.compile_baseline, args.accum)
        else:
            step, model = tessera_step_fn(cfg, batch, args)
        total, embed, active = count_params(model)
        seconds = time_steps(step, args.steps, args.warmup)
        if args.profile and name == "tessera" and device == "cuda":
            print_profile(step, trace=args.trace)
        fpt = flops_per_token(active, embed, cfg.num_layers, cfg.dim, args.seq)
        results[name] = {
            "step_ms": 1e3 * seconds,
            "tokens_per_s": tokens / seconds,
            "mfu": fpt * tokens / seconds / PEAK_FLOPS["bf16"],
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
            "params": total,
            "active_params": active,
        }
        if name == "tessera" and args.precision == "fp8":
            from core.fp8_cache import WEIGHT_CACHE

            results[name]["fp8_weight_cache"] = dict(WEIGHT_CACHE.stats, enabled=WEIGHT_CACHE.enabled)
        del model, step
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, r in results.items():
        print(f"{name:9s} step {r['step_ms']:7.1f} ms  {r['tokens_per_s'] / 1e3:7.1f}k tok/s  "
              f"MFU {100 * r['mfu']:5.1f}%  peak {r['peak_mem_gib']:5.1f} GiB  params {r['params'] / 1e9:.3f}B "
              f"({r['active_params'] / 1e9:.3f}B active)")
        if "fp8_weight_cache" in r:
            print(f"{'':9s} fp8 weight cache: {r['fp8_weight_cache']}")
    if len(results) == 2:
        print(f"tessera / baseline tokens/s: {results['tessera']['tokens_per_s'] / results['baseline']['tokens_per_s']:.3f}")
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__, "args": vars(args),
                      "results": results}))


if __name__ == "__main__":
    main()
