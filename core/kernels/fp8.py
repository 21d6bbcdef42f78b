"""FP8 (float8_e4m3fn) quantisation and blockwise-scaled GEMMs as `torch.library` custom ops.

Quantisation (bf16 in; any float dtype on the fallback): per block, q = round(x * 448 / amax)
saturated to e4m3, with the fp32 dequantisation scale amax / 448 (1 for a block of zeros or of |x| < 1e-30), so
x ~= q * scale. Granularities:

- `quantize_tensorwise(x)` -> (q, scale [1]); `quantize_rowwise(x)` -> (q, scale [rows, 1]):
  the scales torch._scaled_mm / torch._scaled_grouped_mm take;
- `quantize_1x128(x, offsets=None)` -> (q, scale): one scale per row and 128 columns
  (activations), M-major as the blockwise GEMMs read it: [ceil(K/128), rows], or, with the
  MoE group offsets, each group's [ceil(K/128), rows_g] block one after another (flat);
  `quantize_1x128_t(x)` is quantize_1x128(x^T) without the bf16 transpose (wgrad's dy^T);
- `quantize_128x128(w, transpose=False)` -> (q, scale): one scale per 128x128 block of each
  [R, C] matrix (weights); q is K-major for the GEMM (K = C, or K = R with transpose, q then
  [..., C, R]) and scale [..., K/128, N/128].

GEMMs (fp32 accumulation, bf16 out): `gemm_blockwise(a, sfa, b, sfb)` = (a*sfa) @ (b*sfb)^T
with a [M, K], b [N, K]; `grouped_mm_blockwise(a, sfa, b, sfb, offsets)` the same per group
with b [G, N, K]: the MoE expert forward (b from w^T, transpose=True) and dgrad (b from w).

On an sm_90 GPU with libtessera_kernels.so these run the CUDA/CUTLASS kernels (bit-identical
quantisation: same fp32 arithmetic and rounding); elsewhere exact PyTorch fallbacks
(dequantise + fp32 matmul), reported once. No autograd: FP8 training recipes call these
explicitly in their own autograd functions.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch
from torch import Tensor

from core.kernels.grouped_gemm import _env_int, _odd_tile_count, grouped_mm_loop
from core.kernels.library import KernelLibrary, current_raw_stream, custom_op, kernel_library, report_once

E4M3_MAX = 448.0
# Blocks with a smaller amax quantise to zeros with scale 1 (as the kernels do): 448 / amax
# would overflow to inf below ~1.3e-36 and turn zeros into NaN.
MIN_AMAX = 1e-30
FP8 = torch.float8_e4m3fn
BLOCK = 128
FP8_CONFIG_ENV = "TESSERA_FP8_CONFIG"
FAMILY_FP8_GEMM, FAMILY_FP8_GG = 1, 2  # TESSERA_FAMILY_* in csrc/include/tessera_kernels.h


@contextlib.contextmanager
def forced_config(config: int):
    """Pin the FP8 kernel configuration (TESSERA_FP8_CONFIG) for a block: checks and benches."""
    saved = os.environ.get(FP8_CONFIG_ENV)
    os.environ[FP8_CONFIG_ENV] = str(config)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(FP8_CONFIG_ENV, None)
        else:
            os.environ[FP8_CONFIG_ENV] = saved


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


# ---------------------------------------------------------------------------------------
# Reference arithmetic (the fallbacks): the CUDA kernels compute exactly this.
# ---------------------------------------------------------------------------------------

def _quantize_blocks(x: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    """x float32 [..., n] with per-leading-index amax [...] -> (q e4m3, scale fp32)."""
    # Tensor-by-tensor divisions: torch turns `448 / t` and `t / 448` into multiplications by
    # a reciprocal, which round differently from the kernels' IEEE divisions.
    positive = amax >= MIN_AMAX
    top = torch.full_like(amax, E4M3_MAX)
    mult = torch.where(positive, top / amax, torch.ones_like(amax))
    q = (x * mult.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, torch.where(positive, amax / top, torch.ones_like(amax))


def _group_layout_index(rows: int, kb: int, offsets: Tensor) -> Tensor:
    """int64 [rows, kb]: where each (row, k block) scale lives in the grouped 1x128 layout.
    Rows past the last group form one more group after it."""
    ends = torch.cummax(offsets.long().clamp(0, rows), 0).values
    ends = torch.cat((ends, ends.new_full((1,), rows)))
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    r = torch.arange(rows, device=offsets.device)
    g = torch.searchsorted(ends, r, right=True).clamp_max(ends.shape[0] - 1)
    start, count = starts[g], ends[g] - starts[g]
    k = torch.arange(kb, device=offsets.device)
    return start[:, None] * kb + k[None, :] * count[:, None] + (r - start)[:, None]


def _ref_1x128(x: Tensor, offsets: Tensor | None) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    kb = _blocks(cols)
    padded = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - cols)).view(rows, kb, BLOCK)
    q, scale = _quantize_blocks(padded, padded.abs().amax(-1))  # scale [rows, kb]
    q = q.view(rows, kb * BLOCK)[:, :cols].contiguous()
    if offsets is None:
        return q, scale.t().contiguous()
    flat = torch.empty(rows * kb, dtype=torch.float32, device=x.device)
    flat[_group_layout_index(rows, kb, offsets).reshape(-1)] = scale.reshape(-1)
    return q, flat


def _ref_128x128(w: Tensor, transpose: bool) -> tuple[Tensor, Tensor]:
    batch, r, c = w.shape
    rb, cb = _blocks(r), _blocks(c)
    padded = torch.nn.functional.pad(w.float(), (0, cb * BLOCK - c, 0, rb * BLOCK - r))
    tiles = padded.view(batch, rb, BLOCK, cb, BLOCK).permute(0, 1, 3, 2, 4).reshape(batch, rb, cb, BLOCK * BLOCK)
    q, scale = _quantize_blocks(tiles, tiles.abs().amax(-1))  # scale [batch, rb, cb]
    q = q.view(batch, rb, cb, BLOCK, BLOCK).permute(0, 1, 3, 2, 4).reshape(batch, rb * BLOCK, cb * BLOCK)[:, :r, :c]
    if transpose:  # K = rows: q [batch, c, r], scale [batch, K blocks = rb, N blocks = cb]
        return q.transpose(1, 2).contiguous(), scale.contiguous()
    return q.contiguous(), scale.transpose(1, 2).contiguous()


def dequantize_1x128(q: Tensor, scale: Tensor, offsets: Tensor | None = None) -> Tensor:
    """float32 x ~= q * scale for the 1x128 layouts of `quantize_1x128`."""
    rows, cols = q.shape
    kb = _blocks(cols)
    if offsets is None:
        per_block = scale.t()
    else:
        per_block = scale.reshape(-1)[_group_layout_index(rows, kb, offsets)]
    return q.float() * per_block.repeat_interleave(BLOCK, dim=1)[:, :cols]


def dequantize_128x128(q: Tensor, scale: Tensor) -> Tensor:
    """float32 [..., N, K] ~= q * scale for a K-major q with scale [..., K/128, N/128]."""
    n, k = q.shape[-2:]
    per_elem = scale.transpose(-2, -1).repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return q.float() * per_elem[..., :n, :k]


# ---------------------------------------------------------------------------------------
# Library helpers.
# ---------------------------------------------------------------------------------------

def _fp8_lib(x: Tensor, what: str, ok: bool) -> KernelLibrary | None:
    """The library if it can run this call (`ok`: operands fit the kernel), else None (logged once)."""
    lib = kernel_library(x.device)
    if lib is None:
        if x.is_cuda:
            report_once(f"{what}: PyTorch fallback (library not usable on {x.device})")
        return None
    if not ok:
        report_once(f"{what}: PyTorch fallback (operands not contiguous, aligned or of supported dtype/sizes; "
                    "see core/kernels/fp8.py)")
        return None
    return lib


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _call(lib: KernelLibrary, name: str, *args) -> None:
    lib.check(getattr(lib, name)(*args), f"tessera_{name}")


def _device_stream(x: Tensor) -> tuple[int, int]:
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return index, current_raw_stream(index)


def _kernel_input(x: Tensor, align: int) -> bool:
    return (x.dtype == torch.bfloat16 and x.is_contiguous() and x.data_ptr() % 16 == 0
            and x.shape[-1] % align == 0 and x.numel() > 0)


# ---------------------------------------------------------------------------------------
# Quantisation ops.
# ---------------------------------------------------------------------------------------

@custom_op("fp8_quantize_tensorwise")
def _quantize_tensorwise(x: Tensor) -> tuple[Tensor, Tensor]:
    lib = _fp8_lib(x, "fp8_quantize_tensorwise", _kernel_input(x, 1) and x.numel() % 8 == 0)
    if lib is None:
        amax = x.float().abs().amax().reshape(1)
        q, scale = _quantize_blocks(x.float().reshape(1, -1), amax)
        return q.view(x.shape), torch.cat((scale, amax))
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(2, dtype=torch.float32, device=x.device)
    _call(lib, "fp8_quantize_tensorwise", x.data_ptr(), q.data_ptr(), scale.data_ptr(), x.numel(), *_device_stream(x))
    return q, scale


@_quantize_tensorwise.register_fake
def _(x):
    return torch.empty(x.shape, dtype=FP8, device=x.device), x.new_empty(2, dtype=torch.float32)


def quantize_tensorwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """(q e4m3 like x, scale fp32 [1]) with x ~= q * scale."""
    q, scale_amax = _quantize_tensorwise(x)
    return q, scale_amax[:1]


@custom_op("fp8_quantize_rowwise")
def _quantize_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    if x.dim() != 2:
        raise ValueError(f"quantize_rowwise needs x [rows, cols], got {list(x.shape)}")
    lib = _fp8_lib(x, "fp8_quantize_rowwise", _kernel_input(x, 8))
    if lib is None:
        return _quantize_blocks(x.float(), x.float().abs().amax(-1))
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _call(lib, "fp8_quantize_rowwise", x.data_ptr(), q.data_ptr(), scale.data_ptr(), x.shape[0], x.shape[1],
          *_device_stream(x))
    return q, scale


@_quantize_rowwise.register_fake
def _(x):
    return torch.empty(x.shape, dtype=FP8, device=x.device), x.new_empty(x.shape[0], dtype=torch.float32)


def quantize_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """(q e4m3 [rows, cols], scale fp32 [rows, 1]) with x ~= q * scale."""
    q, scale = _quantize_rowwise(x)
    return q, scale.unsqueeze(1)


def _check_offsets(offsets: Tensor | None, x: Tensor) -> None:
    if offsets is not None and (offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.device != x.device):
        raise ValueError(f"offsets must be int32 [G] on {x.device}, got {offsets.dtype} {list(offsets.shape)} "
                         f"on {offsets.device}")


@custom_op("fp8_quantize_1x128")
def quantize_1x128(x: Tensor, offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [rows, K] -> (q e4m3 [rows, K], scale): [ceil(K/128), rows], or flat in the grouped layout
    when MoE group `offsets` (int32 cumulative ends, non-decreasing) are given."""
    if x.dim() != 2:
        raise ValueError(f"quantize_1x128 needs x [rows, K], got {list(x.shape)}")
    _check_offsets(offsets, x)
    lib = _fp8_lib(x, "fp8_quantize_1x128", _kernel_input(x, 8))
    if lib is None:
        return _ref_1x128(x, offsets)
    rows, cols = x.shape
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    shape = (_blocks(cols), rows) if offsets is None else (rows * _blocks(cols),)
    scale = torch.empty(shape, dtype=torch.float32, device=x.device)
    _call(lib, "fp8_quantize_1x128", x.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, cols, _ptr(offsets),
          0 if offsets is None else offsets.shape[0], *_device_stream(x))
    return q, scale


@quantize_1x128.register_fake
def _(x, offsets=None):
    rows, cols = x.shape
    shape = (_blocks(cols), rows) if offsets is None else (rows * _blocks(cols),)
    return torch.empty(x.shape, dtype=FP8, device=x.device), x.new_empty(shape, dtype=torch.float32)


@custom_op("fp8_quantize_1x128_t")
def quantize_1x128_t(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [rows, cols] -> quantize_1x128(x^T) in one pass: (q e4m3 [cols, rows], scale
    [ceil(rows/128), cols]), without writing the bf16 transpose (the wgrad operand dy^T)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_1x128_t needs x [rows, cols], got {list(x.shape)}")
    lib = _fp8_lib(x, "fp8_quantize_1x128_t", _kernel_input(x, 8) and x.shape[0] % 16 == 0)
    if lib is None:
        return _ref_1x128(x.t(), None)
    rows, cols = x.shape
    q = torch.empty(cols, rows, dtype=FP8, device=x.device)
    scale = torch.empty(_blocks(rows), cols, dtype=torch.float32, device=x.device)
    _call(lib, "fp8_quantize_1x128_t", x.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, cols, *_device_stream(x))
    return q, scale


@quantize_1x128_t.register_fake
def _(x):
    rows, cols = x.shape
    return x.new_empty(cols, rows, dtype=FP8), x.new_empty(_blocks(rows), cols, dtype=torch.float32)


def _shape_128x128(w: Tensor, transpose: bool) -> tuple[list[int], list[int]]:
    *lead, r, c = w.shape
    k, n = (r, c) if transpose else (c, r)
    return [*lead, n, k], [*lead, _blocks(k), _blocks(n)]


@custom_op("fp8_quantize_128x128")
def quantize_128x128(w: Tensor, transpose: bool = False) -> tuple[Tensor, Tensor]:
    """w [..., R, C] -> (q e4m3 K-major [..., N, K], scale [..., K/128, N/128]); K = C, or R with
    `transpose` (q is then w^T: [..., C, R]). For experts w [E, d, h]: transpose=True gives the
    forward operand, transpose=False the dgrad one."""
    if w.dim() not in (2, 3):
        raise ValueError(f"quantize_128x128 needs w [R, C] or [G, R, C], got {list(w.shape)}")
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    ok = _kernel_input(w, 16 if transpose else 8) and (not transpose or w.shape[-2] % 16 == 0)
    lib = _fp8_lib(w, "fp8_quantize_128x128", ok)
    if lib is None:
        q, scale = _ref_128x128(w3, transpose)
    else:
        q_shape, s_shape = _shape_128x128(w3, transpose)
        q = torch.empty(q_shape, dtype=FP8, device=w.device)
        scale = torch.empty(s_shape, dtype=torch.float32, device=w.device)
        _call(lib, "fp8_quantize_128x128", w.data_ptr(), q.data_ptr(), scale.data_ptr(), *w3.shape, int(transpose),
              *_device_stream(w))
    return (q, scale) if w.dim() == 3 else (q[0], scale[0])


@quantize_128x128.register_fake
def _(w, transpose=False):
    q_shape, s_shape = _shape_128x128(w, transpose)
    return torch.empty(q_shape, dtype=FP8, device=w.device), w.new_empty(s_shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# GEMM ops.
# ---------------------------------------------------------------------------------------

def _check_gemm(a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor, grouped: bool) -> None:
    want_b = 3 if grouped else 2
    if a.dim() != 2 or b.dim() != want_b or a.shape[1] != b.shape[-1]:
        raise ValueError(f"need a [M, K] and b {'[G, N, K]' if grouped else '[N, K]'}, "
                         f"got {list(a.shape)} and {list(b.shape)}")
    if a.dtype != FP8 or b.dtype != FP8 or sfa.dtype != torch.float32 or sfb.dtype != torch.float32:
        raise ValueError(f"need e4m3 a, b and fp32 scales, got {a.dtype}, {b.dtype}, {sfa.dtype}, {sfb.dtype}")
    kb, nb = _blocks(a.shape[1]), _blocks(b.shape[-2])
    sfa_ok = sfa.numel() == kb * a.shape[0] and (grouped or list(sfa.shape) == [kb, a.shape[0]])
    if not sfa_ok or list(sfb.shape[-2:]) != [kb, nb]:
        raise ValueError(f"scales {list(sfa.shape)}, {list(sfb.shape)} do not match a {list(a.shape)} "
                         f"and b {list(b.shape)}: want {kb * a.shape[0]} values and [..., {kb}, {nb}]")


def _choose_fp8_config(lib: KernelLibrary, family: int, rows_per_group: float, preferred: int = 0) -> int:
    """TESSERA_FP8_CONFIG if set, else `preferred` when built, else config 0 (the cooperative
    128x128x128 tile) when built, else the first built one.

    The cooperative tile beats the ping-pong one on every grouped shape, small groups included, so
    there is no small-group rule; config 2 (256x128x128) spills registers and is for experiments
    only. The grouped GEMMs prefer a cluster of two: see _fp8_gg_preferred. Figures:
    docs/performance-notes.md, "FP8 kernel configurations".
    rows_per_group is for shape rules to come."""
    names = lib.config_names(family)
    forced = _env_int(FP8_CONFIG_ENV, -1)
    if forced >= 0:
        if forced >= len(names) or names[forced] is None:
            raise ValueError(f"{FP8_CONFIG_ENV}={forced} is not built into {lib.path}")
        return forced
    for choice in (preferred, 0):
        if choice < len(names) and names[choice] is not None:
            return choice
    return next(i for i, name in enumerate(names) if name is not None)


# The FP8 grouped GEMMs' default: the 1x2 cluster (the two CTAs take neighbouring N tiles and share
# each activation tile by TMA multicast), ahead of the unclustered tile on every pass.
GG_PREFERRED_CONFIG = {"fp8_gg": 4, "fp8_gg_wgrad": 4}
# The grouped tile scheduler pads each group's tiles along the cluster's long side to an even count:
# where the output's N tiles are odd (1408 columns: 11 of 128) the 2x1 cluster pads nothing.
GG_ODD_N_TILES_CONFIG = 3


def _fp8_gg_preferred(entry: str, n: int) -> int:
    """The configuration an FP8 grouped call prefers: GG_ODD_N_TILES_CONFIG when its output's N
    tiles (128 wide) are odd, else the entry's GG_PREFERRED_CONFIG."""
    return GG_ODD_N_TILES_CONFIG if _odd_tile_count(n, BLOCK) else GG_PREFERRED_CONFIG[entry]


def _gemm_ready(a: Tensor, b: Tensor, *scales: Tensor) -> bool:
    return (all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (a, b)) and all(t.is_contiguous() for t in scales)
            and a.shape[1] % 16 == 0 and b.shape[-2] % 16 == 0 and a.shape[0] > 0)


def _workspace(lib: KernelLibrary, name: str, key: tuple, *args) -> int:
    size = lib._workspace.get(key)
    if size is None:
        out = ctypes.c_size_t(0)
        lib.check(getattr(lib, name)(*args, ctypes.byref(out)), f"tessera_{name}")
        size = lib._workspace[key] = out.value
    return size


# Neighbouring CTAs of the dense FP8 GEMM share A and B tiles in L2 at swizzle 8 (figures:
# docs/performance-notes.md, "Tile order").
DENSE_SWIZZLE = 8


@custom_op("fp8_gemm_blockwise")
def gemm_blockwise(a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor) -> Tensor:
    """bf16 [M, N] = (a * sfa) @ (b * sfb)^T; a [M, K] with 1x128 scales [K/128, M], b [N, K]
    with 128x128 scales [K/128, N/128]."""
    _check_gemm(a, sfa, b, sfb, grouped=False)
    # TMA loads the scales of a: rows of sfa ([K/128, M]) must be 16-byte aligned.
    ready = _gemm_ready(a, b, sfa, sfb) and a.shape[0] % 4 == 0 and sfa.data_ptr() % 16 == 0
    lib = _fp8_lib(a, "fp8_gemm_blockwise", ready)
    if lib is None:
        return (dequantize_1x128(a, sfa) @ dequantize_128x128(b, sfb).t()).to(torch.bfloat16)
    m, k = a.shape
    n = b.shape[0]
    config = _choose_fp8_config(lib, FAMILY_FP8_GEMM, m)
    device, stream = _device_stream(a)
    ws = _workspace(lib, "fp8_gemm_workspace", ("fp8_gemm", config, m, n, k, device), config, m, n, k, device)
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=a.device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    _call(lib, "fp8_gemm", config, a.data_ptr(), sfa.data_ptr(), b.data_ptr(), sfb.data_ptr(), out.data_ptr(),
          m, n, k, workspace.data_ptr(), ws, device, stream, _env_int("TESSERA_GG_RASTER", 0),
          _env_int("TESSERA_GG_SWIZZLE", DENSE_SWIZZLE))
    return out


@gemm_blockwise.register_fake
def _(a, sfa, b, sfb):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)


@custom_op("fp8_grouped_mm_blockwise")
def grouped_mm_blockwise(a: Tensor, sfa: Tensor, b: Tensor, sfb: Tensor, offsets: Tensor) -> Tensor:
    """bf16 [rows, N]: rows of group g times (b[g] * sfb[g])^T; a [rows, K] with grouped 1x128
    scales (quantize_1x128(x, offsets)), b [G, N, K] with scales [G, K/128, N/128]."""
    _check_gemm(a, sfa, b, sfb, grouped=True)
    _check_offsets(offsets, a)
    if offsets.shape[0] != b.shape[0]:
        raise ValueError(f"offsets [{offsets.shape[0]}] must have one entry per group of b [{b.shape[0]}, ...]")
    lib = _fp8_lib(a, "fp8_grouped_mm_blockwise", _gemm_ready(a, b, sfa, sfb))
    if lib is None:
        a_deq = dequantize_1x128(a, sfa, offsets)
        return grouped_mm_loop(a_deq, dequantize_128x128(b, sfb).transpose(1, 2), offsets).to(torch.bfloat16)
    rows, k = a.shape
    groups, n = b.shape[0], b.shape[1]
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=a.device)
    return run_fp8_grouped(lib, "fp8_gg", (a, sfa, b, sfb), out, offsets, groups, (rows, n, k), rows / groups)


def run_fp8_grouped(lib: KernelLibrary, entry: str, operands: tuple, out: Tensor, index: Tensor, groups: int,
                    sizes: tuple, rows_per_group: float, accumulate: bool | None = None) -> Tensor:
    """One call of the FP8 grouped kernel's C entry `entry` (M-grouped "fp8_gg", K-grouped
    "fp8_gg_wgrad", or "fp8_gg_wgrad_f32" into fp32 with `accumulate`): operands (a, sfa, b, sfb),
    the group index tensor, its three sizes."""
    into_f32 = entry == "fp8_gg_wgrad_f32"
    config = _choose_fp8_config(lib, FAMILY_FP8_GG, rows_per_group,
                                _fp8_gg_preferred("fp8_gg_wgrad" if into_f32 else entry, sizes[1]))
    device, stream = _device_stream(out)
    ws_entry = "fp8_gg_wgrad_f32_workspace" if into_f32 else "fp8_gg_workspace"
    ws = _workspace(lib, ws_entry, (ws_entry, config, groups, device), config, groups, device)
    workspace = torch.empty(ws, dtype=torch.uint8, device=out.device)
    flag = (int(accumulate),) if into_f32 else ()
    _call(lib, entry, config, *(t.data_ptr() for t in operands), out.data_ptr(), index.data_ptr(), groups, *sizes,
          *flag, workspace.data_ptr(), ws, device, stream, _env_int("TESSERA_GG_RASTER", 0),
          _env_int("TESSERA_GG_SWIZZLE", 1))
    return out


@grouped_mm_blockwise.register_fake
def _(a, sfa, b, sfb, offsets):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
