"""The table of rates the time model reads: one JSON per GPU kind.

What it holds (units in the keys), and how each is looked up:

- `gemm_tflops[dtype]`: bf16 GEMM rates on a grid of M, N, K (`gemm_grid`); a product of any
  shape is interpolated in log space between the eight grid points around it (clamped at the
  edges, where rates flatten out);
- `grouped_efficiency`: a grouped GEMM (the routed experts) against one dense GEMM of the
  per-expert shape; `fp8_speedup` (linear, grouped): Tessera's FP8 GEMMs, quantisers included,
  against bf16;
- `attention_tflops`: causal attention forward and backward by document length (head_dim 128,
  the cuDNN path whole rows take); `ring_efficiency`: context-parallel ring blocks against that;
- `memory_gbps`: memory-bound passes by bytes moved (read + write), `launch_us` per kernel;
- `collectives`: bus bandwidth (GB/s) by operation, group size and message size, inside a node
  (NVLink) and across nodes (the network), `latency_us` per collective (a group size between
  two measured ones takes the nearer one below, clamped to the measured range); `p2p_gbps` for the pipeline's
  sends; `pcie_gbps` for activation offload; `host_us_per_block`: the host's time to issue one
  eager block's forward and backward (a step never runs faster than its host);
- `allocator`: what the caching allocator and the libraries add to the tensors (memory model).

`source` says where the numbers come from: the shipped `h100_default.json` was measured by
`bench.calibrate` on one H100 (SXM, 80 GB), `h200_default.json` on one H200 (141 GB), each
keeping stated assumptions for what one GPU cannot measure (collectives, the network across
nodes; `notes` lists which); `python -m bench.calibrate --out FILE` measures a table on a GPU,
`tessera-plan --calibration FILE` uses it. `default_path` picks a shipped table by GPU name
(`tessera-plan --gpu`, and the bench tools by `torch.cuda.get_device_name()`).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.planner.memory import Allocator

DEFAULT_PATH = Path(__file__).with_name("h100_default.json")
#: The shipped tables by short name; a GPU name is matched against these names and the tables' `device`.
SHIPPED = {"h100": DEFAULT_PATH, "h200": Path(__file__).with_name("h200_default.json")}
#: Without a GPU name, tessera-plan takes the H200 table for GPUs above this many GiB (an H100 has 80, an H200 141).
H200_ABOVE_GIB = 96.0
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
FORMAT = 1


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and the problem."""


def _interp_log(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of y over log(x), clamped to the first and last point."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + f * (y1 - y0)


def _bracket(grid: list[int], x: float) -> tuple[int, int, float]:
    """Indices of the grid points around x and the log-space weight of the upper one."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        return len(grid) - 1, len(grid) - 1, 0.0
    i = bisect.bisect_right(grid, x)
    return i - 1, i, (math.log(x) - math.log(grid[i - 1])) / (math.log(grid[i]) - math.log(grid[i - 1]))


@dataclass
class Calibration:
    device: str
    source: str
    gemm_grid: list[int]
    gemm_tflops: dict[str, list]  # dtype -> [m][n][k] TFLOP/s
    grouped_efficiency: float
    fp8_speedup: dict[str, float]
    attention_tflops: list[list[float]]  # [document length, forward, backward]
    ring_efficiency: float
    memory_gbps: list[list[float]]  # [bytes moved, GB/s]
    launch_us: float
    collectives: dict[str, dict[str, dict[str, list[list[float]]]]]  # where -> op -> group size -> [[bytes, GB/s]]
    latency_us: dict[str, float]
    p2p_gbps: dict[str, float]
    pcie_gbps: float
    host_us_per_block: dict[str, float]  # eager forward + backward of one block: "dense", "moe"
    allocator: Allocator = field(default_factory=Allocator)
    notes: list[str] = field(default_factory=list)
    path: str = ""
    _gemm_cache: dict = field(default_factory=dict, repr=False, compare=False)
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # the time model's per-layout figures

    # -- lookups -----------------------------------------------------------------------------

    def gemm_s(self, m: int, n: int, k: int, dtype: str = "bf16") -> float:
        """Seconds of one [m, k] x [k, n] product."""
        if min(m, n, k) <= 0:
            return 0.0
        key = (m, n, k, dtype)
        if key not in self._gemm_cache:
            self._gemm_cache[key] = self._gemm_s(m, n, k, dtype)
        return self._gemm_cache[key]

    def _gemm_s(self, m: int, n: int, k: int, dtype: str) -> float:
        table = self.gemm_tflops["bf16"]
        grid = self.gemm_grid
        (i0, i1, fi), (j0, j1, fj), (l0, l1, fl) = (_bracket(grid, v) for v in (m, n, k))
        rate = 0.0
        for i, wi in ((i0, 1 - fi), (i1, fi)):
            for j, wj in ((j0, 1 - fj), (j1, fj)):
                for kk, wk in ((l0, 1 - fl), (l1, fl)):
                    if wi * wj * wk:
                        rate += wi * wj * wk * math.log(table[i][j][kk])
        seconds = 2.0 * m * n * k / (math.exp(rate) * 1e12)
        return seconds / self.fp8_speedup.get("linear", 1.0) if dtype == "fp8" else seconds

    def grouped_gemm_s(self, rows: int, groups: int, n: int, k: int, dtype: str = "bf16") -> float:
        """Seconds of a grouped product: `rows` rows over `groups` experts, each [rows/groups, k] x [k, n]."""
        if rows <= 0 or groups <= 0:
            return 0.0
        per_group = self.gemm_s(max(1, rows // groups), n, k) * groups / self.grouped_efficiency
        return per_group / self.fp8_speedup.get("grouped", 1.0) if dtype == "fp8" else per_group

    def attention_s(self, doc_len: int, docs: float, heads: int, head_dim: int, backward: bool) -> float:
        """Seconds of causal attention over `docs` documents of `doc_len` tokens (q heads)."""
        if doc_len <= 0 or docs <= 0:
            return 0.0
        flops = 2.0 * doc_len * doc_len * heads * head_dim * docs  # causal: half of 4 S^2 H D
        column = 2 if backward else 1
        if backward:
            flops *= 2.5  # dq, dk, dv and the recomputed scores
        rate = _interp_log([(p[0], p[column]) for p in self.attention_tflops], doc_len)
        return flops / (rate * 1e12)

    def memory_s(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds of memory-bound passes moving `nbytes` in all, in `kernels` launches."""
        if nbytes <= 0:
            return 0.0
        rate = _interp_log([(p[0], p[1]) for p in self.memory_gbps], nbytes / max(kernels, 1))
        return nbytes / (rate * 1e9) + kernels * self.launch_us * 1e-6

    def collective_s(self, op: str, group: int, nbytes: float, inter_node: bool = False) -> float:
        """Seconds of one collective over `group` ranks. `nbytes`: the full buffer (all-reduce:
        each rank's buffer; reduce-scatter: each rank's input; all-gather: each rank's output;
        all-to-all: each rank's send buffer). Ring algorithms move (n-1)/n of it per rank,
        all-reduce twice that."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        where = "inter" if inter_node else "intra"
        factor = (group - 1) / group * (2 if op == "all_reduce" else 1)
        by_size = self.collectives[where][op]
        sizes = sorted(int(g) for g in by_size)
        size = max([g for g in sizes if g <= group] or sizes[:1])
        busbw = _interp_log([(p[0], p[1]) for p in by_size[str(size)]], nbytes)
        return self.latency_us[where] * 1e-6 + factor * nbytes / (busbw * 1e9)

    def p2p_s(self, nbytes: float, inter_node: bool = False) -> float:
        where = "inter" if inter_node else "intra"
        return self.latency_us[where] * 1e-6 + nbytes / (self.p2p_gbps[where] * 1e9)

    def pcie_s(self, nbytes: float) -> float:
        return nbytes / (self.pcie_gbps * 1e9)

    # -- files -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        a = self.allocator
        return {
            "format": FORMAT, "device": self.device, "source": self.source, "notes": self.notes,
            "gemm_grid": self.gemm_grid, "gemm_tflops": self.gemm_tflops,
            "grouped_efficiency": self.grouped_efficiency, "fp8_speedup": self.fp8_speedup,
            "attention_tflops": self.attention_tflops, "ring_efficiency": self.ring_efficiency,
            "memory_gbps": self.memory_gbps, "launch_us": self.launch_us,
            "collectives": self.collectives, "latency_us": self.latency_us, "p2p_gbps": self.p2p_gbps,
            "pcie_gbps": self.pcie_gbps, "host_us_per_block": self.host_us_per_block,
            "allocator": {"fragmentation": a.fragmentation, "context_bytes": a.context_bytes,
                          "nccl_bytes_per_group": a.nccl_bytes_per_group},
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> "Calibration":
        try:
            if data.get("format") != FORMAT:
                raise CalibrationError(f"format {data.get('format')!r}, expected {FORMAT}")
            grid = [int(v) for v in data["gemm_grid"]]
            bf16 = data["gemm_tflops"]["bf16"]
            if sorted(grid) != grid or len(bf16) != len(grid) or any(len(r) != len(grid) or any(
                    len(c) != len(grid) or min(c) <= 0 for c in r) for r in bf16):
                raise CalibrationError("gemm_tflops.bf16 must be a positive [m][n][k] table over gemm_grid (ascending)")
            collectives = data["collectives"]
            for where_ in ("intra", "inter"):
                for op in COLLECTIVES:
                    table = collectives[where_][op]
                    if not table or any(int(g) < 2 or not rows for g, rows in table.items()):
                        raise CalibrationError(f"collectives.{where_}.{op} must map group sizes >= 2 to "
                                               "[[bytes, GB/s], ...]")
            a = data.get("allocator", {})
            allocator = Allocator(float(a.get("fragmentation", Allocator.fragmentation)),
                                  int(a.get("context_bytes", Allocator.context_bytes)),
                                  int(a.get("nccl_bytes_per_group", Allocator.nccl_bytes_per_group)))
            return cls(str(data["device"]), str(data["source"]), grid, data["gemm_tflops"],
                       float(data["grouped_efficiency"]), dict(data["fp8_speedup"]),
                       sorted(data["attention_tflops"]), float(data["ring_efficiency"]),
                       sorted(data["memory_gbps"]), float(data["launch_us"]),
                       {w: {op: {str(g): sorted(rows) for g, rows in collectives[w][op].items()} for op in COLLECTIVES}
                        for w in ("intra", "inter")},
                       {k: float(v) for k, v in data["latency_us"].items()},
                       {k: float(v) for k, v in data["p2p_gbps"].items()}, float(data["pcie_gbps"]),
                       {k: float(v) for k, v in data["host_us_per_block"].items()}, allocator, list(data.get("notes", [])), where)
        except CalibrationError as err:
            raise CalibrationError(f"calibration {where or 'table'}: {err}") from None
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise CalibrationError(f"calibration {where or 'table'}: missing or malformed entry ({err!r}); "
                                   "write one with `python -m bench.calibrate --out FILE`") from None

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Calibration":
        """A calibration file, or the shipped H100 default."""
        path = Path(path) if path else DEFAULT_PATH
        if not path.is_file():
            raise CalibrationError(f"calibration file '{path}' does not exist; write one with "
                                   "`python -m bench.calibrate --out FILE`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CalibrationError(f"calibration file '{path}' is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise CalibrationError(f"calibration file '{path}' holds {type(data).__name__}, not an object")
        return cls.from_dict(data, str(path))

    @property
    def derived(self) -> bool:
        return self.source.startswith("derived")


def _device_of(path: Path) -> str:
    try:
        return str(json.loads(path.read_text()).get("device", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def default_path(gpu: str) -> Path | None:
    """The shipped table for a GPU name: a short name (`h100`, `h200`), a table's `device` field
    (`NVIDIA H200`), or a name that contains one of the short names (what
    `torch.cuda.get_device_name()` returns, e.g. `NVIDIA H100 80GB HBM3`); None if none matches."""
    name = gpu.strip().lower()
    if not name:
        return None
    if name in SHIPPED:
        return SHIPPED[name]
    for path in SHIPPED.values():
        if _device_of(path).lower() == name:
            return path
    found = [path for short, path in SHIPPED.items() if short in name.replace(" ", "").replace("-", "")]
    return found[0] if len(found) == 1 else None


def default_for_memory(gpu_memory_gib: float) -> Path:
    """Without a GPU name: the H100 table up to H200_ABOVE_GIB GiB per GPU, the H200 table above."""
    return SHIPPED["h200" if gpu_memory_gib > H200_ABOVE_GIB else "h100"]


def load_for_gpu(gpu: str) -> Calibration:
    """The shipped table for a GPU name (`default_path`); CalibrationError naming the choices if none matches."""
    path = default_path(gpu)
    if path is None:
        names = ", ".join(f"{short} ({_device_of(p)})" for short, p in SHIPPED.items())
        raise CalibrationError(f"no shipped calibration table for GPU '{gpu}'; the shipped ones: {names}; or "
                               "measure one with `python -m bench.calibrate --out FILE` and pass --calibration FILE")
    return Calibration.load(path)
