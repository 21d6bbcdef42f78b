// The C ABI of libtessera_kernels.so (see include/tessera_kernels.h): argument checks,
// error reporting and dispatch to the kernel variants registered by the other files.
#include <atomic>
#include <cstdarg>
#include <cstdio>

#include "common.cuh"
#include "include/tessera_kernels.h"

namespace tessera {

namespace {
thread_local char g_last_error[1024] = "";
constexpr int kMaxDevices = 64;
std::atomic<int> g_sm_counts[kMaxDevices];  // 0: not queried yet
}  // namespace

int fail(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return code;
}

int sm_count(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;
  int count = g_sm_counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    g_sm_counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

DeviceGuard::DeviceGuard(int device) {
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    status = fail(TESSERA_ERR_CUDA, "cannot make CUDA device %d current: %s", device,
                  cudaGetErrorString(err));
    previous = -1;
  }
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (previous >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous)
    cudaSetDevice(previous);
}

Variant (&variant_table())[kNumFamilies][kMaxOps][kMaxConfigs] {
  static Variant table[kNumFamilies][kMaxOps][kMaxConfigs];
  return table;
}

}  // namespace tessera

using namespace tessera;

namespace {

const char* const kFamilyNames[kNumFamilies] = {"bf16 grouped GEMM", "fp8 blockwise GEMM", "fp8 blockwise grouped GEMM"};

const Variant* find_variant(int family, int op, int config) {
  if (family < 0 || family >= kNumFamilies) {
    fail(TESSERA_ERR_INVALID, "kernel family %d is not one of 0..%d", family, kNumFamilies - 1);
    return nullptr;
  }
  if (op < 0 || op >= kMaxOps) {
    fail(TESSERA_ERR_INVALID, "%s op %d is not valid", kFamilyNames[family], op);
    return nullptr;
  }
  if (config < 0 || config >= kMaxConfigs || !variant_table()[family][op][config].run) {
    fail(TESSERA_ERR_UNSUPPORTED, "%s op %d config %d is not built into this library (%d configs built)",
         kFamilyNames[family], op, config, tessera_num_configs(family));
    return nullptr;
  }
  return &variant_table()[family][op][config];
}

int query_workspace(int family, int op, int config, const GroupedArgs& sizes, size_t* bytes) {
  const Variant* v = find_variant(family, op, config);
  if (!v) return TESSERA_ERR_INVALID;
  if (!bytes) return fail(TESSERA_ERR_INVALID, "bytes must be non-null");
  int sms = sm_count(sizes.device);
  if (sms <= 0) return fail(TESSERA_ERR_CUDA, "cannot query the SM count of CUDA device %d", sizes.device);
  *bytes = v->workspace(sizes, sms);
  return TESSERA_OK;
}

// Shared checks of every GEMM call, then the launch under a device guard.
int launch(int family, const GroupedArgs& args, int config, int dim_align, const char* dims) {
  const Variant* v = find_variant(family, args.op, config);
  if (!v) return TESSERA_ERR_INVALID;
  if (args.groups <= 0) return fail(TESSERA_ERR_INVALID, "num_groups=%d must be > 0", args.groups);
  if (args.rows < 0 || args.k <= 0 || args.n <= 0 || args.rows > INT32_MAX || args.k > INT32_MAX ||
      args.n > INT32_MAX)
    return fail(TESSERA_ERR_INVALID, "sizes %s = %lld, %lld, %lld must be >= 0, > 0, > 0 and < 2^31", dims,
                (long long)args.rows, (long long)args.k, (long long)args.n);
  if (args.k % dim_align || args.n % dim_align)
    return fail(TESSERA_ERR_INVALID, "k=%lld and n=%lld must be multiples of %d (16-byte rows for TMA)",
                (long long)args.k, (long long)args.n, dim_align);
  if (!args.a || !args.b || !args.d)
    return fail(TESSERA_ERR_INVALID, "a null pointer among a, b, d");
  if (!aligned16(args.a) || !aligned16(args.b) || !aligned16(args.d))
    return fail(TESSERA_ERR_INVALID, "a, b and d must be 16-byte aligned (TMA)");
  if (args.raster != 0 && args.raster != 1)
    return fail(TESSERA_ERR_INVALID, "raster=%d must be 0 (along M) or 1 (along N)", args.raster);
  if (args.swizzle != 1 && args.swizzle != 2 && args.swizzle != 4 && args.swizzle != 8)
    return fail(TESSERA_ERR_INVALID, "swizzle=%d must be 1, 2, 4 or 8", args.swizzle);
  int sms = sm_count(args.device);
  if (sms <= 0) return fail(TESSERA_ERR_CUDA, "cannot query the SM count of CUDA device %d", args.device);
  size_t need = v->workspace(args, sms);
  if (need && (!args.workspace || args.workspace_bytes < need))
    return fail(TESSERA_ERR_WORKSPACE, "workspace of %zu bytes is smaller than the %zu required",
                args.workspace ? args.workspace_bytes : 0, need);
  DeviceGuard guard(args.device);
  if (guard.status) return guard.status;
  return v->run(args);
}

GroupedArgs sizes_only(int groups, int64_t rows, int64_t k, int64_t n, int device) {
  GroupedArgs a{};
  a.groups = groups;
  a.rows = rows;
  a.k = k;
  a.n = n;
  a.device = device;
  a.swizzle = 1;
  return a;
}

}  // namespace

extern "C" {

int tessera_abi_version(void) { return TESSERA_ABI_VERSION; }

const char* tessera_last_error(void) { return g_last_error; }

int tessera_device_capability(int device) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(TESSERA_ERR_CUDA, "no CUDA device %d: %s", device, cudaGetErrorString(err));
    return -1;
  }
  return major * 10 + minor;
}

int tessera_num_configs(int family) {
  if (family < 0 || family >= kNumFamilies) return 0;
  int n = 0;
  for (int op = 0; op < kMaxOps; ++op)
    for (int c = 0; c < kMaxConfigs; ++c)
      if (variant_table()[family][op][c].run && c + 1 > n) n = c + 1;
  return n;
}

const char* tessera_config_name(int family, int config) {
  if (family < 0 || family >= kNumFamilies || config < 0 || config >= kMaxConfigs) return nullptr;
  for (int op = 0; op < kMaxOps; ++op)
    if (variant_table()[family][op][config].name) return variant_table()[family][op][config].name;
  return nullptr;
}

int tessera_gg_bf16_workspace(int op, int config, int num_groups, int device, size_t* bytes) {
  if (num_groups <= 0) return fail(TESSERA_ERR_INVALID, "num_groups=%d must be > 0", num_groups);
  return query_workspace(kFamilyGroupedBf16, op, config, sizes_only(num_groups, 0, 0, 0, device), bytes);
}

int tessera_gg_bf16(int op, int config, const void* a, const void* b, void* d, const int32_t* offsets,
                    int num_groups, int64_t rows, int64_t k, int64_t n, void* workspace, size_t workspace_bytes,
                    int device, void* stream, int raster, int swizzle) {
  // wgrad_f32 takes tessera_gg_bf16_wgrad_f32 (fp32 d, accumulate)
  if (op < 0 || op >= TESSERA_GG_NUM_OPS || op == TESSERA_GG_WGRAD_F32)
    return fail(TESSERA_ERR_INVALID, "grouped GEMM op %d is not one of 0 (fwd), 1 (fwd_bt), 2 (wgrad), 4 (fwd_bt_t)",
                op);
  if (!offsets) return fail(TESSERA_ERR_INVALID, "offsets must be non-null");
  GroupedArgs args{op, a, b, d, offsets, num_groups, rows, k, n, workspace, workspace_bytes,
                   device, static_cast<cudaStream_t>(stream), raster, swizzle};
  return launch(kFamilyGroupedBf16, args, config, 8, "rows, k, n");
}

int tessera_gg_bf16_wgrad_f32(int config, const void* a, const void* b, float* d, const int32_t* offsets,
                              int num_groups, int64_t rows, int64_t k, int64_t n, int accumulate, void* workspace,
                              size_t workspace_bytes, int device, void* stream, int raster, int swizzle) {
  if (!offsets) return fail(TESSERA_ERR_INVALID, "offsets must be non-null");
  if (accumulate != 0 && accumulate != 1)
    return fail(TESSERA_ERR_INVALID, "accumulate=%d must be 0 (overwrite d) or 1 (add to d)", accumulate);
  GroupedArgs args{TESSERA_GG_WGRAD_F32, a, b, d, offsets, num_groups, rows, k, n, workspace, workspace_bytes,
                   device, static_cast<cudaStream_t>(stream), raster, swizzle};
  args.accumulate = accumulate;
  return launch(kFamilyGroupedBf16, args, config, 8, "rows, k, n");
}

int tessera_fp8_gemm_workspace(int config, int64_t m, int64_t n, int64_t k, int device, size_t* bytes) {
  return query_workspace(kFamilyFp8Gemm, 0, config, sizes_only(1, m, k, n, device), bytes);
}

int tessera_fp8_gemm(int config, const void* a, const float* sfa, const void* b, const float* sfb, void* d,
                     int64_t m, int64_t n, int64_t k, void* workspace, size_t workspace_bytes, int device,
                     void* stream, int raster, int swizzle) {
  if (!sfa || !sfb) return fail(TESSERA_ERR_INVALID, "scale pointers must be non-null");
  if (m <= 0 || m % 4 || reinterpret_cast<uintptr_t>(sfa) % 16)
    return fail(TESSERA_ERR_INVALID, "m=%lld must be a positive multiple of 4 and sfa 16-byte aligned (TMA loads "
                "the 1x128 scales of a)", (long long)m);
  GroupedArgs args{0, a, b, d, nullptr, 1, m, k, n, workspace, workspace_bytes,
                   device, static_cast<cudaStream_t>(stream), raster, swizzle, sfa, sfb};
  return launch(kFamilyFp8Gemm, args, config, 16, "m, k, n");
}

int tessera_fp8_gg_workspace(int config, int num_groups, int device, size_t* bytes) {
  if (num_groups <= 0) return fail(TESSERA_ERR_INVALID, "num_groups=%d must be > 0", num_groups);
  return query_workspace(kFamilyFp8Grouped, 0, config, sizes_only(num_groups, 0, 0, 0, device), bytes);
}

int tessera_fp8_gg(int config, const void* a, const float* sfa, const void* b, const float* sfb, void* d,
                   const int32_t* offsets, int num_groups, int64_t rows, int64_t n, int64_t k, void* workspace,
                   size_t workspace_bytes, int device, void* stream, int raster, int swizzle) {
  if (!sfa || !sfb || !offsets) return fail(TESSERA_ERR_INVALID, "scale and offsets pointers must be non-null");
  GroupedArgs args{0, a, b, d, offsets, num_groups, rows, k, n, workspace, workspace_bytes,
                   device, static_cast<cudaStream_t>(stream), raster, swizzle, sfa, sfb};
  return launch(kFamilyFp8Grouped, args, config, 16, "rows, k, n");
}

int tessera_fp8_gg_wgrad(int config, const void* a, const float* sfa, const void* b, const float* sfb, void* d,
                         const int32_t* block_starts, int num_groups, int64_t m, int64_t n, int64_t kp,
                         void* workspace, size_t workspace_bytes, int device, void* stream, int raster,
                         int swizzle) {
  if (!sfa || !sfb || !block_starts)
    return fail(TESSERA_ERR_INVALID, "scale and block_starts pointers must be non-null");
  if (m <= 0 || m % 4 || kp <= 0 || kp % 128 || reinterpret_cast<uintptr_t>(sfa) % 16)
    return fail(TESSERA_ERR_INVALID, "m=%lld must be a positive multiple of 4, kp=%lld a positive multiple of 128 "
                "and sfa 16-byte aligned", (long long)m, (long long)kp);
  GroupedArgs args{1, a, b, d, block_starts, num_groups, m, kp, n, workspace, workspace_bytes,
                   device, static_cast<cudaStream_t>(stream), raster, swizzle, sfa, sfb};
  return launch(kFamilyFp8Grouped, args, config, 16, "m, kp, n");
}

int tessera_fp8_gg_wgrad_f32_workspace(int config, int num_groups, int device, size_t* bytes) {
  if (num_groups <= 0) return fail(TESSERA_ERR_INVALID, "num_groups=%d must be > 0", num_groups);
  return query_workspace(kFamilyFp8Grouped, 2, config, sizes_only(num_groups, 0, 0, 0, device), bytes);
}

int tessera_fp8_gg_wgrad_f32(int config, const void* a, const float* sfa, const void* b, const float* sfb, float* d,
                             const int32_t* block_starts, int num_groups, int64_t m, int64_t n, int64_t kp,
                             int accumulate, void* workspace, size_t workspace_bytes, int device, void* stream,
                             int raster, int swizzle) {
  if (!sfa || !sfb || !block_starts)
    return fail(TESSERA_ERR_INVALID, "scale and block_starts pointers must be non-null");
  if (m <= 0 || m % 4 || kp <= 0 || kp % 128 || reinterpret_cast<uintptr_t>(sfa) % 16)
    return fail(TESSERA_ERR_INVALID, "m=%lld must be a positive multiple of 4, kp=%lld a positive multiple of 128 "
                "and sfa 16-byte aligned", (long long)m, (long long)kp);
  if (accumulate != 0 && accumulate != 1)
    return fail(TESSERA_ERR_INVALID, "accumulate=%d must be 0 (overwrite d) or 1 (add to d)", accumulate);
  GroupedArgs args{2, a, b, d, block_starts, num_groups, m, kp, n, workspace, workspace_bytes,
                   device, static_cast<cudaStream_t>(stream), raster, swizzle, sfa, sfb};
  args.accumulate = accumulate;
  return launch(kFamilyFp8Grouped, args, config, 16, "m, kp, n");
}

}  // extern "C"
