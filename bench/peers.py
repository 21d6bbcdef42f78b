"""Tessera beside its peers: the same model, data and batch on one GPU, timed in interleaved rounds.

For each workload every system runs the same model (shapes, vocabulary, initial weights where
the architecture is the same), sequence length, micro-batch, global batch (gradient
accumulation), precision and optimizer (AdamW 0.9/0.95, no weight decay, constant lr, clip 1.0)
on the same synthetic token batches (one per micro-batch of the run, never repeated, in the same order for everyone):
- tessera: `core.train.trainer.Trainer` (`step` then `record`, as bench/train_step.py drives it);
- megatron: Megatron-Core 0.19's GPTModel with its Transformer Engine layer spec, its
  DistributedDataParallel, DistributedOptimizer and forward-backward schedule, as Megatron-LM's
  pretraining loop drives them (GPU; dense, dense-fp8 and longseq; chosen with --systems);
- torchtitan: its own `Trainer.train_step` with its model, parallelize (compile, its
  activation checkpointing, its float8 converter), optimizer and scheduler (bench/peer_systems.py);
- torchao-rowwise / torchao-tensorwise: `convert_to_float8_training` on the plain model,
  compiled, in a plain loop (dense-fp8 only);
- hf: transformers' LlamaForCausalLM (Glm4MoeForCausalLM for the MoE) with SDPA and torch.compile.
A peer that is not installed or cannot run a workload is reported in one line; the rest run.

Workloads (`--workload`, default all): dense (the ~1B Llama of bench/train_step.py at seq 4096,
bf16), dense-fp8 (the same in FP8: Tessera's 1x128/128x128 blockwise recipe against torchao's
rowwise and tensorwise), moe (launch/configs/deepseek_like.toml at 4 layers), longseq (the dense
model on 32k-token rows of packed documents, whole-block recompute in every system; --recompute
changes every system's, --tessera-recompute Tessera's alone). Document
boundaries: Tessera's varlen attention (cu_seqlens); Megatron's THD layout over the same
cu_seqlens; TorchTitan's flex block-causal mask split at the EOS token; transformers' block-causal
mask from position_ids that restart per document.

Timing and records are bench/harness.py's: each system is built and warmed up (--warmup steps),
then --rounds interleaved rounds of one optimizer step each (CUDA events, median and spread), or
one system after the other (--sequential, or automatically when the systems' states would not fit
on the GPU together, or after an out-of-memory error); Tessera's speed-up is the median of same-round
ratios (round i of every system reads the same micro-batches). Per system: tokens/s, MFU (core.metrics'
flops_per_token of the system's own parameter counts against 989 TFLOP/s bf16 peak, also for
FP8), peak memory above what was allocated before it was built, its build (compile + warm-up)
seconds, and its loss at every step (warm-up included): all must learn, and where the initial
weights are the same the losses agree within noise (`final_loss_spread`). One JSON record per
workload (bench.harness.emit).

    python -m bench.peers --tiny                       # every workload, tiny shapes, CPU, fp32
    python -m bench.peers --workload dense --rounds 5 --warmup 2
    python -m bench.peers --workload dense --systems tessera,torchtitan --tessera-recompute mlp,norms \
        --tessera-recompute-layers 14 --tessera-split-masters --tessera-fused-loss   # at TorchTitan's memory

On a GPU host without the peers (torch 2.11, transformers present; TorchTitan 0.3 needs a newer
torch, so 0.2.2), download the wheels here once, from the repository root, into an .whl/ that
holds no other version of these packages:

    bash ../shared/tools/gpu-wheels.sh torchtitan==0.2.2 torchao==0.18.0 tyro==1.0.17 \
        docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0 datasets==4.7.0 dill==0.4.0 \
        multiprocess==0.70.18 grpcio-health-checking==1.84.0 grpcio-tools==1.84.0 tomli-w==1.2.0 \
        megatron-core==0.19.2

then, there (carrying .whl; each workload bounded so the run ends within about 9 minutes):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PYTHONPATH TESSERA_BENCH_RECORDS=$OUT/peers.jsonl PYTHONUNBUFFERED=1 \
      && for w in dense dense-fp8 moe longseq; do timeout 130 python3 -m bench.peers --workload $w \
         --rounds 4 --warmup 2; done

Megatron-Core (its wheel needs only torch, numpy and packaging) also needs Transformer Engine on
that path (../shared/tools/te-wheels.sh); then, for example:

    python3 -m bench.peers --workload dense --systems tessera,megatron,torchtitan --rounds 4 --warmup 2
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from bench.harness import compare, emit, ratio
from bench.peer_systems import (EOS, Built, Feed, Micro, Spec, Unavailable, huggingface, megatron_core,
                                reference_weights, tessera, torchao_fp8, torchtitan)
from bench.train_step import model_config, print_profile
from core.config import FP8_RECIPES, ModelConfig, MoEConfig
from core.rules import RECOMPUTE_MODULES
from core.metrics import PEAK_FLOPS, flops_per_token
from core.train.model import build_model
from dataservice.packing import IGNORE_INDEX

SYSTEMS = {"tessera": tessera, "megatron": megatron_core, "torchtitan": torchtitan,
           "torchao-rowwise": torchao_fp8("rowwise"), "torchao-tensorwise": torchao_fp8("tensorwise"), "hf": huggingface}
STATE_BYTES = 18  # per parameter held between steps, at most: bf16 weight, fp32 master, grad, two moments


@dataclass
class Workload:
    name: str
    spec: Spec
    systems: tuple[str, ...]
    doc_range: tuple[int, int] | None = None  # packed rows: document lengths drawn in this range


def workloads(tiny: bool, device: torch.device) -> dict[str, Workload]:
    if tiny:
        dense = ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=176,
                            rope_theta=500000.0)
        moe = replace(dense, ffn_dim=192, rope_theta=10000.0, moe=MoEConfig(
            num_experts=8, top_k=2, ffn_dim=32, num_shared_experts=1, router="sigmoid", normalize_topk=True,
            routed_scaling_factor=2.5, n_groups=4, topk_groups=2, aux_loss_coeff=0.0001, aux_loss_per_sequence=True,
            bias_update_rate=0.001, first_k_dense=1))
        seq, long_seq, lr, precision, compile_, batch, accum = 64, 256, 3e-3, "fp32", False, 2, 2
    else:
        # The MoE model without its MTP module: the peers' DeepSeek-V3 models train the main loss only.
        dense, moe = model_config(20, False), replace(model_config(4, True), mtp_layers=0)
        seq, long_seq, lr, precision, compile_, batch, accum = 4096, 32768, 5e-4, "bf16", True, 2, 4
    base = Spec(model=dense, seq=seq, batch=batch, accum=accum, precision=precision, compile=compile_,
                recompute="none", packed=False, lr=lr, device=device)
    moe_recompute = "none" if tiny else "selective"  # deepseek_like.toml's choice
    return {
        "dense": Workload("dense", base, ("tessera", "torchtitan", "hf")),
        "dense-fp8": Workload("dense-fp8", replace(base, precision="fp8"),
                              ("tessera", "torchao-rowwise", "torchao-tensorwise")),
        "moe": Workload("moe", replace(base, model=moe, accum=2, recompute=moe_recompute),
                        ("tessera", "torchtitan", "hf")),
        "longseq": Workload("longseq", replace(base, seq=long_seq, batch=1, accum=2, recompute="full", packed=True),
                            ("tessera", "torchtitan", "hf"), doc_range=(long_seq // 16, long_seq // 2)),
    }


# -- data ------------------------------------------------------------------------------------


def make_pool(w: Workload, count: int, seed: int = 0) -> list[Micro]:
    """`count` micro-batches of a learnable stream (a sparse random bigram chain: each token has
    four likely successors), EOS ending every document; the same for every system."""
    spec, rng = w.spec, np.random.default_rng(seed)
    vocab, rows = spec.model.vocab_size, spec.batch * count
    successors = rng.integers(1, vocab, size=(vocab, 4))
    tokens = np.empty((rows, spec.seq), dtype=np.int64)
    tokens[:, 0] = rng.integers(1, vocab, size=rows)
    for i in range(1, spec.seq):
        follow = successors[tokens[:, i - 1], rng.integers(0, 4, size=rows)]
        tokens[:, i] = np.where(rng.random(rows) < 0.9, follow, rng.integers(1, vocab, size=rows))
    lengths = [_doc_lengths(spec.seq, w.doc_range, rng) for _ in range(rows)]
    positions = np.empty_like(tokens)
    for r, docs in enumerate(lengths):
        ends = np.cumsum(docs)
        tokens[r, ends - 1] = EOS
        positions[r] = np.concatenate([np.arange(n) for n in docs])
    pool = []
    for b in range(count):
        rows_b = slice(b * spec.batch, (b + 1) * spec.batch)
        t = torch.from_numpy(tokens[rows_b]).to(spec.device)
        targets = torch.roll(t, -1, dims=1)
        targets[:, -1] = IGNORE_INDEX
        docs = [n for row in lengths[rows_b] for n in row]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(docs)]), dtype=torch.int32, device=spec.device)
        pool.append(Micro(t, targets, torch.from_numpy(positions[rows_b]).to(spec.device), cu, max(docs),
                          spec.batch * (spec.seq - 1), tuple(int(n) for n in docs)))
    return pool


def _doc_lengths(seq: int, doc_range: tuple[int, int] | None, rng) -> list[int]:
    if doc_range is None:
        return [seq]
    lengths, left = [], seq
    while left > 0:
        n = min(int(rng.integers(doc_range[0], doc_range[1] + 1)), left)
        lengths.append(n)
        left -= n
    return lengths


# -- running ---------------------------------------------------------------------------------


@dataclass
class Ran:
    built: Built
    losses: list
    build_s: float
    peak_mem_gib: float | None


def build(name: str, w: Workload, pool: list[Micro], weights, warmup: int) -> Ran:
    """Build one system and run its warm-up steps, measuring its peak memory above what was
    allocated before it (the other systems' states, when interleaved)."""
    cuda = w.spec.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    losses = []
    try:
        built = SYSTEMS[name](w.spec, Feed(pool), weights)
        step = built.step
        built.step = lambda: losses.append(step())
        for _ in range(warmup):
            built.step()
    except (Unavailable, torch.cuda.OutOfMemoryError):
        raise
    except Exception as err:  # a peer that breaks on this workload is reported, the others still run
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise Unavailable(f"failed while building or warming up: {type(err).__name__}: {first}") from None
    if cuda:
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
    seconds = time.perf_counter() - start
    print(f"bench.peers: {w.name}: {name} built and warmed up in {seconds:.0f} s", file=sys.stderr, flush=True)
    return Ran(built, losses, seconds, peak)


def fits_together(w: Workload, names: list[str]) -> bool:
    """Whether every system's state fits on the GPU at once, with room for one step's activations."""
    if w.spec.device.type != "cuda":
        return True
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(w.spec.model, seed=0).parameters())
    total = torch.cuda.get_device_properties(w.spec.device).total_memory
    return params * STATE_BYTES * len(names) < 0.7 * total


def run_workload(w: Workload, names: list[str], rounds: int, warmup: int, sequential: bool,
                 profile: tuple[str, ...] = ()) -> dict:
    # Every step reads micro-batches no step read before: with a repeating pool the loss after a
    # few steps measures how fast each system memorises those batches, which depends on its
    # initialisation more than on the model it computes.
    pool = make_pool(w, count=max((warmup + rounds) * w.spec.accum, 4))
    weights = reference_weights(w.spec)
    unavailable, results, times = {}, {}, {}
    interleaved = not sequential and fits_together(w, names)
    if interleaved:
        ran = {}
        try:
            for name in names:
                try:
                    ran[name] = build(name, w, pool, weights, warmup)
                except Unavailable as why:
                    unavailable[name] = str(why)
            times = compare({n: r.built.step for n, r in ran.items()}, rounds=rounds, iters=1, warmup=0)
        except torch.cuda.OutOfMemoryError as err:
            print(f"bench.peers: {w.name}: the systems do not fit on the GPU together "
                  f"({str(err).splitlines()[0]}); timing them one after the other", file=sys.stderr)
            interleaved = False
        if interleaved:
            results = {n: figures(w, r, times[n]) for n, r in ran.items()}
            for name in profile if w.spec.device.type == "cuda" else ():
                if name in ran:
                    print(f"== {w.name}: one step of {name}, profiled", flush=True)
                    print_profile(ran[name].built.step, rows=30)
        del ran
        _release()
    if not interleaved:
        for name in names:
            if name in unavailable:
                continue
            try:
                r = build(name, w, pool, weights, warmup)
            except Unavailable as why:
                unavailable[name] = str(why)
                continue
            times[name] = compare({name: r.built.step}, rounds=rounds, iters=1, warmup=0)[name]
            results[name] = figures(w, r, times[name])
            if name in profile and w.spec.device.type == "cuda":
                print(f"== {w.name}: one step of {name}, profiled", flush=True)
                print_profile(r.built.step, rows=30)
            del r
            _release()
    # Same-round ratios either way: interleaved they cancel drift; sequential, round i of every
    # system trains on the same micro-batches, and packed rows' step time moves with their documents.
    base = times.get("tessera")
    speedups = {name: ratio(t, base) for name, t in times.items() if name != "tessera"} if base else {}
    finals = [r["loss_last"] for r in results.values()]
    spread = (max(finals) - min(finals)) / statistics.fmean(finals) if len(finals) > 1 else 0.0
    spec = asdict(w.spec)
    spec["model"], spec["device"] = asdict(w.spec.model), str(w.spec.device)
    return {"workload": w.name, "interleaved": interleaved, "spec": spec, "micro_batches": len(pool),
            "results": results, "unavailable": unavailable, "tessera_speedup": speedups,
            "final_loss_spread": spread}


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def figures(w: Workload, r: Ran, t) -> dict:
    spec = w.spec
    tokens = spec.batch * spec.seq * spec.accum
    total, embedding, active = r.built.params
    fpt = flops_per_token(active, embedding, spec.model.num_layers, r.built.attention_width, spec.seq)
    seconds = t.ms / 1e3
    losses = [float(x) for x in r.losses]
    return {"step_ms": t.ms, "step_ms_range": (t.min_ms, t.max_ms), "step_ms_iqr": t.iqr_ms, "rounds_ms": t.rounds_ms,
            "tokens_per_s": tokens / seconds, "mfu": fpt * tokens / seconds / PEAK_FLOPS["bf16"],
            "flops_per_token": fpt, "peak_mem_gib": r.peak_mem_gib, "build_s": r.build_s, "params": total,
            "active_params": active, "losses": losses, "loss_first": losses[0], "loss_last": losses[-1],
            "setup": r.built.setup}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["all", "dense", "dense-fp8", "moe", "longseq"], default="all")
    parser.add_argument("--systems", default="",
                        help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: each workload's own)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds: one optimizer step of each system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each system first (compile, state)")
    parser.add_argument("--sequential", action="store_true", help="time one system after the other, each alone")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU in fp32, no compile (a smoke test)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                        help="every system's recompute in place of the workload's (selective: TorchTitan's per-op "
                             "AC, Megatron's core attention; transformers recomputes whole layers or nothing)")
    parser.add_argument("--tessera-recompute", default=None, metavar="MODULES",
                        help="Tessera's train.recompute_modules, comma-separated (e.g. mlp; 'none': nothing), in "
                             "place of --recompute: its own memory/speed choice, as TorchTitan runs its own")
    parser.add_argument("--tessera-recompute-layers", type=int, default=0, metavar="N",
                        help="with --tessera-recompute: recompute in the first N blocks only "
                             "(train.recompute_num_layers; 0: every block)")
    parser.add_argument("--tessera-split-masters", action="store_true",
                        help="Tessera's parallel.split_master_weights: fp32 masters as the bf16 weights plus "
                             "their low halves (2 bytes per parameter less, exact)")
    parser.add_argument("--tessera-backend", choices=["torch", "te"], default="torch",
                        help="Tessera's model.dense_backend (te: Transformer Engine's linears)")
    parser.add_argument("--tessera-fp8-recipe", choices=FP8_RECIPES, default="blockwise",
                        help="Tessera's train.fp8_recipe in FP8 workloads (delayed needs --tessera-backend te; "
                             "tensorwise and rowwise with the torch backend run through torchao)")
    parser.add_argument("--tessera-cuda-graphs", action="store_true",
                        help="Tessera's train.cuda_graphs: its compiled block regions replayed as CUDA graphs")
    parser.add_argument("--tessera-fused-loss", action="store_true",
                        help="Tessera's train.fused_loss: the output head and the loss over token chunks")
    parser.add_argument("--profile", default="", metavar="SYSTEMS",
                        help="comma-separated systems to profile for one step after the timed rounds (GPU): "
                             "the top kernels and the GPU's idle gaps")
    args = parser.parse_args(argv)
    modules = None if args.tessera_recompute is None else \
        tuple(m for m in args.tessera_recompute.split(",") if m and m != "none")
    unknown = [m for m in modules or () if m not in RECOMPUTE_MODULES]
    if unknown:
        print(f"bench.peers: --tessera-recompute: unknown module {unknown[0]!r} (known: {', '.join(RECOMPUTE_MODULES)})",
              file=sys.stderr)
        raise SystemExit(2)
    if args.tessera_recompute_layers < 0 or (args.tessera_recompute_layers and not modules):
        print(f"bench.peers: --tessera-recompute-layers {args.tessera_recompute_layers} needs --tessera-recompute "
              "with modules to recompute, and N >= 0", file=sys.stderr)
        raise SystemExit(2)
    if args.tessera_split_masters and args.tiny:
        print("bench.peers: --tessera-split-masters needs bf16 parameters; --tiny runs fp32", file=sys.stderr)
        raise SystemExit(2)
    chosen = [s for s in args.systems.split(",") if s]
    profiled = tuple(s for s in args.profile.split(",") if s)
    bad = [s for s in chosen + list(profiled) if s not in SYSTEMS]
    if bad or args.rounds < 1 or args.warmup < 1:
        what = f"unknown system {bad[0]!r} (known: {', '.join(SYSTEMS)})" if bad else "--rounds and --warmup must be >= 1"
        print(f"bench.peers: {what}", file=sys.stderr)
        raise SystemExit(2)
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    table = workloads(args.tiny, device)
    for name in (list(table) if args.workload == "all" else [args.workload]):
        w = table[name]
        w = replace(w, spec=replace(w.spec, tessera_modules=modules, tessera_recompute_layers=args.tessera_recompute_layers,
                                    recompute=args.recompute or w.spec.recompute,
                                    recompute_forced=args.recompute is not None,
                                    tessera_fp8_recipe=args.tessera_fp8_recipe,
                                    tessera_cuda_graphs=args.tessera_cuda_graphs,
                                    tessera_fused_loss=args.tessera_fused_loss,
                                    tessera_split_masters=args.tessera_split_masters,
                                    model=replace(w.spec.model, dense_backend=args.tessera_backend)))
        names = list(chosen or w.systems)
        record = run_workload(w, names, args.rounds, args.warmup, args.sequential, profiled)
        report(record)
        emit("peers", record, device)


def report(record: dict) -> None:
    print(f"== {record['workload']} ({'interleaved' if record['interleaved'] else 'sequential'})")
    for name, r in record["results"].items():
        mem = f"{r['peak_mem_gib']:5.1f} GiB" if r["peak_mem_gib"] is not None else "   -    "
        speed = record["tessera_speedup"].get(name)
        vs = f"  tessera x{speed['median']:.2f}" if speed else ""
        print(f"{name:19s} {r['step_ms']:8.1f} ms  {r['tokens_per_s'] / 1e3:8.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  "
              f"peak {mem}  loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}  build {r['build_s']:.0f}s{vs}")
    for name, why in record["unavailable"].items():
        print(f"{name:19s} not run: {why}")
    print(f"final losses spread {100 * record['final_loss_spread']:.2f}%")


if __name__ == "__main__":
    main()
