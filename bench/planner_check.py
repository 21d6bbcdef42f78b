"""The layout planner's predictions against real training steps on one GPU.

    python -m bench.planner_check                       # ~5 minutes on one H100
    python -m bench.planner_check --write-calibration FILE   # measure the table first (bench.calibrate), predict
                                                        # with it, fit the allocator's overhead, write FILE
    python -m bench.planner_check --dry-run             # the cases and their predictions (any machine)

Each case builds the real `core.train.trainer.Trainer` on one GPU (bf16, eager unless noted) and runs
`Trainer.step` + `Trainer.record` on a synthetic micro-batch (bench.train_step's: every row one
document), 2 warm-up steps then 3 timed ones. The models are bench.train_step's: the ~1B dense
Llama-style model (20 layers) and the DeepSeek-like MoE at 4 layers. The cases cover dense and
MoE, micro-batches 1-8, sequences of 4k-64k tokens, every recompute set the planner weighs,
offload on and off, gradient accumulation. Per case:

- memory (each case in a process of its own): `torch.cuda.max_memory_allocated` over the steps,
  above what was allocated before the Trainer was built, against the planner's `peak_allocated`
  (what it predicts: the allocator's tensors, not the CUDA context); `max_memory_reserved` against `peak_reserved`; and the peak a
  step adds above the state (activations and transients) per token, against the same prediction;
- time: the median step time (`Trainer.record`'s step_s, a host sync per step) against the
  predicted step time.

Then the table "activation memory per token and step-time overhead for each recompute set on
the ~1B model at seq 8192" (the cases `r:*`), predicted and measured. `--with-compile` adds a
compiled case (the memory model counts eager blocks: a compiled block saves less).
Records: one JSON line per run (bench.harness.emit), and `--out FILE` the same as a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.calibrate import calibrate, shipped_table
from bench.harness import emit
from bench.train_step import model_config, synthetic_batch
from core.config import Config
from core.validation import validate
from core.planner.calibration import Calibration, CalibrationError
from core.planner.memory import estimate_memory
from core.planner.timing import estimate_time
from core.train.trainer import Trainer

GIB = 2 ** 30
WARMUP, TIMED = 2, 3
TABLE_SEQ = 8192


@dataclass(frozen=True)
class Case:
    name: str
    moe: bool
    seq: int
    micro: int
    accum: int = 1
    recompute: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    compile: bool = False
    smoke: bool = False  # a small model on the CPU: the same code, in seconds (the tests)

    def config(self) -> Config:
        config = Config(model=model_config(2 if self.smoke else 4 if self.moe else 20, self.moe))
        if self.smoke:  # as bench.train_step --dim 64
            m = config.model
            m.dim, m.ffn_dim, m.num_heads, m.num_kv_heads, m.vocab_size = 64, 128, 4, 2, 512
            m.moe.ffn_dim = 32 if self.moe else 0
        config.train = dataclasses.replace(
            config.train, device="cpu" if self.smoke else "cuda", seed=0, seq_len=self.seq, precision="bf16",
            micro_batch_size=self.micro,
            global_batch_size=self.micro * self.accum, recompute="none", recompute_modules=list(self.recompute),
            offload_modules=list(self.offload), compile=self.compile)
        return validate(config, 1)


RECOMPUTE_TABLE = [(), ("norms", "swiglu"), ("attention_core",), ("attention_core", "norms", "swiglu"), ("mlp",),
                   ("attention",), ("block",)]
CASES = [Case("r:" + ("+".join(r) or "none"), False, TABLE_SEQ, 1, recompute=r) for r in RECOMPUTE_TABLE] + [
    Case("dense mb8 4k attention_core+norms+swiglu", False, 4096, 8, recompute=("attention_core", "norms", "swiglu")),
    Case("dense mb2x2 16k norms+swiglu", False, 16384, 2, accum=2, recompute=("norms", "swiglu")),
    Case("dense mb1 64k block", False, 65536, 1, recompute=("block",)),
    Case("dense mb2 8k attention_core, offload mlp", False, 8192, 2, recompute=("attention_core",), offload=("mlp",)),
    Case("dense mb1 8k offload attention+mlp", False, 8192, 1, offload=("attention", "mlp")),
    Case("moe mb2x2 4k", True, 4096, 2, accum=2),
    Case("moe mb1 8k attention_core+moe_experts", True, 8192, 1, recompute=("attention_core", "moe_experts")),
    Case("moe mb4 4k norms+swiglu, offload attention_core", True, 4096, 4, recompute=("norms", "swiglu"),
         offload=("attention_core",)),
]
COMPILED = Case("dense mb2 8k attention_core, compiled", False, 8192, 2, recompute=("attention_core",), compile=True)
SMOKE = [Case("r:none", False, 128, 1, smoke=True), Case("r:block", False, 128, 1, recompute=("block",), smoke=True),
         Case("moe mb2x2 offload mlp", True, 128, 2, accum=2, offload=("mlp",), smoke=True)]


def predict(case: Case, cal: Calibration) -> dict:
    config = case.config()
    memory = estimate_memory(config, rank=0, allocator=cal.allocator)
    tokens = case.micro * case.seq
    return {"peak_allocated_gib": memory.peak_allocated / GIB, "peak_reserved_gib": memory.peak_reserved / GIB,
            "step_added_per_token": (memory.peak_allocated - memory.state.total - memory.fp8_cache) / tokens,
            "step_s": estimate_time(config, cal, 8).step_s}


class _Allocator:
    """The CUDA caching allocator's statistics (zeros on the CPU smoke)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def now(self) -> tuple[int, int]:
        return (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if self.cuda else (0, 0)

    def peak(self) -> tuple[int, int]:
        return (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if self.cuda else (0, 0)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def measure(case: Case) -> dict:
    """Build the trainer, run the steps; what the allocator and the clock saw."""
    memory = _Allocator(not case.smoke)
    memory.free()
    memory.reset()
    base_alloc, base_reserved = memory.now()
    trainer = None
    try:
        config = case.config()
        trainer = Trainer(config)
        batch = synthetic_batch(case.micro, case.seq, config.model.vocab_size, torch.device(config.train.device),
                                config.model.mtp_layers)
        micro = [batch] * case.accum
        times, added, peak_alloc, peak_res = [], 0, 0, 0
        for i in range(WARMUP + TIMED):
            memory.reset()  # the whole run's peak is the max over the steps
            before = memory.now()[0]
            start = time.perf_counter()
            record = trainer.record(trainer.step(micro), start)
            alloc, reserved = memory.peak()
            added = max(added, alloc - before)
            if i >= WARMUP:
                times.append(record["step_s"])
            peak_alloc, peak_res = max(peak_alloc, alloc - base_alloc), max(peak_res, reserved - base_reserved)
        return {"peak_allocated_gib": peak_alloc / GIB, "peak_reserved_gib": peak_res / GIB,
                "step_added_per_token": added / (case.micro * case.seq), "step_s": statistics.median(times)}
    except torch.cuda.OutOfMemoryError as err:
        return {"error": "out of memory: " + str(err).splitlines()[0][:120]}
    finally:
        del trainer
        memory.free()


def measure_isolated(case: Case) -> dict:
    """`measure` in a process of its own: each case starts from an empty allocator (what an
    earlier case or the calibration left cached cannot lend it memory), and a case that kills its
    process (a device-side assert) is reported and the others still run."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(measure, case).result()
        except BrokenProcessPool:
            return {"error": "the case's process died (see its output above)"}


def _err(pred: float, got: float | None) -> str:
    return f"{100 * (pred / got - 1):+6.1f}%" if got else "    - "


def report(rows: list[tuple[Case, dict, dict]]) -> list[str]:
    lines = [f"{'case':<48} {'alloc GiB pred':>14} {'meas':>6} {'err':>7} {'reserved pred':>13} {'meas':>6} "
             f"{'err':>7} {'step ms pred':>12} {'meas':>7} {'err':>7}"]
    for case, pred, got in rows:
        if "error" in got:
            lines.append(f"{case.name:<48} {pred['peak_allocated_gib']:>14.2f}  {got['error']}")
            continue
        lines.append(
            f"{case.name:<48} {pred['peak_allocated_gib']:>14.2f} {got['peak_allocated_gib']:>6.2f} "
            f"{_err(pred['peak_allocated_gib'], got['peak_allocated_gib'])} {pred['peak_reserved_gib']:>13.2f} "
            f"{got['peak_reserved_gib']:>6.2f} {_err(pred['peak_reserved_gib'], got['peak_reserved_gib'])} "
            f"{pred['step_s'] * 1e3:>12.0f} {got['step_s'] * 1e3:>7.0f} {_err(pred['step_s'], got['step_s'])}")
    return lines


def recompute_table(rows: list[tuple[Case, dict, dict]]) -> list[str]:
    """Activation memory per token and step-time overhead of each recompute set (the r:* cases)."""
    table = [(c, p, g) for c, p, g in rows if c.name.startswith("r:")]
    base = next(((p, g) for c, p, g in table if c.recompute == ()), None)
    lines = [f"recompute table: the ~1B model, seq {TABLE_SEQ}, micro-batch 1, bf16, eager; memory: what a step "
             "adds above the state at its peak, per token (activations + transients)",
             f"{'recompute':<32} {'KiB/token pred':>14} {'meas':>8} {'overhead pred':>13} {'meas':>8}"]
    for case, pred, got in table:
        name = "+".join(case.recompute) or "none"
        p_over = pred["step_s"] / base[0]["step_s"] - 1 if base else 0.0
        if "error" in got or not base or "error" in base[1]:
            lines.append(f"{name:<32} {pred['step_added_per_token'] / 1024:>14.1f} {'-':>8} {100 * p_over:>12.1f}% "
                         f"{got.get('error', '-')[:40]:>8}")
            continue
        g_over = got["step_s"] / base[1]["step_s"] - 1
        lines.append(f"{name:<32} {pred['step_added_per_token'] / 1024:>14.1f} {got['step_added_per_token'] / 1024:>8.1f} "
                     f"{100 * p_over:>12.1f}% {100 * g_over:>7.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=None, help="the table to predict with (default: the shipped table of this GPU kind, "
                                                            "by torch.cuda.get_device_name(); else the H100 one)")
    parser.add_argument("--write-calibration", default=None, metavar="FILE",
                        help="measure the table first (bench.calibrate), predict with it, fit the allocator's "
                             "overhead from the cases, write FILE")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and their predictions; run nothing")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this text")
    parser.add_argument("--with-compile", action="store_true", help="add a compiled case")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # CPU, tiny models: the tests
    args = parser.parse_args(argv)
    try:
        cal = Calibration.load(args.calibration or shipped_table())
    except CalibrationError as err:
        print(f"bench.planner_check: {err}", file=sys.stderr)
        return 2
    cases = SMOKE if args.smoke else CASES + ([COMPILED] if args.with_compile else [])
    cases = [c for c in cases if not args.only or args.only in c.name]
    if args.dry_run:
        print(f"calibration: {cal.path} ({cal.source})")
        for case in cases:
            p = predict(case, cal)
            print(f"case {case.name:<48} predicted: allocated {p['peak_allocated_gib']:6.2f} GiB, reserved "
                  f"{p['peak_reserved_gib']:6.2f} GiB, step {p['step_s'] * 1e3:7.0f} ms")
        print("\n".join(recompute_table([(c, predict(c, cal), {"error": "dry run"}) for c in cases])))
        return 0
    if not torch.cuda.is_available() and not args.smoke:
        print("bench.planner_check: needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    if args.write_calibration and not Path(args.write_calibration).absolute().parent.is_dir():
        print(f"bench.planner_check: --write-calibration {args.write_calibration}: no such folder", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    if args.write_calibration:
        cal = calibrate(cal)
        cal.save(args.write_calibration)  # kept if the cases are cut short; rewritten with the allocator's fit
        gc.collect()
        torch.cuda.empty_cache()
    rows = []
    for case in cases:
        got = measure(case) if case.smoke else measure_isolated(case)
        rows.append((case, predict(case, cal), got))
        print(report(rows[-1:])[-1], f"  [{time.time() - started:.0f} s]", flush=True)
    print()
    print(f"calibration: {cal.path or args.write_calibration} ({cal.source})")
    print("\n".join(report(rows)))
    print()
    print("\n".join(recompute_table(rows)))
    ok = [g for _, _, g in rows if "error" not in g and g["peak_allocated_gib"] > 0]
    if args.write_calibration and ok:
        fragmentation = statistics.median(g["peak_reserved_gib"] / g["peak_allocated_gib"] for g in ok) - 1
        cal.allocator = dataclasses.replace(cal.allocator, fragmentation=round(max(0.0, fragmentation), 3))
        cal.notes.append(f"allocator.fragmentation: median reserved/allocated - 1 over {len(ok)} planner_check cases")
        cal.save(args.write_calibration)
        print(f"wrote {args.write_calibration} (allocator fragmentation {cal.allocator.fragmentation:.3f})")
    figures = {"calibration": cal.source, "cases": [{"case": c.name, "predicted": p, "measured": g} for c, p, g in rows],
               "seconds": time.time() - started}
    emit("planner_check", figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
