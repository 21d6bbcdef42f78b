// Internal helpers shared by every translation unit of libtessera_kernels.so: error
// reporting through tessera_last_error(), device attributes cached per device, a device
// guard, workspace carving, and the registry that kernel variants add themselves to.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "include/tessera_kernels.h"

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

// Arguments of one grouped GEMM call after the C ABI checked them.
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
};

using GroupedRunFn = int (*)(const GroupedArgs&);
using GroupedWorkspaceFn = size_t (*)(int groups, int sm_count);

struct GroupedVariant {
  const char* name = nullptr;
  GroupedRunFn run = nullptr;
  GroupedWorkspaceFn workspace = nullptr;
};

constexpr int kMaxConfigs = 8;

// Table [op][config] of the bf16 grouped GEMM variants compiled into this library; each
// variant's translation unit fills its slot from a static initialiser at load time.
GroupedVariant (&gg_bf16_table())[TESSERA_GG_NUM_OPS][kMaxConfigs];

struct RegisterGroupedVariant {
  RegisterGroupedVariant(int op, int config, const char* name, GroupedRunFn run,
                         GroupedWorkspaceFn workspace) {
    gg_bf16_table()[op][config] = GroupedVariant{name, run, workspace};
  }
};

}  // namespace tessera

#define TESSERA_CUDA_TRY(expr)                                                              \
  do {                                                                                      \
    cudaError_t err_ = (expr);                                                              \
    if (err_ != cudaSuccess)                                                                \
      return ::tessera::fail(TESSERA_ERR_CUDA, "%s failed: %s", #expr, cudaGetErrorString(err_)); \
  } while (0)
