"""Hopper kernels from csrc/ (CUTLASS) as `torch.library` custom ops with PyTorch fallbacks.

`grouped_mm(x, w, offsets)` and `grouped_mm_wgrad(x, dy, offsets)`: bf16 grouped GEMM for
MoE experts (autograd included). `core.kernels.fp8`: FP8 quantisers and blockwise-scaled
GEMMs. `library.kernel_library(device)` says whether the compiled
library (`bash csrc/build.sh`, or `TESSERA_KERNELS_LIB`) can run on a device.
"""

from core.kernels.grouped_gemm import grouped_mm, grouped_mm_loop, grouped_mm_wgrad, grouped_mm_wgrad_loop
from core.kernels.library import KernelError, kernel_library, load_library

__all__ = [
    "KernelError",
    "grouped_mm",
    "grouped_mm_loop",
    "grouped_mm_wgrad",
    "grouped_mm_wgrad_loop",
    "kernel_library",
    "load_library",
]
