"""bf16 against FP8 training on one device: same seed, same data, final losses and step times.

For each model (a dense and an MoE transformer) the script trains twice from the same weights
on the same batches, through the trainer's own step (`core.train.trainer.Trainer.step` on one rank:
bf16 params, fp32 master weights and grads, the project's AdamW): once with `precision="bf16"`,
once with `"fp8"` (the recipe of core/precision/blockwise.py). Data: the bytes of `dataservice.build.make_corpus` documents, rows of
`seq` tokens drawn by a seeded generator; a held-out tail of the stream gives the eval loss.
It prints, per model: final train loss (mean of the last 10 steps), held-out loss (at least
4096 tokens), their relative differences to bf16, and the median step time of each run (steps
after the first 5, each step timed by bench.harness.time_call; the runs follow one another, so
the step-time ratio is one of medians). `--floor` adds an fp32 run: its drift from bf16 is what any change of
rounding does to such a short run, the scale against which FP8's drift is read. The corpus's
loss floor (`dataservice.build.corpus_loss_floor`: its words are drawn independently) is printed
too: runs still far above it are in the steep part of training, where any rounding change moves
the final loss by percents; near it, two good runs must end close together.

    python -m bench.fp8_training --expert-wgrad both --floor   # GPU: small dense + MoE, 300 steps
    python -m bench.fp8_training --smoke                           # CPU: tiny models, 8 steps
    python -m bench.fp8_training --device cpu --size tiny --steps 200 --floor   # CPU parity

Where no kernel library runs (CPU), the FP8 GEMMs are the kernels' exact PyTorch emulation:
the losses then mean what they mean on a GPU, the step times do not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import Timing, emit, time_call
from core.config import Config, ModelConfig, MoEConfig
from core.train.data import StepInputs
from core.layers import AttentionMeta
from core.train.loss import cross_entropy_sum
from core.train.trainer import Trainer
from dataservice.build import corpus_loss_floor, make_corpus

# Every GEMM dimension of the blocks is a multiple of 128, so every block GEMM runs in FP8.
SIZES = {
    "tiny": dict(dim=128, num_layers=2, num_heads=4, num_kv_heads=4, ffn_dim=384),
    "small": dict(dim=2048, num_layers=8, num_heads=16, num_kv_heads=4, ffn_dim=5632),
    # Wide enough that the GEMMs, not the per-token quantisation passes, set the step time.
    "medium": dict(dim=4096, num_layers=4, num_heads=32, num_kv_heads=8, ffn_dim=14336),
}
MOE = {
    "tiny": MoEConfig(num_experts=4, top_k=2, ffn_dim=128, first_k_dense=1, aux_loss_coeff=0.01),
    "small": MoEConfig(num_experts=16, top_k=2, ffn_dim=1408, num_shared_experts=1, first_k_dense=1,
                       aux_loss_coeff=0.01),
    "medium": MoEConfig(num_experts=16, top_k=2, ffn_dim=2048, num_shared_experts=1, first_k_dense=1,
                        aux_loss_coeff=0.01),
}
VOCAB = 256  # bytes


def model_config(size: str, moe: bool) -> ModelConfig:
    cfg = ModelConfig(vocab_size=VOCAB, **SIZES[size])
    if moe:
        cfg.moe = dataclasses.replace(MOE[size])
    return cfg


@dataclasses.dataclass
class TokenData:
    """A byte stream split into a training part and a held-out tail."""

    train: torch.Tensor  # int64 [n]
    held_out: torch.Tensor

    @classmethod
    def from_corpus(cls, n_docs: int, seed: int = 0, held_out: float = 0.05) -> "TokenData":
        with tempfile.TemporaryDirectory() as tmp:
            path = make_corpus(tmp, n_docs=n_docs, seed=seed, min_len=64, max_len=4096)
            texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
        stream = torch.frombuffer(bytearray("\n".join(texts).encode("utf-8")), dtype=torch.uint8).long()
        cut = int(len(stream) * (1 - held_out))
        return cls(stream[:cut], stream[cut:])

    def rows(self, part: torch.Tensor, n: int, seq: int, gen: torch.Generator) -> torch.Tensor:
        if len(part) < seq + 2:
            raise ValueError(f"{len(part)} tokens cannot give rows of seq={seq}: use more documents")
        starts = torch.randint(0, len(part) - seq - 1, (n,), generator=gen)
        return part[starts[:, None] + torch.arange(seq + 1)]  # [n, seq + 1]


def packed(rows: torch.Tensor, device: torch.device):
    """(tokens, labels, positions, meta) of rows [B, seq + 1], each row one document."""
    b, seq = rows.shape[0], rows.shape[1] - 1
    rows = rows.to(device)
    cu = torch.arange(0, b * seq + 1, seq, dtype=torch.int32, device=device)
    positions = torch.arange(seq, device=device).repeat(b)
    return rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1), positions, AttentionMeta(cu_seqlens=cu, max_seqlen=seq)


def step_inputs(rows: torch.Tensor, device: torch.device) -> StepInputs:
    """One micro-batch of the trainer from rows [B, seq + 1] (every label counts)."""
    tokens, labels, positions, meta = packed(rows, device)
    return StepInputs(tokens, labels, positions, meta, num_tokens=float(tokens.numel()),
                      num_labels=float(labels.numel()))


@dataclasses.dataclass
class RunResult:
    losses: list[float]
    eval_loss: float
    steps: Timing  # milliseconds of the timed steps (after the first 5)

    @property
    def final_loss(self) -> float:
        return statistics.fmean(self.losses[-10:])

    @property
    def step_ms(self) -> float:
        return self.steps.ms


def _last_step_profiler(active: bool, device: torch.device):
    if not active:
        return contextlib.nullcontext()
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))


def run_config(cfg: ModelConfig, precision: str, steps: int, batch: int, seq: int, device: torch.device,
               lr: float, warmup: int, seed: int, compile_model: bool, expert_wgrad: str = "fp8") -> Config:
    """The trainer's settings of one run: one micro-batch of `batch` rows per step on one rank;
    `expert_wgrad`: train.fp8_expert_wgrad of an FP8 run."""
    config = Config(model=cfg)
    t = config.train
    t.lr, t.min_lr, t.warmup_steps, t.max_steps, t.precision = lr, lr / 10, warmup, steps, precision
    if precision == "fp8":
        t.fp8_expert_wgrad = expert_wgrad
    t.compile, t.seed, t.seq_len, t.device = compile_model, seed, seq, device.type
    t.micro_batch_size = t.global_batch_size = batch
    return config


def train_run(cfg: ModelConfig, precision: str, data: TokenData, steps: int, batch: int, seq: int,
              device: torch.device, lr: float = 3e-3, warmup: int = 20, seed: int = 0, eval_rows: int = 16,
              log_every: int = 0, compile_model: bool = False, profile: bool = False,
              expert_wgrad: str = "fp8") -> RunResult:
    """Train a fresh model (`build_model(cfg, seed)`) for `steps` steps of the trainer; the batches
    depend only on `seed`."""
    torch._dynamo.reset()  # each run compiles afresh: no shapes marked dynamic by an earlier run
    trainer = Trainer(run_config(cfg, precision, steps, batch, seq, device, lr, warmup, seed, compile_model,
                                 expert_wgrad))
    gen = torch.Generator().manual_seed(seed)
    losses, times, done = [], [], []
    for step in range(steps):
        micro = [step_inputs(data.rows(data.train, batch, seq, gen), trainer.device)]
        profiler = _last_step_profiler(profile and step == steps - 1, trainer.device)
        with profiler:
            times.append(time_call(lambda: done.append(trainer.step(micro)), device=trainer.device))
        result = done.pop()
        losses.append(float(result.loss_sum) / result.global_labels)
        if profile and step == steps - 1:
            print(f"  {precision}: the last step's CUDA time by kernel", flush=True)
            print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
        if log_every and (step + 1) % log_every == 0:
            print(f"  {precision} step {step + 1:4d} loss {losses[-1]:.4f} {times[-1]:7.1f} ms", flush=True)
    # Held-out loss in training-sized batches: a new shape would make compiled blocks recompile
    # with dynamic shapes, where inductor has crashed (docs/fp8.md).
    eval_gen = torch.Generator().manual_seed(seed + 1)
    total, tokens_seen = 0.0, 0
    with torch.no_grad():
        for _ in range(-(-eval_rows // batch)):  # whole batches, at least eval_rows rows
            tokens, labels, positions, meta = packed(data.rows(data.held_out, batch, seq, eval_gen), trainer.device)
            loss_sum, count = cross_entropy_sum(trainer.model(tokens, positions, meta), labels)
            total, tokens_seen = total + float(loss_sum), tokens_seen + int(count)
    return RunResult(losses, total / tokens_seen, Timing(times[5:] or times))


def compare(name: str, cfg: ModelConfig, data: TokenData, args, device: torch.device) -> dict:
    """bf16 and FP8 runs of one model (plus fp32 with --floor, and for MoE FP8 with the bf16
    expert wgrad with --expert-wgrad both); prints one line per comparison."""
    variants = [("bf16", "bf16", None), ("fp8", "fp8", args.expert_wgrad if args.expert_wgrad != "both" else "fp8")]
    if cfg.moe.num_experts and args.expert_wgrad == "both":
        variants.append(("fp8-wgrad-bf16", "fp8", "bf16"))
    # --runs: a subset, e.g. to run the slow fp32 floor in another process.
    selected = set(args.runs.split(",")) if args.runs else None
    if args.floor or (selected and "fp32" in selected):  # a non-FP8 precision change: how far good runs drift apart
        variants.append(("fp32", "fp32", None))
    if selected:
        variants = [v for v in variants if v[0] in selected]
    eval_rows = -(-max(16, 4096 // args.seq) // args.batch) * args.batch  # whole training-sized batches
    runs = {}
    for label, precision, wgrad in variants:
        runs[label] = train_run(cfg, precision, data, args.steps, args.batch, args.seq, device, lr=args.lr,
                                warmup=args.warmup, seed=args.seed, eval_rows=eval_rows, log_every=args.log_every,
                                compile_model=args.compile, profile=args.profile, expert_wgrad=wgrad or "fp8")
    out = {"model": name, "steps": args.steps, "eval_tokens": eval_rows * args.seq}
    b = runs.get("bf16")
    for label, r in runs.items():
        entry = {"final": r.final_loss, "eval": r.eval_loss, "step_ms": r.step_ms,
                 "step_ms_range": (r.steps.min_ms, r.steps.max_ms), "first_loss": r.losses[0]}
        line = f"{name:6s} {label:14s} final loss {r.final_loss:.4f}"
        if b is None or label == "bf16":
            line += f" | eval {r.eval_loss:.4f} | step {r.step_ms:8.1f} ms"
        else:
            entry.update(final_rel_diff=(r.final_loss - b.final_loss) / b.final_loss,
                         eval_rel_diff=(r.eval_loss - b.eval_loss) / b.eval_loss, speedup=b.step_ms / r.step_ms)
            line += (f" ({100 * entry['final_rel_diff']:+.2f}%) | eval {r.eval_loss:.4f} "
                     f"({100 * entry['eval_rel_diff']:+.2f}%) | step {r.step_ms:8.1f} ms (bf16/this x{entry['speedup']:.2f})")
        out[label] = entry
        print(line, flush=True)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models, 8 steps, CPU: checks the script runs")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on GPU, tiny on CPU")
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 4 small, 4 tiny)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (small, medium), 64 tiny")
    parser.add_argument("--lr", type=float, default=None, help="default 3e-4 medium, 1e-3 small, 3e-3 tiny")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--docs", type=int, default=None, help="corpus documents (default 4000, 400 tiny)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--log-every", type=int, default=0)
    parser.add_argument("--expert-wgrad", choices=["fp8", "bf16", "both"], default="fp8",
                        help="MoE FP8 runs: the experts' weight-gradient GEMM (both: one run each)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks and the loss (both precisions)")
    parser.add_argument("--profile", action="store_true", help="print the last step's CUDA kernels of each run")
    parser.add_argument("--floor", action="store_true", help="also train in fp32: the drift of a non-FP8 change")
    parser.add_argument("--runs", default="", help="only these runs (comma list of bf16, fp8, fp8-wgrad-bf16, fp32); "
                        "the differences to bf16 are printed when bf16 is among them")
    parser.add_argument("--json", default="", help="also append the record (one JSON line) to this file")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    for name in models:
        if name not in ("dense", "moe"):
            parser.error(f"--models: {name!r} is not one of dense, moe")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.smoke:
        args.size, args.steps, args.device = "tiny", min(args.steps, 8), "cpu"
        device = torch.device("cpu")
    size = args.size or ("small" if device.type == "cuda" else "tiny")
    gpu_sized = size != "tiny"
    args.batch = args.batch or 4
    args.seq = args.seq or (2048 if gpu_sized else 64)
    args.lr = args.lr or {"tiny": 3e-3, "small": 1e-3, "medium": 3e-4}[size]
    args.docs = args.docs or (4000 if gpu_sized else 400)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    data = TokenData.from_corpus(args.docs, seed=args.seed)
    floor = corpus_loss_floor(args.seed)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, size {size}, "
          f"{args.steps} steps of {args.batch}x{args.seq} tokens, {len(data.train)} training bytes, "
          f"the corpus's loss floor {floor:.4f} nats/byte", flush=True)
    results = []
    for name in models:
        results.append(compare(name, model_config(size, name == "moe"), data, args, device))
    emit("fp8_training", {"size": size, "args": vars(args), "loss_floor": floor, "results": results}, device,
         argv=argv, path=args.json or None)
    return results


if __name__ == "__main__":
    main()
