"""One way to time and to record a benchmark, for every script in bench/.

Timing. Candidates (named callables) are timed in interleaved rounds: each round times every
candidate once, each round starting one further along the list. Clock, thermal and co-tenant
drift then hits all candidates alike, and two candidates' figures of the same round can be
divided (`ratio`). A round's figure is the mean time per call over `iters` calls, read on the
device's own clock (CUDA events) on a GPU, or with `time.perf_counter` on the CPU (the scripts'
smoke paths); a candidate's figure is the median over rounds, with its spread (`Timing`).

- `flush_l2`: every call starts with a cold L2 cache and is timed alone (kernel benchmarks: the
  operands of the previous call must not be served from L2).
- `graph`: the `iters` calls are captured once into a CUDA graph and the graph is replayed: no
  host time between the calls. Only for graph-safe work: nothing that reads back to the host,
  synchronises, or allocates differently from call to call.
- `host_ahead`: each round's calls are queued behind a sleeping GPU kernel (~50 ms per call), so
  the host has issued them all before the first starts: the figure is the GPU's time for the
  work alone, without the waits for a host that is behind (an accumulating step's later
  micro-batches, whose host work runs under the previous ones). Not with `flush_l2`.
- `group`: for work spread over ranks. Each measurement starts after a barrier, and every rank
  keeps the slowest rank's figure (the slowest rank sets a collective's pace).

Records. `emit(bench, figures)` prints one JSON line (and appends it to the file named by
TESSERA_BENCH_RECORDS, if set) holding the device, torch version, git commit ("+dirty" when
tracked files differ from it), UTC date and argv in front of the figures, so that lines of
different scripts and runs can be set side by side and traced back to a tree.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

RECORDS_ENV = "TESSERA_BENCH_RECORDS"  # a JSONL file every record is also appended to
HEADER = ("bench", "device", "torch", "commit", "date", "argv")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- timing ----------------------------------------------------------------------------------


@dataclass
class Timing:
    """One candidate's figures: mean milliseconds per call of each round, in round order."""

    rounds_ms: list[float]
    iters: int = 1  # calls per round

    @property
    def ms(self) -> float:
        """The median over rounds: the figure to report."""
        return statistics.median(self.rounds_ms)

    @property
    def min_ms(self) -> float:
        return min(self.rounds_ms)

    @property
    def max_ms(self) -> float:
        return max(self.rounds_ms)

    @property
    def iqr_ms(self) -> tuple[float, float]:
        """First and third quartile over rounds (linear interpolation between samples)."""
        if len(self.rounds_ms) == 1:
            return self.rounds_ms[0], self.rounds_ms[0]
        q1, _, q3 = statistics.quantiles(self.rounds_ms, n=4, method="inclusive")
        return q1, q3

    def summary(self) -> dict:
        return {"ms": self.ms, "ms_min": self.min_ms, "ms_max": self.max_ms, "ms_iqr": list(self.iqr_ms),
                "rounds": len(self.rounds_ms), "iters": self.iters}


def ratio(a: Timing, b: Timing) -> dict:
    """a's time over b's, round by round (the speed-up of b over a): median, lowest, highest.
    Same-round ratios cancel the drift that interleaving spreads over both candidates."""
    if len(a.rounds_ms) != len(b.rounds_ms):
        raise ValueError(f"ratio of timings with {len(a.rounds_ms)} and {len(b.rounds_ms)} rounds")
    r = [x / y for x, y in zip(a.rounds_ms, b.rounds_ms)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def round_order(names: list[str], r: int) -> list[str]:
    """The candidates of round r: the list rotated by r, so none is always first (or after the same one)."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """The device whose clock times the work: the given one, else the GPU when there is one."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_AHEAD_CYCLES = 100_000_000  # GPU clock cycles of sleep per call queued: ~50 ms at 2 GHz


def time_call(fn: Callable[[], object], iters: int = 1, device: torch.device | str | None = None,
              flush_l2: bool = False, host_ahead: bool = False) -> float:
    """Mean milliseconds per call of `iters` calls of fn: the one clock of this module.

    On a GPU, CUDA events around the calls (around each call with flush_l2), then a wait for
    the end event: the device's time, including any gap where it waited for the host. On the
    CPU, perf_counter around the calls."""
    device = resolve_device(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    if host_ahead and flush_l2:
        raise ValueError("host_ahead times the calls back to back; flush_l2 times each alone")
    if not flush_l2:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if host_ahead:
            torch.cuda._sleep(_AHEAD_CYCLES * iters)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    buffer = _l2_flush_buffer(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        buffer.zero_()  # outside the timed region
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return sum(s.elapsed_time(e) for s, e in events) / iters


@functools.lru_cache(maxsize=None)
def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.int8, device=device)  # larger than any current L2


def _capture(fn: Callable[[], object], iters: int) -> Callable[[], None]:
    """A callable replaying `iters` calls of fn from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # lazy initialisation and autotuning happen outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    return graph.replay


def compare(candidates: dict[str, Callable[[], object]], rounds: int = 5, iters: int | None = None,
            warmup: int = 1, round_ms: float = 100.0, device: torch.device | str | None = None,
            graph: bool = False, flush_l2: bool = False, group=None, host_ahead: bool = False) -> dict[str, Timing]:
    """Time the candidates in `rounds` interleaved rounds; returns a Timing per candidate.

    warmup: untimed calls of each candidate first (compilation, allocator, autotuning).
    iters: calls per round; None picks, per candidate, as many as fill about round_ms (one
    call of a slow candidate, enough calls of a fast kernel to average out launch jitter).
    graph, flush_l2, group, host_ahead: see the module's docstring (graph replays are never flushed)."""
    device = resolve_device(device)
    if graph and device.type != "cuda":
        raise ValueError("graph replay needs a CUDA device")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    if device.type == "cuda":
        torch.cuda.synchronize()
    counts = {}
    for name in names:
        if iters is not None:
            counts[name] = iters
        else:  # every rank must run the same number of calls: they may be collectives
            estimate = _slowest(time_call(candidates[name], 1, device), group, device)
            counts[name] = max(1, round(round_ms / max(estimate, 1e-6)))
    runners = {n: _capture(candidates[n], counts[n]) for n in names} if graph else candidates
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in round_order(names, r):
            if group is not None:
                dist.barrier(group=group)
            if graph:
                ms = time_call(runners[name], 1, device) / counts[name]
            else:
                ms = time_call(runners[name], counts[name], device, flush_l2, host_ahead)
            samples[name].append(_slowest(ms, group, device))
    return {n: Timing(samples[n], counts[n]) for n in names}


def _slowest(ms: float, group, device: torch.device) -> float:
    if group is None:
        return ms
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


# -- records ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def git_commit() -> str:
    """HEAD's short hash, with "+dirty" when tracked files differ from it; "unknown" outside git.
    TESSERA_COMMIT overrides it, for copies of a tree whose .git is not the tree's own."""
    if os.environ.get("TESSERA_COMMIT"):
        return os.environ["TESSERA_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_ROOT,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=_ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def device_name(device: torch.device | str | None = None) -> str:
    device = resolve_device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def record(bench: str, figures: dict, device: torch.device | str | None = None,
           argv: list[str] | None = None) -> dict:
    """The record of one measurement: where and what it ran on, then its figures.

    bench: the script's module name under bench/ (`python -m bench.<bench> <argv>` reruns it);
    argv: its arguments (default sys.argv[1:])."""
    clash = set(HEADER) & set(figures)
    if clash:
        raise ValueError(f"figures may not use the record's own keys: {sorted(clash)}")
    header = {"bench": bench, "device": device_name(device), "torch": torch.__version__, "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "argv": list(sys.argv[1:] if argv is None else argv)}
    return {**header, **figures}


def emit(bench: str, figures: dict, device: torch.device | str | None = None, argv: list[str] | None = None,
         path: str | os.PathLike | None = None) -> dict:
    """Print the record as one JSON line (rank 0 only, under torch.distributed), and append it to
    `path` and to the file named by TESSERA_BENCH_RECORDS when given."""
    rec = record(bench, figures, device, argv)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return rec
    line = json.dumps(rec)
    print(line, flush=True)
    for target in (path, os.environ.get(RECORDS_ENV)):
        if target:
            with open(target, "a") as f:
                f.write(line + "\n")
    return rec
