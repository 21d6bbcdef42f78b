// The C ABI of libtessera_kernels.so (see include/tessera_kernels.h): argument checks,
// error reporting and dispatch to the kernel variants registered by the other files.
#include <atomic>
#include <cstdarg>
#include <cstdio>

#include "common.cuh"

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

GroupedVariant (&gg_bf16_table())[TESSERA_GG_NUM_OPS][kMaxConfigs] {
  static GroupedVariant table[TESSERA_GG_NUM_OPS][kMaxConfigs];
  return table;
}

}  // namespace tessera

using namespace tessera;

namespace {

const GroupedVariant* find_variant(int op, int config) {
  if (op < 0 || op >= TESSERA_GG_NUM_OPS) {
    fail(TESSERA_ERR_INVALID, "grouped GEMM op %d is not one of 0 (fwd), 1 (fwd_bt), 2 (wgrad)", op);
    return nullptr;
  }
  if (config < 0 || config >= kMaxConfigs || !gg_bf16_table()[op][config].run) {
    fail(TESSERA_ERR_UNSUPPORTED, "grouped GEMM config %d is not built into this library (%d built)",
         config, tessera_gg_bf16_num_configs());
    return nullptr;
  }
  return &gg_bf16_table()[op][config];
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

int tessera_gg_bf16_num_configs(void) {
  int n = 0;
  for (int op = 0; op < TESSERA_GG_NUM_OPS; ++op)
    for (int c = 0; c < kMaxConfigs; ++c)
      if (gg_bf16_table()[op][c].run && c + 1 > n) n = c + 1;
  return n;
}

const char* tessera_gg_bf16_config_name(int config) {
  if (config < 0 || config >= kMaxConfigs) return nullptr;
  for (int op = 0; op < TESSERA_GG_NUM_OPS; ++op)
    if (gg_bf16_table()[op][config].name) return gg_bf16_table()[op][config].name;
  return nullptr;
}

int tessera_gg_bf16_workspace(int op, int config, int num_groups, int device, size_t* bytes) {
  const GroupedVariant* v = find_variant(op, config);
  if (!v) return TESSERA_ERR_INVALID;
  if (num_groups <= 0 || !bytes)
    return fail(TESSERA_ERR_INVALID, "num_groups=%d must be > 0 and bytes non-null", num_groups);
  int sms = sm_count(device);
  if (sms <= 0) return fail(TESSERA_ERR_CUDA, "cannot query the SM count of CUDA device %d", device);
  *bytes = v->workspace(num_groups, sms);
  return TESSERA_OK;
}

int tessera_gg_bf16(int op, int config, const void* a, const void* b, void* d,
                    const int32_t* offsets, int num_groups, int64_t rows, int64_t k, int64_t n,
                    void* workspace, size_t workspace_bytes, int device, void* stream,
                    int raster, int swizzle) {
  const GroupedVariant* v = find_variant(op, config);
  if (!v) return TESSERA_ERR_INVALID;
  if (num_groups <= 0) return fail(TESSERA_ERR_INVALID, "num_groups=%d must be > 0", num_groups);
  if (rows < 0 || k <= 0 || n <= 0 || rows > INT32_MAX || k > INT32_MAX || n > INT32_MAX)
    return fail(TESSERA_ERR_INVALID, "sizes rows=%lld k=%lld n=%lld must be >= 0, > 0, > 0 and < 2^31",
                (long long)rows, (long long)k, (long long)n);
  if (k % 8 || n % 8)
    return fail(TESSERA_ERR_INVALID, "k=%lld and n=%lld must be multiples of 8 (16-byte bf16 rows for TMA)",
                (long long)k, (long long)n);
  if (!a || !b || !d || !offsets || !workspace)
    return fail(TESSERA_ERR_INVALID, "a null pointer among a, b, d, offsets, workspace");
  if (!aligned16(a) || !aligned16(b) || !aligned16(d))
    return fail(TESSERA_ERR_INVALID, "a, b and d must be 16-byte aligned (TMA)");
  if (raster != 0 && raster != 1)
    return fail(TESSERA_ERR_INVALID, "raster=%d must be 0 (along M) or 1 (along N)", raster);
  if (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8)
    return fail(TESSERA_ERR_INVALID, "swizzle=%d must be 1, 2, 4 or 8", swizzle);
  int sms = sm_count(device);
  if (sms <= 0) return fail(TESSERA_ERR_CUDA, "cannot query the SM count of CUDA device %d", device);
  size_t need = v->workspace(num_groups, sms);
  if (workspace_bytes < need)
    return fail(TESSERA_ERR_WORKSPACE, "workspace of %zu bytes is smaller than the %zu required",
                workspace_bytes, need);
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  GroupedArgs args{op, a, b, d, offsets, num_groups, rows, k, n, workspace, workspace_bytes,
                   device, static_cast<cudaStream_t>(stream), raster, swizzle};
  return v->run(args);
}

}  // extern "C"
