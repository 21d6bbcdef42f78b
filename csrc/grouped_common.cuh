// Device helpers shared by the grouped GEMMs (bf16 and FP8): reading group boundaries from
// the int32 offsets without a host sync, and zeroing the output no GEMM tile writes.
//
// Group i covers rows [start_i, end_i) with end_i = offsets[i] clamped to [start_i, rows]
// and start_i = end_{i-1}: exactly the loop reference's reading, so even decreasing offsets
// stay in bounds and never make two groups overlap (they read as empty groups).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cute/tensor.hpp>

namespace tessera {

__device__ __forceinline__ int64_t clamped_offset(const int32_t* offsets, int i, int64_t rows) {
  int64_t v = offsets[i];
  return v < 0 ? 0 : (v > rows ? rows : v);
}

// Calls fn(i, start, end) for every group i; to be run by the 32 lanes of one warp (a
// running-max scan over chunks of 32 groups, so any number of groups works).
template <class Fn>
__device__ void for_each_group(const int32_t* offsets, int groups, int64_t rows, Fn&& fn) {
  const int lane = threadIdx.x % 32;
  int64_t carry = 0;  // end of the previous chunk's last group
  for (int base = 0; base < groups; base += 32) {
    const int i = base + lane;
    int64_t end = i < groups ? clamped_offset(offsets, i, rows) : 0;
    for (int delta = 1; delta < 32; delta <<= 1) {
      int64_t other = __shfl_up_sync(0xffffffffu, end, delta);
      if (lane >= delta && other > end) end = other;
    }
    if (carry > end) end = carry;
    int64_t start = __shfl_up_sync(0xffffffffu, end, 1);
    if (lane == 0) start = carry;
    carry = __shfl_sync(0xffffffffu, end, 31);
    if (i < groups) fn(i, start, end);
  }
}

// Zero-fill `bytes` (a multiple of 16) at 16-byte aligned `out`, spread over `workers` threads.
__device__ __forceinline__ void zero_fill(void* out, int64_t bytes, int64_t worker, int64_t workers) {
  uint4* p = static_cast<uint4*>(out);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t j = worker; j < bytes / 16; j += workers) p[j] = zero;
}

// Rows [end of last group, rows) of a row-major [rows, n] output of `elem` bytes per value.
__device__ inline void zero_rows_past_groups(void* d, const int32_t* offsets, int groups, int64_t rows,
                                             int64_t n, int elem, int64_t worker, int64_t workers) {
  int64_t last = 0;
  for (int i = 0; i < groups; ++i) last = max(last, clamped_offset(offsets, i, rows));
  zero_fill(static_cast<char*>(d) + last * n * elem, (rows - last) * n * elem, worker, workers);
}

// d[g] ([m, n] values of `elem` bytes each) for every empty group g.
__device__ inline void zero_empty_groups(void* d, const int32_t* offsets, int groups, int64_t rows, int64_t m,
                                         int64_t n, int elem, int64_t worker, int64_t workers) {
  int64_t running = 0;
  for (int i = 0; i < groups; ++i) {
    const int64_t end = clamped_offset(offsets, i, rows);
    if (end > running) {
      running = end;
      continue;
    }
    zero_fill(static_cast<char*>(d) + i * m * n * elem, m * n * elem, worker, workers);
  }
}

// A packed 2-D cute stride with leading dimension `ld`: whichever mode is not the static 1.
template <class Stride>
__device__ Stride leading_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<decltype(cute::get<0>(s))>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// The epilogue's C operand: `ptr_c` / `stride_c` when the kernel reads its output back (an fp32
// main grad it adds to), else none. A template, so that the branch not taken is never
// instantiated for epilogues whose C type is void.
template <bool kWithSource, class EpilogueArgs, class PtrC, class StrideC>
void set_epilogue_source(EpilogueArgs& epilogue, PtrC ptr_c, StrideC stride_c) {
  if constexpr (kWithSource) {
    epilogue.ptr_C = ptr_c;
    epilogue.dC = stride_c;
  } else {
    epilogue.ptr_C = nullptr;
  }
}

constexpr int kZeroBlocks = 64;  // blocks of a prepare kernel that zero-fill; idle ones exit at once

}  // namespace tessera
