"""`tessera-plan --config FILE --gpus N --gpu-memory-gib M [--gpus-per-node G] [--gpu h100|h200 | --calibration FILE]
[--write-config OUT] [--measure K] [--top T] [--set KEY=VALUE ...]`;
`tessera-plan --longest --config FILE --gpus N --gpu-memory-gib M --host-memory-gib H ...`.

Enumerates every legal layout x micro-batch (the global batch fixed) x recompute set x offload
choice of the config on N GPUs of M GiB, keeps the candidates whose predicted peak fits, ranks
them by predicted tokens/s and prints the best T with their memory and time breakdowns, then
the winner's in full. `--write-config OUT` writes the winner as a config `tessera-train` loads;
`--measure K` trains the best K for a few steps on this node's GPUs and prints predicted against
measured. A best plan that leaves under `MIN_HEADROOM` of the GPU's memory free is a warning
line on stderr. Misuse, or an error of the config itself (one that no layout changes, named
before any layout is tried): one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

from core.config import ConfigError, load_config
from core.rules import recompute_set
from core.validation import validate
from core.planner.layouts import describe
from core.planner.calibration import H200_ABOVE_GIB, Calibration, CalibrationError, default_for_memory, load_for_gpu
from core.planner.longest import LongCandidate, Longest, apply_longest, longest, settings_of
from core.planner.measure import run_plan
from core.planner.memory import estimate_memory, head_activations
from core.planner.search import Candidate, Search, apply_plan, checkable, config_toml, search
from core.planner.timing import estimate_time

GIB = 2 ** 30
COMM = ("tp_comm", "ep_comm", "cp_comm", "grad_sync")
MEASURE_STEPS = 6
# The memory model underestimates measured peaks by up to 5.4% (docs/planner.md): a plan with
# less than 5% free may not fit on the GPU.
MIN_HEADROOM = 0.05


class _Parser(argparse.ArgumentParser):
    """argparse that reports misuse as a single line (no usage block) and exits with 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera-plan", description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--config", required=True, help="TOML file, e.g. launch/configs/deepseek_like.toml")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run (the world size)")
    parser.add_argument("--gpu-memory-gib", type=float, required=True,
                        help="memory of one GPU, GiB (an H100 80GB: 79.6, an H200: 140; what the process may hold in all)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8): TP stays inside one")
    parser.add_argument("--gpu", default=None, metavar="NAME",
                        help="the shipped table of this GPU kind: h100, h200, or a name matched against the tables' "
                             "device (default: h100 up to 96 GiB per GPU, h200 above)")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="rates measured by `python -m bench.calibrate --out FILE` (instead of a shipped table)")
    parser.add_argument("--write-config", default=None, metavar="OUT", help="write the best plan as a config TOML")
    parser.add_argument("--measure", type=int, default=0, metavar="K",
                        help=f"train the best K plans for {MEASURE_STEPS} steps on this node's GPUs; predicted vs measured")
    parser.add_argument("--top", type=int, default=10, metavar="T", help="plans to print (default 10)")
    parser.add_argument("--longest", action="store_true",
                        help="find the longest train.seq_len that trains (one document per row, micro-batch 1), with "
                             "the layout and long-context settings that reach it; needs --host-memory-gib")
    parser.add_argument("--host-memory-gib", type=float, default=None, metavar="H",
                        help="with --longest: host memory per node, GiB, shared by its ranks' offloads (what "
                             "/proc/meminfo's MemAvailable shows)")
    parser.add_argument("--seq-len", type=int, default=0, metavar="N",
                        help="with --longest: plan this length (a multiple of --seq-multiple) instead of searching")
    parser.add_argument("--seq-multiple", type=int, default=1024, metavar="K",
                        help="with --longest: the length is a multiple of K (default 1024)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set train.global_batch_size=1024 (repeatable)")
    return parser


def _fail(message: str) -> int:
    print(f"tessera-plan: error: {message}", file=sys.stderr)
    return 2


def _check_args(args) -> str | None:
    if args.gpus < 1:
        return f"--gpus {args.gpus} must be >= 1"
    if not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        return f"--gpu-memory-gib {args.gpu_memory_gib} must be a positive number of GiB, e.g. 79.6 for an H100 80GB"
    if args.gpus_per_node < 1:
        return f"--gpus-per-node {args.gpus_per_node} must be >= 1"
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        return f"--gpus {args.gpus} must be a multiple of --gpus-per-node {args.gpus_per_node} (whole nodes)"
    if args.gpu is not None and args.calibration is not None:
        return "give --gpu NAME (a shipped table) or --calibration FILE (a measured one), not both"
    if args.longest:
        if args.host_memory_gib is None:
            return "--longest needs --host-memory-gib H, the host memory of one node in GiB (0: no host offload)"
        if not (math.isfinite(args.host_memory_gib) and args.host_memory_gib >= 0):
            return f"--host-memory-gib {args.host_memory_gib} must be a number of GiB >= 0"
        if args.seq_multiple < 1 or args.seq_multiple % 1024:
            return f"--seq-multiple {args.seq_multiple} must be a positive multiple of 1024 (the tiled MLP's chunk)"
        if args.seq_len < 0 or args.seq_len % args.seq_multiple:
            return f"--seq-len {args.seq_len} must be a positive multiple of --seq-multiple {args.seq_multiple}"
        if args.measure:
            return "--measure runs the ranked plans of a plain search; leave it out with --longest"
    elif args.host_memory_gib is not None or args.seq_len:
        return "--host-memory-gib and --seq-len plan with --longest; add --longest or leave them out"
    if args.top < 1:
        return f"--top {args.top} must be >= 1"
    if args.measure < 0:
        return f"--measure {args.measure} must be >= 0"
    if args.write_config is not None:
        out = Path(args.write_config)
        if out.is_dir():
            return f"--write-config {out} is a folder; give a file name such as plan.toml"
        if not out.absolute().parent.is_dir():
            return f"--write-config {out}: the folder {out.absolute().parent} does not exist"
    return None


def _calibration(args) -> tuple[Calibration, str]:
    """The table to plan with, and why it was taken (said on the "calibration:" line)."""
    if args.calibration:
        return Calibration.load(args.calibration), "--calibration"
    if args.gpu:
        return load_for_gpu(args.gpu), f"--gpu {args.gpu}"
    side = "above" if args.gpu_memory_gib > H200_ABOVE_GIB else "up to"
    return Calibration.load(default_for_memory(args.gpu_memory_gib)), \
        f"--gpu-memory-gib {args.gpu_memory_gib:g}, {side} {H200_ABOVE_GIB:g}; --gpu NAME picks another"


def _check_measure(k: int, world: int, gpus_per_node: int) -> str | None:
    if not k:
        return None
    if world > gpus_per_node:
        return f"--measure runs on this node only: --gpus {world} exceeds --gpus-per-node {gpus_per_node}"
    import torch  # here only: planning itself never needs torch (its import costs seconds)

    found = torch.cuda.device_count()
    if found < world:
        return f"--measure needs {world} GPUs on this node, found {found}; plan without --measure, or measure on a GPU node"
    return None


def _parts(c: Candidate) -> tuple[float, float, float, float]:
    """Seconds of the step: compute (recomputation and exposed offload copies included),
    exposed communication, pipeline bubble, optimizer."""
    b = c.time.breakdown()
    comm = sum(b.get(k, 0.0) for k in COMM)
    compute = sum(v for k, v in b.items() if k not in COMM + ("bubble", "optimizer"))
    return compute, comm, b.get("bubble", 0.0), b.get("optimizer", 0.0)


def _row(i: int, c: Candidate) -> str:
    m = c.memory.breakdown()
    compute, comm, bubble, opt = _parts(c)
    rc = ",".join(c.recompute) or "-"
    off = ",".join(c.offload) or "-"
    return (f"{i:>3} {c.layout:<26} {c.micro_batch_size:>3} {rc:<28} {off:<18} {c.time.tokens_per_s / 1e3:>8.1f}k "
            f"{c.time.step_s * 1e3:>8.0f} {100 * c.time.mfu:>5.1f}% {c.memory.device_total / GIB:>6.1f} "
            f"{m['params']:>5.1f} {m['grads']:>5.1f} {m['optimizer']:>5.1f} {m['activations']:>5.1f} "
            f"{m['transient'] + m['reduction'] + m['fp8_cache'] + m['other']:>5.1f} | {compute * 1e3:>7.0f} "
            f"{comm * 1e3:>6.0f} {bubble * 1e3:>6.0f} {opt * 1e3:>5.0f}")


HEADER = (f"{'#':>3} {'layout':<26} {'mb':>3} {'recompute':<28} {'offload':<18} {'tok/s':>9} {'step ms':>8} "
          f"{'MFU':>6} {'GiB':>6} {'param':>5} {'grad':>5} {'optim':>5} {'activ':>5} {'other':>5} | "
          f"{'compute':>7} {'comm':>6} {'bubble':>6} {'optim':>5}")


def _winner(c: Candidate, world: int) -> list[str]:
    m, t = c.memory, c.time
    lines = [f"best: {c.layout}, micro-batch {c.micro_batch_size}, recompute {list(c.recompute)}, offload "
             f"{list(c.offload)}: {t.tokens_per_s / 1e3:.1f}k tokens/s ({t.tokens_per_s / world / 1e3:.2f}k per GPU), "
             f"step {t.step_s * 1e3:.0f} ms, MFU {100 * t.mfu:.1f}%"]
    lines.append("  memory of rank {} (GiB): ".format(m.rank) + ", ".join(
        f"{k} {v:.2f}" for k, v in m.breakdown().items() if v) + f"; peak allocated {m.peak_allocated / GIB:.2f}, "
        f"reserved {m.peak_reserved / GIB:.2f}, on the device {m.device_total / GIB:.2f}")
    lines.append("  activations of one micro-batch by module kind (GiB, this rank's layers): " + ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in sorted(m.per_layer.items(), key=lambda kv: -kv[1]) if v))
    b = t.breakdown()
    lines.append("  step (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(b.items(), key=lambda kv: -kv[1])
                                            if v >= 5e-5))
    lines.append(f"  one micro-batch {t.micro_s * 1e3:.1f} ms ({'host-bound' if t.host_bound else 'GPU-bound'}), "
                 f"pipeline bubble {100 * t.bubble:.1f}%, exposed gradient reduction {t.grad_sync_s * 1e3:.1f} ms")
    return lines


def _calibration_line(args, cal: Calibration) -> str:
    shown = Path(cal.path)
    if shown.is_absolute() and shown.is_relative_to(Path.cwd()):
        shown = shown.relative_to(Path.cwd())
    return f"calibration: {shown} ({cal.source}) [{args.why_table}]"


def _print_plan(found: Search, args, cal: Calibration) -> None:
    print(_calibration_line(args, cal))
    if cal.derived:
        print("  (derived figures: measure this GPU kind with `python -m bench.calibrate --out FILE`, "
              "then pass --calibration FILE)")
    print(f"{found.considered} candidates on {args.gpus} GPUs, {found.evaluated} evaluated (the others recompute more "
          f"than a fitting set of the same layout and micro-batch), {len(found.fitting)} fit in "
          f"{args.gpu_memory_gib:g} GiB, best {min(args.top, len(found.fitting))} by predicted tokens/s:")
    for note in found.notes:
        print(f"  note: {note}")
    print(HEADER)
    for i, c in enumerate(found.fitting[:args.top], 1):
        print(_row(i, c))
    print("  (GiB: on the device per GPU; other: transient, reduction buffers, allocator, CUDA context, NCCL. "
          "ms: per step; compute includes recomputation and exposed offload copies)")
    print()
    print("\n".join(_winner(found.fitting[0], args.gpus)))


def _headroom_warning(plan: Candidate, gpu_memory_gib: float) -> str | None:
    """The warning line for a plan that leaves under MIN_HEADROOM of the GPU's memory free, or None."""
    total = gpu_memory_gib * GIB
    free = total - plan.memory.device_total
    if free >= MIN_HEADROOM * total:
        return None
    return (f"tessera-plan: warning: the best plan leaves {free / GIB:.2f} GiB ({100 * free / total:.1f}%) of the "
            f"{gpu_memory_gib:g} GiB free per GPU, and the memory model may miss peaks by up to "
            f"{100 * MIN_HEADROOM:g}% (docs/planner.md); the plans that keep that free: --gpu-memory-gib "
            f"{(1 - MIN_HEADROOM) * gpu_memory_gib:.3g}")


def _as_given(config, args, cal: Calibration, found: Search) -> str:
    """Where the config's own layout, micro-batch and recomputation stand among the plans."""
    own = checkable(config)
    own.parallel.dynamic_cp = False  # planned as static CP, like every candidate
    try:
        validate(own, args.gpus)
    except ConfigError as err:
        return f"the config as given: not a legal layout on {args.gpus} GPUs ({err})"
    recompute = tuple(sorted(recompute_set(own.train)))
    c = Candidate(own, describe(own), recompute, tuple(own.train.offload_modules),
                  estimate_memory(own, allocator=cal.allocator), estimate_time(own, cal, args.gpus_per_node))
    fits = c.memory.device_total <= args.gpu_memory_gib * GIB
    place = 1 + sum(1 for f in found.fitting if f.time.tokens_per_s > c.time.tokens_per_s)
    where = f"would rank {place} of {len(found.fitting)}" if fits else \
        f"does not fit ({c.memory.device_total / GIB:.1f} GiB)"
    return f"the config as given {where}:\n{_row(0, c)}"


def _write(path: Path, config, plan: Candidate) -> None:
    text = (f"# tessera-plan: {plan.layout}, micro-batch {plan.micro_batch_size}, recompute "
            f"{list(plan.recompute)}, offload {list(plan.offload)}; predicted {plan.time.tokens_per_s / 1e3:.1f}k "
            f"tokens/s, {plan.memory.device_total / GIB:.1f} GiB per GPU\n" + config_toml(config))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _measure(found: Search, args, config) -> None:
    print()
    print(f"measured: the best {args.measure} on this node, {MEASURE_STEPS} steps each (median step after the warm-up; "
          "memory: torch.cuda.max_memory_allocated of rank 0)")
    print(f"{'#':>3} {'layout':<26} {'mb':>3} {'recompute':<28} {'step ms pred':>12} {'meas':>8} {'err':>6} "
          f"{'GiB pred':>8} {'meas':>6} {'err':>6}")
    with tempfile.TemporaryDirectory(prefix="tessera-plan-") as tmp:
        for i, c in enumerate(found.fitting[:args.measure], 1):
            plan = apply_plan(config, c, args.gpus)
            got = run_plan(plan, args.gpus, MEASURE_STEPS, Path(tmp), f"plan{i}")
            pred_s = c.time.step_s
            pred_gib = estimate_memory(c.config, rank=0, allocator=c.memory.allocator).peak_allocated / GIB
            rc = ",".join(c.recompute) or "-"
            if got.step_s is None:
                print(f"{i:>3} {c.layout:<26} {c.micro_batch_size:>3} {rc:<28} {pred_s * 1e3:>12.0f}  failed: {got.error}")
                continue
            mem = f"{got.mem_gib:>6.1f} {100 * (pred_gib / got.mem_gib - 1):>+5.0f}%" if got.mem_gib else "     -"
            print(f"{i:>3} {c.layout:<26} {c.micro_batch_size:>3} {rc:<28} {pred_s * 1e3:>12.0f} {got.step_s * 1e3:>8.0f} "
                  f"{100 * (pred_s / got.step_s - 1):>+5.0f}% {pred_gib:>8.1f} {mem}")


def _longest(args, config, cal: Calibration) -> int:
    gpu, host = int(args.gpu_memory_gib * GIB), int(args.host_memory_gib * GIB)
    try:
        found = longest(config, args.gpus, gpu, host, cal, args.gpus_per_node, args.seq_multiple, args.seq_len)
    except ConfigError as err:
        return _fail(str(err))
    at = args.seq_len or args.seq_multiple
    if found is None:
        return _fail(f"no legal layout of {args.config} on {args.gpus} GPUs ({args.gpus_per_node} per node) at "
                     f"micro-batch 1: check that the model's heads and layers divide over them and that "
                     "train.global_batch_size is a multiple of the data-parallel size")
    if not isinstance(found, Longest):
        return _fail(f"nothing trains {at} tokens per row on {args.gpus} GPUs of {args.gpu_memory_gib:g} GiB with "
                     f"{args.host_memory_gib:g} GiB of host memory per node; the closest: {_needs(found)}")
    print(_calibration_line(args, cal))
    print("\n".join(longest_lines(found, args)))
    if args.write_config:
        plan = apply_longest(config, found)
        try:
            validate(checkable(plan), args.gpus)
        except ConfigError as err:
            return _fail(f"the plan does not validate as a config: {err}")
        plan.parallel.dp = 0
        text = (f"# tessera-plan --longest: train.seq_len {found.seq_len}, {found.best.layout}; predicted "
                f"{found.best.memory.device_total / GIB:.1f} GiB per GPU, {found.best.host.node / GIB:.1f} GiB host per "
                f"node\n" + config_toml(plan))
        out = Path(args.write_config)
        out.with_name(out.name + ".tmp").write_text(text)
        out.with_name(out.name + ".tmp").replace(out)
        print(f"\nwrote {args.write_config}: tessera-train --config {args.write_config} --nproc-per-node "
              f"{min(args.gpus, args.gpus_per_node)}" + (f" --nnodes {args.gpus // args.gpus_per_node}"
                                                          if args.gpus > args.gpus_per_node else ""))
    return 0


def _needs(c: LongCandidate) -> str:
    return (f"{c.layout} with {_settings_text(c.config)} needs {c.memory.device_total / GIB:.1f} GiB per GPU and "
            f"{c.host.node / GIB:.1f} GiB of host memory per node")


def _settings_text(config) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings_of(config).items() if k not in ("tp", "cp", "pp", "dp"))


def longest_lines(found: Longest, args) -> list[str]:
    """What --longest prints: the length, the plan, its memory on the GPU and the host, its time."""
    c, m, t = found.best, found.best.memory, found.best.time
    b = m.breakdown()
    ranks = min(args.gpus, args.gpus_per_node)
    searched = (f"planned at --seq-len {found.seq_len}" if args.seq_len else
                f"searched by doubling, then bisection to a multiple of {found.multiple}")
    what = "train.seq_len" if args.seq_len else "longest train.seq_len"
    lines = [f"{what} on {args.gpus} GPUs of {args.gpu_memory_gib:g} GiB with {args.host_memory_gib:g} "
             f"GiB of host memory per node ({ranks} ranks per node): {found.seq_len} tokens "
             f"({found.seq_len / 1e6:.2f} million, {found.seq_len / 2**20:.2f} x 2^20)",
             f"  (one document per row, micro-batch 1: attention at its upper bound; {searched}; "
             f"{found.fitting} candidates fit there)"]
    for note in found.notes:
        lines.append(f"  note: {note}")
    lines.append(f"  layout: {c.layout}" + (f" {c.config.parallel.cp_comm}" if c.config.parallel.cp > 1 else "")
                 + f", global batch {c.config.train.global_batch_size} rows")
    lines.append(f"  settings: {_settings_text(c.config)}")
    lines.append("  GPU per rank (GiB): " + ", ".join(f"{k} {b[k]:.2f}" for k in (
        "params", "grads", "optimizer", "fp8_cache", "activations", "transient", "reduction", "other") if b[k])
        + f"; on the device {m.device_total / GIB:.2f} of {args.gpu_memory_gib:g}")
    head = head_activations(c.config) / GIB if c.config.parallel.pp == 1 else 0.0
    blocks = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(m.per_layer.items(), key=lambda kv: -kv[1]) if v)
    lines.append(f"  activations: the head's (final norm, head input or its gradient, loss) {head:.2f} GiB; the blocks' "
                 f"by module kind (one micro-batch): {blocks or 'none on the device'}")
    lines.append(f"  host per rank (GiB): checkpoint inputs {c.host.rank_checkpoints / GIB:.2f}, optimizer "
                 f"{c.host.rank_optimizer / GIB:.2f}; per node {c.host.node / GIB:.2f} of {args.host_memory_gib:g}")
    lines.append(f"  step: {t.step_s:.1f} s, {t.tokens_per_s / 1e3:.2f}k tokens/s ({t.tokens_per_s / args.gpus / 1e3:.3f}k "
                 f"per GPU), MFU {100 * t.mfu:.1f}%; (s) " + ", ".join(
                     f"{k} {v:.2f}" for k, v in sorted(t.breakdown().items(), key=lambda kv: -kv[1]) if v >= 5e-3))
    if found.closest is not None:
        lines.append(f"  at {found.next_seq_len} tokens nothing fits; the closest: {_needs(found.closest)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    try:
        config = load_config(args.config, args.overrides)
        cal, args.why_table = _calibration(args)
    except (ConfigError, CalibrationError) as err:
        return _fail(str(err))
    if args.longest:
        return _longest(args, config, cal)
    problem = _check_measure(args.measure, args.gpus, args.gpus_per_node)
    if problem:
        return _fail(problem)
    try:
        found = search(config, args.gpus, int(args.gpu_memory_gib * GIB), cal, args.gpus_per_node)
    except ConfigError as err:
        return _fail(str(err))
    if not found.fitting:
        if not found.considered:
            return _fail(f"no legal layout of {args.config} on {args.gpus} GPUs ({args.gpus_per_node} per node): "
                         "check that the model's heads, layers and experts divide over them and that "
                         "train.global_batch_size is a multiple of the data-parallel size")
        s = found.smallest
        return _fail(f"none of the {found.considered} candidates fits {args.gpu_memory_gib:g} GiB per GPU; the smallest "
                     f"needs {s.device_total / GIB:.1f} GiB: use more GPUs, larger ones, or a smaller micro-batch or model")
    _print_plan(found, args, cal)
    print(_as_given(config, args, cal, found))
    warning = _headroom_warning(found.fitting[0], args.gpu_memory_gib)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if args.write_config:
        try:
            plan = apply_plan(config, found.fitting[0], args.gpus)
        except ConfigError as err:
            return _fail(f"the best plan does not validate as a config: {err}")
        _write(Path(args.write_config), plan, found.fitting[0])
        print(f"\nwrote {args.write_config}: tessera-train --config {args.write_config} --nproc-per-node "
              f"{min(args.gpus, args.gpus_per_node)}" + (f" --nnodes {args.gpus // args.gpus_per_node}"
                                                          if args.gpus > args.gpus_per_node else ""))
    if args.measure:
        _measure(found, args, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
