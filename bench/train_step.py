"""Training-step throughput of Tessera's trainer against a plain single-GPU PyTorch loop.

Both run the same ~1B Llama-style model (vocab 32000, d 2048, 20 layers, 16 heads, GQA 4,
SwiGLU 5632) at seq 4096, micro-batch 2, bf16, on synthetic tokens, in the same process:
- baseline: the plain model, bf16 autocast, fused torch AdamW, SDPA (cuDNN) — what a user
  writes without a framework (optionally `torch.compile`d, --compile-baseline);
- tessera: the trainer itself (`core.train.trainer.Trainer` on one rank: `step` then `record`, as its
  own loop runs them, without the data service): bf16 params, fp32 master weights and grads in
  the optimizer, the configured recompute and compile.
Both sides are built and warmed up, then timed in --steps interleaved rounds (bench.harness:
one optimizer step of each per round, CUDA events; the median and spread over rounds), so
drift hits both alike and the ratio is the median of same-round ratios. --sequential builds,
times and frees one side after the other instead, for models whose two states do not fit on
the GPU together (the DeepSeek-like --moe model on an 80 GB GPU). Peak memory is each side's
own: the most allocated during its warm-up above what was allocated before it was built.
MFU counts 6*(params - input embedding) + 6*layers*d*seq FLOPs per token against 989 TFLOP/s
(one formula for every side and precision, also for --precision fp8). --moe runs the
DeepSeek-like fine-grained MoE instead (4 layers by default, 64 experts, top-8), MFU on active
parameters (top_k of E).

    python -m bench.train_step [--steps 10] [--layers 20] [--compile] [--accum 4] [--moe]
    python -m bench.train_step --dim 128 --layers 2 --seq 64 --steps 2 --warmup 1   # CPU smoke

--accum N runs N micro-batches per optimizer step on both sides (one step per micro-batch
is the default; real global batches are many micro-batches).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_idle import summarise
from bench.harness import Timing, compare, emit, ratio
from core.config import FP8_RECIPES, Config, ModelConfig, load_config
from core.train.data import StepInputs, mtp_inputs
from dataservice.packing import IGNORE_INDEX
from core.layers import AttentionMeta
from core.metrics import PEAK_FLOPS, flops_per_token
from core.rules import attention_width
from core.train.model import build_model, count_params
from core.train.trainer import Trainer
from moe.layer import moe_layers, update_expert_bias
from moe.stats import moe_metrics

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("baseline", "tessera")


def model_config(layers: int, moe: bool, dim: int = 2048) -> ModelConfig:
    """The bench model; `dim` other than 2048 shrinks it (4 heads, vocab 512) for a CPU smoke test."""
    if not moe:
        cfg = ModelConfig(vocab_size=32000, dim=2048, num_layers=layers, num_heads=16, num_kv_heads=4, ffn_dim=5632,
                          rope_theta=500000.0)
    else:
        # launch/configs/deepseek_like.toml's model, fewer layers to fit one GPU with all 64 experts
        # (at ep=8 each GPU holds 8 experts but runs the same FLOPs per token).
        cfg = load_config(ROOT / "launch" / "configs" / "deepseek_like.toml", [f"model.num_layers={layers}"]).model
    if dim != 2048:
        cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size = dim, dim * 2, 4, 2, 512
        cfg.moe.ffn_dim = dim // 2 if moe else 0
    return cfg


def synthetic_batch(batch: int, seq: int, vocab: int, device, mtp_layers: int = 0) -> StepInputs:
    """`batch` rows of `seq` random tokens, one document each: the same micro-batch every time
    (with `mtp_layers`, each depth's inputs and targets, as the trainer's data path makes them)."""
    tokens = torch.randint(0, vocab, (batch * seq,), device=device)
    labels = torch.roll(tokens, -1)
    positions = torch.arange(seq, device=device).repeat(batch)
    cu = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device)
    meta = AttentionMeta(cu_seqlens=cu, max_seqlen=seq, total_tokens=batch * seq)
    mtp = {}
    if mtp_layers:
        mtp_tokens, mtp_labels = mtp_inputs(tokens, labels, cu, mtp_layers)
        mtp = dict(mtp_tokens=mtp_tokens, mtp_labels=mtp_labels,
                   mtp_num_labels=tuple(float(n) for n in (mtp_labels != IGNORE_INDEX).sum(dim=1).tolist()))
    return StepInputs(tokens, labels, positions, meta, num_tokens=float(batch * seq), num_labels=float(batch * seq), **mtp)


def moe_after_step(model):
    """What a plain training loop does after a MoE step's optimizer (a no-op for a dense model):
    the expert-bias update, and reading the statistics. (Sequence boundaries need nothing: the
    layers read them from the meta the forward is given.)"""
    if not moe_layers(model):
        return lambda: None

    def after():
        update_expert_bias(model)
        moe_metrics(model)

    return after


@dataclass
class Side:
    """One side of the comparison, built and warmed up."""

    step: Callable[[], object]  # one optimizer step
    model: torch.nn.Module
    flops_per_token: float
    peak_mem_gib: float
    weight_cache: object = None  # tessera's FP8 weight cache, when its precision plan keeps one


def baseline_side(cfg: ModelConfig, batch: StepInputs, compile_model: bool, accum: int, seq: int):
    """The plain PyTorch loop: the baseline, deliberately without anything of Tessera's."""
    device = batch.tokens.device
    model = build_model(cfg, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    run = torch.compile(model) if compile_model else model
    after = moe_after_step(model)

    def step():
        for _ in range(accum):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = run(batch.tokens, batch.position_ids, batch.meta)
            loss = torch.nn.functional.cross_entropy(logits.float(), batch.labels) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after()

    _, embedding, active = count_params(model)
    return step, model, flops_per_token(active, embedding, cfg.num_layers, attention_width(cfg), seq)


def tessera_config(cfg: ModelConfig, args, device: torch.device) -> Config:
    config = Config(model=cfg)
    t = config.train
    t.device, t.seed, t.seq_len = device.type, 0, args.seq  # seq_len: the trainer's MFU accounting
    t.recompute, t.compile, t.precision = args.recompute, args.compile, args.precision
    t.cuda_graphs = args.compile and getattr(args, "cuda_graphs", False)
    t.fp8_weight_cache = not args.no_fp8_weight_cache
    t.fp8_recipe = getattr(args, "fp8_recipe", "blockwise")
    config.model.dense_backend = getattr(args, "dense_backend", "torch")
    config.model.te_norm_fusion = getattr(args, "te_norm_fusion", True)
    t.micro_batch_size = args.batch
    t.global_batch_size = args.batch * args.accum  # one rank: accum micro-batches per step
    config.parallel.gradient_accumulation_fusion = not args.no_wgrad_fusion
    t.fused_loss = getattr(args, "fused_loss", False)
    config.parallel.split_master_weights = getattr(args, "split_masters", False)
    return config


def tessera_side(cfg: ModelConfig, batch: StepInputs, args):
    """The trainer's own step and metrics record, as `Trainer.run` calls them, fed `accum`
    copies of the batch instead of the data service's micro-batches."""
    trainer = Trainer(tessera_config(cfg, args, batch.tokens.device))
    micro = [batch] * args.accum
    waiting = []  # with --back-to-back: the last step, recorded once the next one is queued

    def step():
        start = time.perf_counter()
        result = trainer.step(micro)
        if args.back_to_back == 1:
            return trainer.record(result, start)
        record = trainer.record(*waiting) if waiting else None
        waiting[:] = [result, start]
        return record

    return step, trainer.model, trainer.flops_per_token, trainer.grads.weight_cache


def build_side(name: str, cfg: ModelConfig, batch: StepInputs, args) -> Side:
    """Build one side and run its warm-up steps (compilation, optimizer state), measuring its
    peak memory above what was allocated before it (the other side's state, when interleaved)."""
    cuda = batch.tokens.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    cache = None
    if name == "baseline":
        step, model, fpt = baseline_side(cfg, batch, args.compile_baseline, args.accum, args.seq)
    else:
        step, model, fpt, cache = tessera_side(cfg, batch, args)
    for _ in range(args.warmup):
        step()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else 0.0
    return Side(step, model, fpt, peak, cache)


def print_profile(step_fn, rows: int = 25, trace: str | None = None) -> None:
    """Where one (warm) step's GPU time goes, by kernel: what to attack next; then when the GPU
    idled and what the host was doing meanwhile (bench.gpu_idle on the step's trace)."""
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step_fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            print(summarise(json.load(f), min_gap_us=20, top=25))


def side_figures(side: Side, t: Timing, tokens: int, name: str, args) -> dict:
    total, _, active = count_params(side.model)
    seconds = t.ms / 1e3
    figures = {
        "step_ms": t.ms, "step_ms_range": (t.min_ms, t.max_ms), "step_ms_iqr": t.iqr_ms, "rounds": len(t.rounds_ms),
        "tokens_per_s": tokens / seconds,
        "mfu": side.flops_per_token * tokens / seconds / PEAK_FLOPS["bf16"],
        "peak_mem_gib": side.peak_mem_gib,
        "params": total,
        "active_params": active,
    }
    if name == "tessera" and args.precision == "fp8":
        cache = side.weight_cache
        figures["fp8_weight_cache"] = dict(cache.stats, enabled=cache.enabled) if cache is not None else \
            {"hits": 0, "misses": 0, "enabled": False}
    return figures


def run_sides(cfg: ModelConfig, batch: StepInputs, args, names: list[str]) -> tuple[dict[str, dict], dict | None]:
    """Per side its figures, and the same-round ratio baseline / tessera step time (tessera's
    speed-up in tokens/s) when both ran interleaved, else the ratio of the medians."""
    cuda = batch.tokens.device.type == "cuda"
    tokens = args.batch * args.seq * args.accum
    results, times = {}, {}
    if args.sequential:
        for name in names:
            side = build_side(name, cfg, batch, args)
            times[name] = compare({name: side.step}, rounds=args.steps, iters=args.back_to_back, warmup=0)[name]
            if args.profile and name == "tessera" and cuda:
                print_profile(side.step, trace=args.trace)
            results[name] = side_figures(side, times[name], tokens, name, args)
            del side
            if cuda:
                torch.cuda.empty_cache()
    else:
        try:
            sides = {name: build_side(name, cfg, batch, args) for name in names}
            times = compare({name: side.step for name, side in sides.items()}, rounds=args.steps,
                            iters=args.back_to_back, warmup=0)
        except torch.cuda.OutOfMemoryError as err:
            raise SystemExit(f"bench.train_step: the two sides do not fit on the GPU together; rerun with "
                             f"--sequential ({str(err).splitlines()[0]})") from None
        if args.profile and "tessera" in sides and cuda:
            print_profile(sides["tessera"].step, trace=args.trace)
        results = {name: side_figures(side, times[name], tokens, name, args) for name, side in sides.items()}
    if len(times) < 2:
        return results, None
    if args.sequential:
        return results, {"median": times["baseline"].ms / times["tessera"].ms, "min": None, "max": None}
    return results, ratio(times["baseline"], times["tessera"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed rounds: one optimizer step of each side per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first (at least 1)")
    parser.add_argument("--back-to-back", type=int, default=1, metavar="K",
                        help="optimizer steps per timed round, queued one after the other as Trainer.run queues them "
                             "(each step's record read once the next is queued); the step time is the round's / K")
    parser.add_argument("--layers", type=int, default=None, help="default 20 dense, 4 with --moe")
    parser.add_argument("--moe", action="store_true",
                        help="the DeepSeek-like fine-grained MoE (64 experts of 1408, top-8, 2 shared); MFU on active parameters")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compile Tessera's blocks")
    parser.add_argument("--cuda-graphs", action="store_true", help="with --compile: train.cuda_graphs")
    parser.add_argument("--compile-baseline", action="store_true")
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-batches per optimizer step (both sides): real global batches amortise the step")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one Tessera step")
    parser.add_argument("--trace", default=None, help="with --profile: also write that step's Chrome trace (JSON) here")
    parser.add_argument("--only", choices=list(SIDES), default=None)
    parser.add_argument("--sequential", action="store_true",
                        help="time one side after the other, each alone on the GPU (when both do not fit together)")
    parser.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                        help="Tessera's precision (fp8: the blocks' linears and the experts; MFU still against bf16 peak)")
    parser.add_argument("--dense-backend", choices=["torch", "te"], default="torch",
                        help="Tessera's model.dense_backend (te: Transformer Engine's linears)")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="blockwise",
                        help="with --precision fp8: train.fp8_recipe (delayed needs --dense-backend te, rowwise torch)")
    parser.add_argument("--no-wgrad-fusion", action="store_true",
                        help="Tessera without gradient-accumulation fusion (expert wgrad in bf16, then an fp32 pass)")
    parser.add_argument("--no-fp8-weight-cache", action="store_true",
                        help="with --precision fp8: quantise the weights in every micro-batch (train.fp8_weight_cache off)")
    parser.add_argument("--fused-loss", action="store_true",
                        help="Tessera's train.fused_loss: the output head and the loss over token chunks, the head's "
                             "gradient straight into its fp32 main grad")
    parser.add_argument("--split-masters", action="store_true",
                        help="Tessera's parallel.split_master_weights: fp32 masters as the bf16 weights plus a 16-bit low half")
    parser.add_argument("--dim", type=int, default=2048, help="smaller for a CPU smoke test")
    parser.add_argument("--mtp-layers", type=int, default=None, metavar="D",
                        help="multi-token prediction depths (model.mtp_layers; default the config's, 0 for the dense "
                             "model); Tessera only: the plain loop has no MTP")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.accum < 1 or args.back_to_back < 1:
        parser.error("--steps, --warmup, --accum and --back-to-back must be >= 1 (the warm-up compiles, allocates the optimizer "
                     "state and gives the peak memory)")
    torch.backends.cuda.matmul.allow_tf32 = True
    args.layers = args.layers or (4 if args.moe else 20)
    cfg = model_config(args.layers, args.moe, args.dim)
    if args.mtp_layers is not None:
        cfg.mtp_layers = args.mtp_layers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = synthetic_batch(args.batch, args.seq, cfg.vocab_size, device, cfg.mtp_layers)
    names = [name for name in SIDES if not args.only or name == args.only]
    if cfg.mtp_layers and names != ["tessera"]:
        parser.error("--mtp-layers > 0 (or a config with model.mtp_layers) runs Tessera only: add --only tessera")
    results, speedup = run_sides(cfg, batch, args, names)
    for name, r in results.items():
        print(f"{name:9s} step {r['step_ms']:7.1f} ms [{r['step_ms_range'][0]:.1f} - {r['step_ms_range'][1]:.1f}]  "
              f"{r['tokens_per_s'] / 1e3:7.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  peak {r['peak_mem_gib']:5.1f} GiB  "
              f"params {r['params'] / 1e9:.3f}B ({r['active_params'] / 1e9:.3f}B active)")
        if "fp8_weight_cache" in r:
            print(f"{'':9s} fp8 weight cache: {r['fp8_weight_cache']}")
    if speedup is not None:
        spread = f" [{speedup['min']:.3f} - {speedup['max']:.3f}]" if speedup["min"] is not None else " (sequential)"
        print(f"tessera / baseline tokens/s: {speedup['median']:.3f}{spread}")
    emit("train_step", {"interleaved": not args.sequential and len(results) == 2, "args": vars(args),
                        "results": results, "tessera_vs_baseline_tokens_per_s": speedup}, device)


if __name__ == "__main__":
    main()
