"""Finds and loads `libtessera_kernels.so` (built from csrc/ by `bash csrc/build.sh`) with ctypes.

The library is plain C ABI over raw device pointers, independent of torch's C++ ABI, so the
same file works under any torch version. Lookup: the `TESSERA_KERNELS_LIB` environment
variable, else `csrc/build/libtessera_kernels.so` in this checkout. When it is missing, or the
GPU is not an sm_90 Hopper, `kernel_library(device)` returns None and the reason is logged once;
callers then use their PyTorch fallback.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "TESSERA_KERNELS_LIB"
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "csrc" / "build" / "libtessera_kernels.so"
ABI_VERSION = 5  # must equal TESSERA_ABI_VERSION in csrc/include/tessera_codes.h
BUILD_HINT = ("build it with `bash csrc/build.sh` (needs nvcc >= 12.3 and `pip install nvidia-cutlass`) "
              "or set TESSERA_KERNELS_LIB")

_c_int, _c_i64, _c_size, _c_ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_size_t, ctypes.c_void_p

_SCALED_GEMM = [_c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr]  # config, a, sfa, b, sfb, d
_TAIL = [_c_ptr, _c_size, _c_int, _c_ptr, _c_int, _c_int]  # workspace, bytes, device, stream, raster, swizzle

# (name, restype, argtypes) of every C function Python calls; must match the header.
_SIGNATURES = [
    ("tessera_abi_version", _c_int, []),
    ("tessera_last_error", ctypes.c_char_p, []),
    ("tessera_device_capability", _c_int, [_c_int]),
    ("tessera_num_configs", _c_int, [_c_int]),
    ("tessera_config_name", ctypes.c_char_p, [_c_int, _c_int]),
    ("tessera_gg_bf16_workspace", _c_int, [_c_int, _c_int, _c_int, _c_int, ctypes.POINTER(_c_size)]),
    ("tessera_gg_bf16", _c_int, [_c_int, _c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_i64, _c_i64, _c_i64,
                                 *_TAIL]),
    ("tessera_gg_bf16_wgrad_f32", _c_int, [_c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_i64, _c_i64, _c_i64,
                                           _c_int, *_TAIL]),
    ("tessera_fp8_gemm_workspace", _c_int, [_c_int, _c_i64, _c_i64, _c_i64, _c_int, ctypes.POINTER(_c_size)]),
    ("tessera_fp8_gemm", _c_int, [*_SCALED_GEMM, _c_i64, _c_i64, _c_i64, *_TAIL]),
    ("tessera_fp8_gg_workspace", _c_int, [_c_int, _c_int, _c_int, ctypes.POINTER(_c_size)]),
    ("tessera_fp8_gg", _c_int, [*_SCALED_GEMM, _c_ptr, _c_int, _c_i64, _c_i64, _c_i64, *_TAIL]),
    ("tessera_fp8_gg_wgrad", _c_int, [*_SCALED_GEMM, _c_ptr, _c_int, _c_i64, _c_i64, _c_i64, *_TAIL]),
    ("tessera_fp8_gg_wgrad_f32_workspace", _c_int, [_c_int, _c_int, _c_int, ctypes.POINTER(_c_size)]),
    ("tessera_fp8_gg_wgrad_f32", _c_int, [*_SCALED_GEMM, _c_ptr, _c_int, _c_i64, _c_i64, _c_i64, _c_int, *_TAIL]),
    ("tessera_fp8_quantize_tensorwise", _c_int, [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_int, _c_ptr]),
    ("tessera_fp8_quantize_rowwise", _c_int, [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_int, _c_ptr]),
    ("tessera_fp8_quantize_1x128", _c_int, [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_int, _c_int, _c_ptr]),
    ("tessera_fp8_quantize_1x128_t", _c_int, [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_int, _c_ptr]),
    ("tessera_fp8_quantize_grouped_t", _c_int, [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_int,
                                                _c_i64, _c_int, _c_int, _c_ptr]),
    ("tessera_fp8_quantize_128x128", _c_int, [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64, _c_int, _c_int,
                                              _c_ptr]),
]
FAMILY_GG_BF16 = 0  # TESSERA_FAMILY_GG_BF16


class KernelError(RuntimeError):
    """A kernel of libtessera_kernels.so returned an error code."""


class KernelLibrary:
    """The loaded library: typed ctypes functions plus `check(rc, what)` for their codes."""

    def __init__(self, path: Path):
        self.path = path
        self.cdll = ctypes.CDLL(str(path))
        for name, restype, argtypes in _SIGNATURES:
            try:
                fn = getattr(self.cdll, name)
            except AttributeError as exc:
                raise OSError(f"{path} lacks {name}: rebuild it with `bash csrc/build.sh`") from exc
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name.removeprefix("tessera_"), fn)
        if self.abi_version() != ABI_VERSION:
            raise OSError(f"{path} has C ABI version {self.abi_version()}, this code needs {ABI_VERSION}: rebuild it")
        self._workspace: dict[tuple, int] = {}
        self._config_names: dict[int, list[str | None]] = {}

    def error_message(self) -> str:
        return (self.last_error() or b"").decode(errors="replace")

    def check(self, rc: int, what: str) -> None:
        """Raise KernelError naming `what` and the library's message when rc != 0."""
        if rc != 0:
            raise KernelError(f"{what} failed (code {rc}): {self.error_message()}")

    def config_names(self, family: int) -> list[str | None]:
        """Names of a kernel family's configurations by index (None: not built); fixed per library."""
        names = self._config_names.get(family)
        if names is None:
            raw = [self.config_name(family, i) for i in range(self.num_configs(family))]
            names = self._config_names[family] = [n.decode() if n else None for n in raw]
        return names

    def gg_bf16_config_names(self) -> list[str | None]:
        """Names of the bf16 grouped GEMM configurations by index (None: not built)."""
        return self.config_names(FAMILY_GG_BF16)

    def gg_bf16_workspace_bytes(self, op: int, config: int, groups: int, device: int) -> int:
        """Workspace bytes of one grouped GEMM call (cached: a host query, no GPU work)."""
        key = (op, config, groups, device)
        size = self._workspace.get(key)
        if size is None:
            out = ctypes.c_size_t(0)
            rc = self.gg_bf16_workspace(op, config, groups, device, ctypes.byref(out))
            self.check(rc, "tessera_gg_bf16_workspace")
            size = self._workspace[key] = out.value
        return size


# Process-wide on purpose: a loaded library, a device's capability and the fallbacks already
# logged are facts about this process and machine, the same for every model and run in it.
_lock = threading.Lock()
_loaded: dict[str, KernelLibrary | None] = {}
_capability: dict[int, tuple[int, int]] = {}
_usable: dict[tuple[int, str | None], KernelLibrary | None] = {}
_reported: set[str] = set()


def report_once(message: str, level: int = logging.WARNING, logger: logging.Logger | None = None) -> None:
    """Log a message once per process, on `logger` (default: the kernels' own, with a prefix).

    Every fallback and every backend choice is reported once: visible, not noisy."""
    if message not in _reported:
        _reported.add(message)
        if logger is None:
            log.log(level, "tessera kernels: %s", message)
        else:
            logger.log(level, "%s", message)


def library_path() -> Path:
    """Where the library is looked for now (TESSERA_KERNELS_LIB or the default build path)."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else DEFAULT_PATH


def load_library() -> KernelLibrary | None:
    """The library at `library_path()`, loaded once; None (reason logged once) when absent or broken."""
    path = library_path()
    key = str(path)
    with _lock:
        if key not in _loaded:
            lib = None
            if not path.is_file():
                report_once(f"{path} not found: {BUILD_HINT}; using PyTorch fallbacks")
            else:
                try:
                    lib = KernelLibrary(path)
                except OSError as exc:
                    report_once(f"cannot load {path} ({exc}); {BUILD_HINT}; using PyTorch fallbacks")
            _loaded[key] = lib
        return _loaded[key]


def kernel_library(device: torch.device) -> KernelLibrary | None:
    """The library when it can run on `device` (a CUDA sm_90 GPU), else None with the reason logged once."""
    if device.type != "cuda":
        return None
    # Every FP8 linear asks ~10 times per step: answer from a dict (the full lookup builds a
    # Path and takes a lock, ~30 us a time on the H100 hosts). Keyed by the env var's value, so
    # pointing TESSERA_KERNELS_LIB elsewhere still takes effect.
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, os.environ.get(ENV_VAR))
    if key in _usable:
        return _usable[key]
    lib = _usable[key] = _kernel_library(index)
    return lib


def _kernel_library(index: int) -> KernelLibrary | None:
    lib = load_library()
    if lib is None:
        return None
    cap = _capability.get(index)
    if cap is None:
        cap = _capability[index] = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        report_once(f"GPU {index} is sm_{cap[0]}{cap[1]}, the library holds sm_90a code only; using PyTorch fallbacks")
        return None
    return lib


def plain_eager(args: tuple, differentiable: bool = False) -> bool:
    """True when a custom op's body may be called directly: eager mode (no dynamo, no
    dispatch or function modes) on plain tensors with data and, for an op with autograd, no gradient
    to record. The dispatcher round trip of a Python custom op costs 10-20 us per call, which
    adds up over the ~10 small ops of every FP8 linear."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or \
            torch._C._is_torch_function_mode_enabled():
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(type(t) in _PLAIN and not t.is_meta for t in tensors)  # meta: shapes from the fake impl


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def custom_op(name: str, differentiable: bool = False, mutates_args: tuple[str, ...] = ()):
    """Decorator: register fn as the custom op tessera::name (what torch.compile and autograd
    see) and return a caller that runs fn directly when `plain_eager` allows. A differentiable
    op called in eager mode on inputs that need gradients runs its registered autograd as an
    autograd.Function (`_eager_autograd`). The caller carries the op as `.op` and its
    `register_fake` / `register_autograd`."""

    def wrap(fn):
        op = torch.library.custom_op(f"tessera::{name}", fn, mutates_args=mutates_args)
        eager_function = []  # set by register_autograd

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if plain_eager(args, differentiable):
                return fn(*args, **kwargs)
            if eager_function and not kwargs and plain_eager(args):
                return eager_function[0].apply(*args)
            return op(*args, **kwargs)

        def register_autograd(backward, setup_context=None):
            op.register_autograd(backward, setup_context=setup_context)
            if differentiable:
                eager_function[:] = [_eager_autograd(name, fn, backward, setup_context)]

        call.op, call.register_fake, call.register_autograd = op, op.register_fake, register_autograd
        return call

    return wrap


def _eager_autograd(name: str, fn, backward, setup_context):
    """A custom op's registered autograd as an autograd.Function for eager calls: the same
    forward, context and backward, without the Python custom op's autograd and dispatch round
    trip, which took ~0.6 ms of each ~0.8 ms expert GEMM call in a cProfile of the MoE layer's
    forward (docs/performance-notes.md). Compiled graphs keep the custom op: dynamo traced an
    autograd.Function around these opaque kernels wrongly (docs/fp8.md)."""

    def forward(ctx, *args):
        out = fn(*args)
        if setup_context is not None:
            setup_context(ctx, args, out)
        return out

    return type(f"Eager_{name}", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    })


def current_raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device as an integer handle (cheaper than a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def reset_for_tests() -> None:
    """Forget loaded libraries and logged reasons (tests switch TESSERA_KERNELS_LIB)."""
    with _lock:
        _loaded.clear()
        _usable.clear()
        _reported.clear()
