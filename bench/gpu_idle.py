"""Where the GPU idles in a profiled step, and what the host was doing meanwhile.

Reads a Chrome trace written by torch.profiler (`python -m bench.train_step --profile --trace F`),
merges the GPU's busy intervals (kernels, copies, memsets, all streams), and reports the idle
gaps between the first and the last GPU activity: their total and size histogram, then, for
the gaps of at least --min-gap-us, the host events that overlapped them (by name, time
overlapped): host syncs (`cudaStreamSynchronize`, `aten::item`, ...) show up as such; a gap with
only launches under it means the host was too slow to feed the GPU.

    python -m bench.gpu_idle TRACE.json [--min-gap-us 20] [--top 40]
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"}


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Union of the GPU events' [start, end) in microseconds, sorted."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATS)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def idle_gaps(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1) if busy[i + 1][0] > busy[i][1]]


def host_overlap(events: list[dict], gaps: list[tuple[float, float]]) -> dict[str, float]:
    """Microseconds of the gaps that each host event name overlapped (nested events each count)."""
    starts = [a for a, _ in gaps]
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") not in HOST_CATS or e.get("ph") != "X":
            continue
        a, b = e["ts"], e["ts"] + e.get("dur", 0)
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(gaps) and gaps[i][0] < b:
            lo, hi = max(a, gaps[i][0]), min(b, gaps[i][1])
            if hi > lo:
                out[f"{e['cat']}: {e['name']}"] += hi - lo
            i += 1
    return out


def summarise(trace: dict, min_gap_us: float, top: int) -> str:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    busy = busy_intervals(events)
    if not busy:
        return "no GPU events in the trace"
    gaps = idle_gaps(busy)
    window = busy[-1][1] - busy[0][0]
    idle = sum(b - a for a, b in gaps)
    lines = [f"GPU window {window / 1e3:.1f} ms: busy {(window - idle) / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
             f"in {len(gaps)} gaps"]
    edges = [0, 5, 20, 100, 1000, 10000, float("inf")]
    for lo, hi in zip(edges, edges[1:]):
        sel = [b - a for a, b in gaps if lo <= b - a < hi]
        lines.append(f"  gaps {lo:>6} - {hi:<6} us: {len(sel):6d}, {sum(sel) / 1e3:8.2f} ms")
    big = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    lines.append(f"host events under the {len(big)} gaps of >= {min_gap_us:g} us "
                 f"({sum(b - a for a, b in big) / 1e3:.2f} ms), by time overlapped:")
    for name, us in sorted(host_overlap(events, big).items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / 1e3:9.2f} ms  {name[:120]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.trace) as f:
        print(summarise(json.load(f), args.min_gap_us, args.top))


if __name__ == "__main__":
    main()
