"""Grouped GEMM for MoE experts as `torch.library` custom ops (namespace `tessera`).

- `tessera::grouped_mm(x, w, offsets)`: x [N, K] with rows grouped by expert, w [G, K, M]
  (contiguous, or a transposed view of a contiguous [G, M, K]), offsets int32 [G] cumulative
  group ends on x's device -> [N, M]; rows of group g times w[g], rows past offsets[-1] zero.
- `tessera::grouped_mm_wgrad(x, dy, offsets)`: [G, K, M] with entry g = x_g^T dy_g (zero for
  empty groups), the weight gradient.
- `main_grad_sink(w)`: where a weight gradient may be written straight into the fp32 main grad
  (gradient-accumulation fusion), also for a weight passed as a reshaped view of its parameter.

Autograd: d x = grouped_mm(dy, w^T) and d w = grouped_mm_wgrad(x, dy), both with the same
offsets. On an sm_90 GPU with libtessera_kernels.so built (csrc/), bf16 operands run the CUTLASS
kernels; the per-group arrays are built on the device from `offsets`, so calls never sync the
host and can be captured in CUDA graphs. Elsewhere the fallback is `torch._grouped_mm` (CUDA bf16,
sm_90+) or an exact per-group loop (CPU, other dtypes), each reported once in the log.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from core.kernels.fused import accumulate_fp32_
from core.kernels.library import KernelLibrary, current_raw_stream, custom_op, kernel_library, report_once

OP_FWD, OP_FWD_BT, OP_WGRAD, OP_WGRAD_F32, OP_FWD_BT_T = 0, 1, 2, 3, 4  # TESSERA_GG_* in csrc/include/tessera_codes.h
CONFIG_ENV, RASTER_ENV, SWIZZLE_ENV = "TESSERA_GG_CONFIG", "TESSERA_GG_RASTER", "TESSERA_GG_SWIZZLE"


def _check_offsets(offsets: Tensor, groups: int, device: torch.device) -> None:
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.shape[0] != groups:
        raise ValueError(f"offsets must be int32 [G={groups}], got {offsets.dtype} {list(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"offsets on {offsets.device} but the operands are on {device}")


def _check_mm(x: Tensor, w: Tensor, offsets: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm needs x [N, K] and w [G, K, M], got x {list(x.shape)} and w {list(w.shape)}")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"x and w must share dtype and device, got {x.dtype}/{w.dtype} on {x.device}/{w.device}")
    _check_offsets(offsets, w.shape[0], x.device)


def _check_wgrad(x: Tensor, dy: Tensor, offsets: Tensor) -> None:
    if x.dim() != 2 or dy.dim() != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"grouped_mm_wgrad needs x [N, K] and dy [N, M], got {list(x.shape)} and {list(dy.shape)}")
    if x.dtype != dy.dtype or x.device != dy.device:
        raise ValueError(f"x and dy must share dtype and device, got {x.dtype}/{dy.dtype} on {x.device}/{dy.device}")
    if offsets.dim() != 1:
        raise ValueError(f"offsets must be 1-D int32 [G], got {list(offsets.shape)}")
    _check_offsets(offsets, offsets.shape[0], x.device)


# ---------------------------------------------------------------------------------------
# Fallbacks: the exact loop (reference semantics) and torch._grouped_mm.
# ---------------------------------------------------------------------------------------

def grouped_mm_loop(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Exact reference: one matmul per group (reads offsets on the host)."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        end = min(max(end, start), x.shape[0])
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def grouped_mm_wgrad_loop(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    """Exact reference: dw[g] = x_g^T dy_g, zeros for empty groups."""
    out = x.new_zeros(offsets.shape[0], x.shape[1], dy.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        end = min(max(end, start), x.shape[0])
        out[g] = x[start:end].t() @ dy[start:end]
        start = end
    return out


def _native_reason(*tensors: Tensor) -> str | None:
    """None when torch._grouped_mm can run these bf16 operands, else why not."""
    x = tensors[0]
    if not x.is_cuda:
        return f"device {x.device.type}"
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm missing"
    if any(t.dtype != torch.bfloat16 for t in tensors):
        return f"dtype {x.dtype} (needs bf16)"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "GPU older than sm_90"
    if any(t.shape[-1] % 8 for t in tensors):
        return "inner dims not multiples of 8 (16-byte rows)"
    return None


def _group_nonempty(offsets: Tensor) -> Tensor:
    """bool [G]: groups with at least one row (device op, no sync)."""
    starts = torch.cat((offsets.new_zeros(1), offsets[:-1]))
    return offsets > starts


def _report_loop(op: str, reason: str) -> None:
    # On CPU the loop is the expected path (info); on a GPU it is a slow surprise (warning).
    level = logging.INFO if reason.startswith("device") else logging.WARNING
    report_once(f"{op}: per-group loop fallback ({reason})", level)


def _fallback_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    reason = _native_reason(x, w)
    if reason is None:
        return torch._grouped_mm(x, w, offs=offsets)
    _report_loop("grouped_mm", reason)
    return grouped_mm_loop(x, w, offsets)


def _fallback_wgrad(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    reason = _native_reason(x, dy)
    if reason is None:
        dw = torch._grouped_mm(x.t(), dy, offs=offsets)
        # Empty groups must give exact zeros whatever the native kernel leaves there.
        return torch.where(_group_nonempty(offsets)[:, None, None], dw, 0)
    _report_loop("grouped_mm_wgrad", reason)
    return grouped_mm_wgrad_loop(x, dy, offsets)


# ---------------------------------------------------------------------------------------
# CUTLASS path.
# ---------------------------------------------------------------------------------------

def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


# Which CUTLASS configuration runs each call (indices are the build's; a library built without one
# falls back to the first built). The figures behind each choice: docs/performance-notes.md,
# "Grouped GEMM tiles". The cooperative 128x256 tile in a 2x1 cluster is fastest on every MoE shape
# and pass, fine-grained groups included.
DEFAULT_CONFIG = "coop_128x256x64_c2x1"
# A 2-CTA cluster pads each group's row tiles to an even count, which costs most when groups hold
# few tiles: the forward on groups averaging under 1024 rows, and OP_FWD_BT_T (whose M is n: 1408
# would pad 11 tiles to 12), take the same tile unclustered.
SMALL_GROUP_CONFIG, SMALL_GROUP_ROWS = "coop_128x256x64_c1x1", 1024
# A 1x2 cluster pads N tiles, not rows: the data gradient's default, and the weight gradient's where
# only its M tile count is odd (a 2x1 cluster would waste a whole tile row there).
N_CLUSTER_CONFIG = "coop_128x256x64_c1x2"
TILE_M, TILE_N = 128, 256  # the tile of DEFAULT_CONFIG and N_CLUSTER_CONFIG


def _odd_tile_count(size: int, tile: int) -> bool:
    return -(-size // tile) % 2 == 1


def choose_config(lib: KernelLibrary, op: int, rows: int, groups: int, k: int, n: int) -> int:
    """Configuration index for one call: TESSERA_GG_CONFIG if set, else SMALL_GROUP_CONFIG for
    OP_FWD_BT_T, N_CLUSTER_CONFIG for dgrad and for a wgrad whose M tiles (not its N tiles) are
    odd, SMALL_GROUP_CONFIG for the forward (and a dgrad without N_CLUSTER_CONFIG) on small groups,
    else DEFAULT_CONFIG (each when built), else the first built one. For OP_WGRAD, k and n are the
    output's [k, n] per group."""
    forced = _env_int(CONFIG_ENV, -1)
    built = lib.gg_bf16_config_names()
    if forced >= 0:
        if forced >= len(built) or built[forced] is None:
            raise ValueError(f"{CONFIG_ENV}={forced} is not built into {lib.path}; built: {built}")
        return forced
    if op == OP_FWD_BT_T and SMALL_GROUP_CONFIG in built:
        return built.index(SMALL_GROUP_CONFIG)
    if N_CLUSTER_CONFIG in built and (op == OP_FWD_BT or (
            op in (OP_WGRAD, OP_WGRAD_F32) and _odd_tile_count(k, TILE_M) and not _odd_tile_count(n, TILE_N))):
        return built.index(N_CLUSTER_CONFIG)
    small_groups = op in (OP_FWD, OP_FWD_BT) and rows < SMALL_GROUP_ROWS * max(groups, 1)
    if small_groups and SMALL_GROUP_CONFIG in built:
        return built.index(SMALL_GROUP_CONFIG)
    if DEFAULT_CONFIG in built:
        return built.index(DEFAULT_CONFIG)
    return next(i for i, name in enumerate(built) if name is not None)


def _aligned(*tensors: Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _cutlass_reason(x: Tensor, other: Tensor) -> str | None:
    if x.dtype != torch.bfloat16:
        return f"dtype {x.dtype} (CUTLASS kernels take bf16)"
    if x.shape[1] % 8 or other.shape[-1] % 8:
        return f"inner dims {x.shape[1]}, {other.shape[-1]} not multiples of 8"
    if x.shape[0] >= 2**31:
        return f"{x.shape[0]} rows exceed int32"
    return None


# Neighbouring CTAs of the weight gradient reuse the same x_e^T and dy_e tiles from L2 at swizzle 8;
# forward and dgrad gain nothing from another order (docs/performance-notes.md, "Tile order").
WGRAD_SWIZZLE = 8


def _launch_context(lib: KernelLibrary, op: int, a: Tensor, groups: int, rows: int, k: int, n: int,
                    config: int | None) -> tuple[int, int, Tensor, int, int]:
    """(config, device index, workspace, its bytes, current stream handle) of one launch."""
    if config is None:
        config = choose_config(lib, op, rows, groups, k, n)
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    ws_bytes = lib.gg_bf16_workspace_bytes(op, config, groups, device)
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=a.device)
    return config, device, workspace, ws_bytes, current_raw_stream(device)


def run_grouped(lib: KernelLibrary, op: int, a: Tensor, b: Tensor, out: Tensor, offsets: Tensor,
                config: int | None = None) -> Tensor:
    """Launch one CUTLASS grouped GEMM into `out` on the current stream (see csrc/include).

    `a`, `b`, `out` must be contiguous bf16 and 16-byte aligned; for OP_FWD_BT and OP_FWD_BT_T `b`
    is [G, n, k]."""
    groups = offsets.shape[0]
    rows, k = a.shape
    n = out.shape[-1]
    if rows == 0:  # nothing to multiply (and empty tensors may have null pointers)
        return out.zero_() if op == OP_WGRAD else out
    if op == OP_WGRAD_F32:
        raise ValueError("OP_WGRAD_F32 runs through run_wgrad_f32 (fp32 output, accumulate flag)")
    config, device, workspace, ws_bytes, stream = _launch_context(lib, op, a, groups, rows, k, n, config)
    rc = lib.gg_bf16(op, config, a.data_ptr(), b.data_ptr(), out.data_ptr(), offsets.data_ptr(), groups,
                     rows, k, n, workspace.data_ptr(), ws_bytes, device, stream,
                     _env_int(RASTER_ENV, 0), _env_int(SWIZZLE_ENV, WGRAD_SWIZZLE if op == OP_WGRAD else 1))
    lib.check(rc, f"tessera_gg_bf16(op={op}, config={config}, rows={rows}, k={k}, n={n}, groups={groups})")
    return out


def run_wgrad_f32(lib: KernelLibrary, x: Tensor, dy: Tensor, out: Tensor, offsets: Tensor, accumulate: bool,
                  config: int | None = None) -> Tensor:
    """Launch the CUTLASS weight gradient into fp32 `out` [G, K, M] (overwritten, or added to when
    `accumulate`) on the current stream. x, dy contiguous bf16, all 16-byte aligned."""
    groups = offsets.shape[0]
    rows, k = x.shape
    n = dy.shape[1]
    if rows == 0:
        return out if accumulate else out.zero_()
    config, device, workspace, ws_bytes, stream = _launch_context(lib, OP_WGRAD_F32, x, groups, rows, k, n, config)
    rc = lib.gg_bf16_wgrad_f32(config, x.data_ptr(), dy.data_ptr(), out.data_ptr(), offsets.data_ptr(), groups, rows,
                               k, n, int(accumulate), workspace.data_ptr(), ws_bytes, device, stream,
                               _env_int(RASTER_ENV, 0), _env_int(SWIZZLE_ENV, WGRAD_SWIZZLE))
    lib.check(rc, f"tessera_gg_bf16_wgrad_f32(config={config}, rows={rows}, k={k}, n={n}, groups={groups}, "
                  f"accumulate={accumulate})")
    return out


def transposed_pads_less(rows: int, groups: int, n: int) -> bool:
    """Whether OP_FWD_BT_T computes fewer padded products than OP_FWD_BT for this call.

    OP_FWD_BT tiles each group's rows by TILE_M and n by TILE_N; OP_FWD_BT_T tiles n by TILE_M
    and the rows by TILE_N. A group's last row tile is on average half empty (the group sizes
    live on the device: the mean stands for them), n's padding is exact. The data gradient of a
    down projection of 1408 inputs (11 x 128, 5.5 x 256) with 2048-row groups: 12.5% padded
    against 6.3%; with 512-row groups OP_FWD_BT pads less."""
    mean_rows = max(rows / max(groups, 1), 1.0)
    padded_n = lambda tile: -(-n // tile) * tile / n  # noqa: E731
    bt = (1 + TILE_M / 2 / mean_rows) * padded_n(TILE_N)
    bt_t = padded_n(TILE_M) * (1 + TILE_N / 2 / mean_rows)
    return bt_t < bt


def _weight_operand(w: Tensor, rows: int) -> tuple[int, Tensor]:
    """(op, tensor to pass): w [G, K, M] as stored, or its [G, M, K] storage when it is a transposed
    view (then computed as the output's transpose where that pads less)."""
    if w.is_contiguous():
        return OP_FWD, w
    wt = w.transpose(-2, -1)
    if wt.is_contiguous():
        return (OP_FWD_BT_T if transposed_pads_less(rows, w.shape[0], w.shape[-1]) else OP_FWD_BT), wt
    return OP_FWD, w.contiguous()


def _mm_impl(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    _check_mm(x, w, offsets)
    lib = kernel_library(x.device)
    if lib is not None:
        reason = _cutlass_reason(x, w)
        if reason is None:
            x = x.contiguous()
            op, b = _weight_operand(w, x.shape[0])
            out = x.new_empty(x.shape[0], w.shape[-1])
            if _aligned(x, b, offsets):
                return run_grouped(lib, op, x, b, out, offsets)
            reason = "operands not 16-byte aligned"
        report_once(f"grouped_mm: CUTLASS kernel skipped ({reason})")
    return _fallback_mm(x, w, offsets)


def _wgrad_cutlass_operands(op_name: str, x: Tensor, dy: Tensor, *also_aligned: Tensor):
    """(library, x, dy made contiguous) when the CUTLASS weight gradient can take them, else None
    with the reason reported once under `op_name`."""
    lib = kernel_library(x.device)
    if lib is None:
        return None
    reason = _cutlass_reason(x, dy)
    if reason is None:
        x, dy = x.contiguous(), dy.contiguous()
        if _aligned(x, dy, *also_aligned):
            return lib, x, dy
        reason = "operands not 16-byte aligned"
    report_once(f"{op_name}: CUTLASS kernel skipped ({reason})")
    return None


def _wgrad_impl(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    _check_wgrad(x, dy, offsets)
    ready = _wgrad_cutlass_operands("grouped_mm_wgrad", x, dy)
    if ready is not None:
        lib, x, dy = ready
        return run_grouped(lib, OP_WGRAD, x, dy, x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1]), offsets)
    return _fallback_wgrad(x, dy, offsets)


def _check_wgrad_into(out: Tensor, x: Tensor, dy: Tensor, offsets: Tensor) -> None:
    _check_wgrad(x, dy, offsets)
    want = [offsets.shape[0], x.shape[1], dy.shape[1]]
    if out.dtype != torch.float32 or list(out.shape) != want or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"grouped_mm_wgrad_into_ needs a contiguous fp32 out {want} on {x.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")


def _wgrad_into_impl(out: Tensor, x: Tensor, dy: Tensor, offsets: Tensor, accumulate: bool) -> None:
    _check_wgrad_into(out, x, dy, offsets)
    ready = _wgrad_cutlass_operands("grouped_mm_wgrad_into_", x, dy, out)
    if ready is not None:
        lib, x, dy = ready
        run_wgrad_f32(lib, x, dy, out, offsets, accumulate)
        return
    # Unfused: the weight gradient in x's dtype, then one fp32 pass (what the main-grad hook does).
    accumulate_fp32_(out, _wgrad_impl(x, dy, offsets), copy=not accumulate)


# ---------------------------------------------------------------------------------------
# Custom ops, fake implementations, autograd. In plain eager mode (the MoE layer's routed
# experts run outside the compiled graphs) the bodies are called directly: the dispatcher round
# trip of a Python custom op is host time on every expert GEMM of every layer and micro-batch.
# ---------------------------------------------------------------------------------------

@custom_op("grouped_mm", differentiable=True)
def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x [N, K] grouped by rows, w [G, K, M], offsets int32 [G] cumulative ends -> [N, M]."""
    return _mm_impl(x, w, offsets)


@grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    _check_mm(x, w, offsets)
    return x.new_empty(x.shape[0], w.shape[-1])


@custom_op("grouped_mm_wgrad")
def grouped_mm_wgrad(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    """x [N, K], dy [N, M], offsets int32 [G] -> [G, K, M] with entry g = x_g^T dy_g."""
    return _wgrad_impl(x, dy, offsets)


@grouped_mm_wgrad.register_fake
def _(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    _check_wgrad(x, dy, offsets)
    return x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1])


@custom_op("grouped_mm_wgrad_into_", mutates_args=("out",))
def grouped_mm_wgrad_into_(out: Tensor, x: Tensor, dy: Tensor, offsets: Tensor, accumulate: bool) -> None:
    """out [G, K, M] fp32 = (or, with accumulate, +=) x_g^T dy_g per group: the experts' weight
    gradient written straight into an fp32 main-grad buffer (gradient-accumulation fusion; on the
    CUTLASS path the GEMM epilogue reads and writes `out`, no bf16 gradient is materialised)."""
    _wgrad_into_impl(out, x, dy, offsets, accumulate)


@grouped_mm_wgrad_into_.register_fake
def _(out: Tensor, x: Tensor, dy: Tensor, offsets: Tensor, accumulate: bool) -> None:
    _check_wgrad_into(out, x, dy, offsets)


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: Tensor):
    x, w, offsets = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = grouped_mm(grad, w.transpose(-2, -1), offsets)
    if ctx.needs_input_grad[1]:
        dw = grouped_mm_wgrad(x, grad, offsets)
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# The main-grad sink a grouped GEMM's weight gradient goes to (gradient-accumulation fusion).
# ---------------------------------------------------------------------------------------

class _ViewedSink:
    """A parameter's `main_grad_sink` seen through a view of the whole parameter in another
    shape: the fill gets the main grad, and the backward its stand-in, in the view's shape."""

    def __init__(self, sink, shape: torch.Size):
        self.sink, self.shape = sink, shape

    def write(self, fill) -> None:
        self.sink.write(lambda main_grad, accumulate: fill(main_grad.view(self.shape), accumulate))

    def stand_in(self) -> Tensor:
        return self.sink.stand_in().view(self.shape)


def main_grad_sink(w: Tensor):
    """The sink (core.parallel.data.MainGradSink) that takes the weight gradient of `w`: w's own
    when w is the parameter, the parameter's seen in w's shape when w views all of a contiguous
    parameter (the experts' w13 [E, dim, 2, hidden] passed as [E, dim, 2 x hidden]), else None."""
    sink = getattr(w, "main_grad_sink", None)
    if sink is not None:
        return sink
    base = w._base
    if base is None or not (base.is_contiguous() and w.is_contiguous()) or base.numel() != w.numel() \
            or base.data_ptr() != w.data_ptr():
        return None
    sink = getattr(base, "main_grad_sink", None)
    return _ViewedSink(sink, w.shape) if sink is not None else None
