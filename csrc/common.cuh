// Internal helpers shared by every translation unit of libtessera_kernels.so: error
// reporting through tessera_last_error(), device attributes cached per device, a device
// guard, workspace carving, and the registry that kernel variants add themselves to.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "include/tessera_codes.h"

namespace tessera {

// Records a printf-style message for tessera_last_error() and returns `code`.
int fail(int code, const char* fmt, ...);

// Multiprocessor count of `device`, queried once per device (host call, no sync).
int sm_count(int device);

// Makes `device` current for the scope and restores the previous one; `status` is
// non-zero (with last_error set) when the switch failed.
struct DeviceGuard {
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  int status = TESSERA_OK;
  int previous = -1;
};

// Carves aligned sub-buffers out of the caller's workspace. With base == nullptr it only
// counts, so the same code computes the required size and the layout.
struct Carver {
  char* base;
  size_t used = 0;
  explicit Carver(void* b) : base(static_cast<char*>(b)) {}
  template <class T>
  T* take(size_t count, size_t align = 128) {
    used = (used + align - 1) / align * align;
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += count * sizeof(T);
    return p;
  }
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Arguments of one GEMM call after the C ABI checked them. Grouped GEMMs: a [rows, k],
// groups from `offsets`; the dense FP8 GEMM: m = rows, groups = 1, offsets unused.
struct GroupedArgs {
  int op;
  const void* a;
  const void* b;
  void* d;
  const int32_t* offsets;
  int groups;
  int64_t rows, k, n;
  void* workspace;
  size_t workspace_bytes;
  int device;
  cudaStream_t stream;
  int raster;   // 0 along M, 1 along N
  int swizzle;  // 1, 2, 4, 8
  const void* sfa = nullptr;  // FP8 blockwise scales of a and b
  const void* sfb = nullptr;
  int accumulate = 0;  // GG_WGRAD_F32: add to d instead of overwriting it
};

using RunFn = int (*)(const GroupedArgs&);
// Workspace bytes for the sizes in the arguments (pointers unused) on a GPU with `sms` SMs.
using WorkspaceFn = size_t (*)(const GroupedArgs&, int sms);

struct Variant {
  const char* name = nullptr;
  RunFn run = nullptr;
  WorkspaceFn workspace = nullptr;
};

constexpr int kMaxConfigs = 8;
constexpr int kMaxOps = 5;

// Kernel families, each with its own ops and configurations (TESSERA_FAMILY_* in the header).
enum Family { kFamilyGroupedBf16 = 0, kFamilyFp8Gemm = 1, kFamilyFp8Grouped = 2, kNumFamilies = 3 };

// Table [family][op][config] of the variants compiled into this library; each variant's
// translation unit fills its slot from a static initialiser when the library loads.
Variant (&variant_table())[kNumFamilies][kMaxOps][kMaxConfigs];

struct RegisterVariant {
  RegisterVariant(int family, int op, int config, const char* name, RunFn run, WorkspaceFn workspace) {
    variant_table()[family][op][config] = Variant{name, run, workspace};
  }
};

}  // namespace tessera

#define TESSERA_CUDA_TRY(expr)                                                              \
  do {                                                                                      \
    cudaError_t err_ = (expr);                                                              \
    if (err_ != cudaSuccess)                                                                \
      return ::tessera::fail(TESSERA_ERR_CUDA, "%s failed: %s", #expr, cudaGetErrorString(err_)); \
  } while (0)
