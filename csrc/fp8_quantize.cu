// bf16 -> float8_e4m3 quantisation with fp32 dequantisation scales (scale = amax / 448, so
// x ~= q * scale), in the four granularities the FP8 GEMMs and torch's scaled GEMMs take:
//   tensorwise:  one scale;                 amax kernel + quantise kernel (two passes)
//   rowwise:     one scale per row;         one block per row
//   1x128:       one scale per row and 128 columns (activations), scales M-major as the
//                CUTLASS blockwise GEMM reads them: [cols/128][rows], or per group
//                [cols/128][rows of group] one group after another when offsets are given
//   1x128 of x^T: the same for the transpose, written transposed in one pass (wgrad's dy^T),
//                optionally per MoE group with each group on fresh 128-row blocks (below)
//   128x128:     one scale per 128x128 block (weights), output K-major (optionally the
//                transpose of the input) with scales [K/128][N/128] per matrix
// All blocks of an all-zero input get scale 1 (q = 0). Values are multiplied by the fp32
// 448/amax and rounded to nearest with saturation, the same arithmetic as the PyTorch
// fallback in core/kernels/fp8.py, so both give identical bits.
#include <cuda_fp8.h>

#include "common.cuh"
#include "include/tessera_kernels.h"

namespace tessera::fp8 {
namespace {

constexpr float kE4M3Max = 448.0f;

__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ float amax8(const float (&v)[8]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
  return m;
}

// 8 values times `mult`, rounded to e4m3 with saturation, packed little-endian.
__device__ __forceinline__ uint2 quantize8(const float (&v)[8], float mult) {
  uint32_t word[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[4 * w] * mult, v[4 * w + 1] * mult),
                                           __NV_SATFINITE, __NV_E4M3);
    uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[4 * w + 2] * mult, v[4 * w + 3] * mult),
                                           __NV_SATFINITE, __NV_E4M3);
    word[w] = lo | (hi << 16);
  }
  return make_uint2(word[0], word[1]);
}

// Blocks whose amax is below kMinAmax quantise to zeros with scale 1, like all-zero blocks:
// 448 / amax overflows to inf for amax < ~1.3e-36, and 0 * inf would write NaN.
constexpr float kMinAmax = 1e-30f;
__device__ __forceinline__ float multiplier(float amax) { return amax >= kMinAmax ? kE4M3Max / amax : 1.0f; }
__device__ __forceinline__ float dequant_scale(float amax) { return amax >= kMinAmax ? amax / kE4M3Max : 1.0f; }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

// Max over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_max(float v) {
  __shared__ float partial[32];
  v = warp_max(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `partial` may still be read from a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
  return warp_max(v);
}

// ---- tensorwise -------------------------------------------------------------------------

// scale[1] holds the amax as its bit pattern: non-negative floats order like their bits.
__global__ void amax_kernel(const uint4* __restrict__ x, int64_t vecs, float* scale) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * blockDim.x) {
    float v[8];
    unpack(x[i], v);
    m = fmaxf(m, amax8(v));
  }
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(scale + 1), __float_as_uint(m));
}

__global__ void quantize_tensorwise_kernel(const uint4* __restrict__ x, uint2* __restrict__ q, int64_t vecs,
                                           float* scale) {
  const float amax = scale[1];
  const float mult = multiplier(amax);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * blockDim.x) {
    float v[8];
    unpack(x[i], v);
    q[i] = quantize8(v, mult);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[0] = dequant_scale(amax);
}

// ---- rowwise ----------------------------------------------------------------------------

// One block per row: amax over the row, then quantise it (the second read hits L1/L2).
__global__ void quantize_rowwise_kernel(const uint4* __restrict__ x, uint2* __restrict__ q, float* scale,
                                        int64_t vecs_per_row) {
  const int64_t row = blockIdx.x;
  const uint4* in = x + row * vecs_per_row;
  uint2* out = q + row * vecs_per_row;
  float m = 0.0f;
  for (int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
    float v[8];
    unpack(in[i], v);
    m = fmaxf(m, amax8(v));
  }
  m = block_max(m);
  const float mult = multiplier(m);
  for (int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
    float v[8];
    unpack(in[i], v);
    out[i] = quantize8(v, mult);
  }
  if (threadIdx.x == 0) scale[row] = dequant_scale(m);
}

// ---- 1x128 ------------------------------------------------------------------------------

__device__ __forceinline__ int64_t clamped_end(const int32_t* offsets, int g, int groups, int64_t rows) {
  if (g >= groups) return rows;
  const int64_t e = offsets[g];
  return e < 0 ? 0 : (e > rows ? rows : e);
}

// First g in [0, groups] with clamped_end(g) > row, searched by the 16 lanes of a half-warp
// together (lane `part`), 16-ary: one round of parallel loads per level, so 2 dependent loads
// for up to 256 groups instead of a binary search's 8. All 32 lanes of the warp must call it
// (the loop count depends on `groups` only); rows past the last group get `groups`.
__device__ __forceinline__ int group_of_row(const int32_t* offsets, int groups, int64_t rows, int64_t row,
                                           int part) {
  int lo = 0, span = groups + 1;  // candidates [lo, lo + span); the answer is always inside
  while (span > 1) {
    const int step = (span + 15) / 16;
    const int last = min(lo + (part + 1) * step, lo + span) - 1;  // last index of this lane's sub-range
    const bool below = lo + part * step < lo + span && clamped_end(offsets, last, groups, rows) <= row;
    const unsigned half = (__ballot_sync(0xffffffffu, below) >> (threadIdx.x & 16)) & 0xffffu;
    const int skip = __popc(half);  // the sub-ranges wholly at or below row: a prefix
    const int next = lo + skip * step;
    span = min(step, lo + span - next);
    lo = next;
  }
  return lo;
}

// 16 threads per 128-column chunk, 8 values each; chunks run along rows so loads coalesce.
__global__ void quantize_1x128_kernel(const uint4* __restrict__ x, uint2* __restrict__ q, float* scale,
                                      int64_t rows, int64_t cols) {
  const int64_t chunks_per_row = (cols + 127) / 128;
  const int64_t thread = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t chunk = thread / 16;
  const int part = thread % 16;
  if (chunk >= rows * chunks_per_row) return;  // whole 16-thread groups agree (hence half-warp shuffles)
  const int64_t row = chunk / chunks_per_row, kb = chunk % chunks_per_row;
  const int64_t col = kb * 128 + part * 8;
  const bool live = col < cols;
  const int64_t vec = (row * cols + col) / 8;
  float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (live) unpack(x[vec], v);
  float m = amax8(v);
#pragma unroll
  for (int d = 8; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffu << (threadIdx.x & 16), m, d));
  if (live) q[vec] = quantize8(v, multiplier(m));
  if (part == 0) scale[kb * rows + row] = dequant_scale(m);
}

// The grouped layout: a row's scales go to its group's [cols/128][rows of group] block, so
// every chunk needs its row's group. Searched per chunk, that search's loads and ballots held
// the kernel at half the ungrouped one's bandwidth. Here each block covers kGroupedRows rows,
// and each of its 16 slots (16 lanes each) walks the chunks slot, slot + 16, ... of that range
// in order: its rows only grow, so it searches for its first row's group once and then steps
// forward, reading one (broadcast) offset when a group ends. Four chunks' loads are in flight
// per lane.
constexpr int kGroupedRows = 32;
constexpr int kGroupedBatch = 4;

__global__ void __launch_bounds__(256) quantize_1x128_grouped_kernel(const uint4* __restrict__ x,
                                                                     uint2* __restrict__ q, float* scale,
                                                                     int64_t rows, int64_t cols,
                                                                     const int32_t* __restrict__ offsets,
                                                                     int groups) {
  const unsigned chunks_per_row = static_cast<unsigned>((cols + 127) / 128);
  const int64_t row0 = blockIdx.x * int64_t(kGroupedRows);
  // This block's chunks, numbered from its first row's first: [0, count), 32-bit arithmetic.
  const unsigned count = static_cast<unsigned>(min(rows - row0, int64_t(kGroupedRows))) * chunks_per_row;
  const int slot = threadIdx.x / 16, part = threadIdx.x % 16;
  const unsigned half = 0xffffu << (threadIdx.x & 16);  // this slot's lanes, for its shuffles
  // The first g with offsets[g] > row (offsets non-decreasing, clamped to [0, rows]); rows past
  // the last group form one more group after it. Every lane searches (the search's ballots).
  int g = group_of_row(offsets, groups, rows, min(row0 + slot / chunks_per_row, rows - 1), part);
  int64_t start = g ? clamped_end(offsets, g - 1, groups, rows) : 0;
  int64_t end = clamped_end(offsets, g, groups, rows);
  for (unsigned first = slot; first < count; first += 16 * kGroupedBatch) {
    uint4 raw[kGroupedBatch];
#pragma unroll
    for (int i = 0; i < kGroupedBatch; ++i) {
      const unsigned c = first + 16 * i;
      const int64_t row = row0 + c / chunks_per_row, col = int64_t(c % chunks_per_row) * 128 + part * 8;
      raw[i] = c < count && col < cols ? x[(row * cols + col) / 8] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kGroupedBatch; ++i) {
      const unsigned c = first + 16 * i;
      if (c >= count) break;  // the slot's 16 lanes agree
      const int64_t row = row0 + c / chunks_per_row, kb = c % chunks_per_row;
      const int64_t col = kb * 128 + part * 8;
      while (row >= end) {  // the slot's lanes agree; past the last group, end = rows
        ++g;
        start = end;
        end = clamped_end(offsets, g, groups, rows);
      }
      float v[8];
      unpack(raw[i], v);
      float m = amax8(v);
#pragma unroll
      for (int d = 8; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(half, m, d));
      if (col < cols) q[(row * cols + col) / 8] = quantize8(v, multiplier(m));
      if (part == 0) scale[start * chunks_per_row + kb * (end - start) + (row - start)] = dequant_scale(m);
    }
  }
}

// ---- 128x128 ----------------------------------------------------------------------------

// The largest g in [0, groups) with block_starts[g] <= rb (block_starts non-decreasing from
// 0, rb < block_starts[groups]; never an empty group), searched 32-ary by the lanes of a warp
// together: two rounds of loads for up to 1024 groups, where a binary search's 6-10 dependent
// loads held up every block's first load of x. All 32 lanes must call it.
__device__ __forceinline__ int group_of_block(const int32_t* block_starts, int groups, int64_t rb) {
  const int lane = threadIdx.x & 31;
  int lo = 0, span = groups;  // candidates [lo, lo + span)
  while (span > 1) {
    const int step = (span + 31) / 32;
    const int first = lo + lane * step;  // this lane's sub-range starts here
    const bool at_or_below = first < lo + span && block_starts[first] <= rb;
    const int take = __popc(__ballot_sync(0xffffffffu, at_or_below));  // a prefix of the lanes, >= 1
    const int next = lo + (take - 1) * step;
    span = min(step, lo + span - next);
    lo = next;
  }
  return lo;
}

// One block of 256 threads per 128x128 tile of one [rows, cols] matrix, K-major output as
// stored (K = cols); thread t covers columns (t % 16) * 8 .. +8 of rows t / 16 + 16 i, so a
// warp reads and writes two whole 256-byte row pieces per step.
// The tile stays in registers as raw bf16, as in the transposing kernel below (3 blocks per SM).
__global__ void __launch_bounds__(256, 3) quantize_128x128_kernel(const uint4* __restrict__ x,
                                                                  uint8_t* __restrict__ q, float* scale,
                                                                  int64_t rows, int64_t cols) {
  const int64_t batch = blockIdx.z;
  const int64_t rb = blockIdx.y, cb = blockIdx.x;
  const int64_t row_blocks = gridDim.y, col_blocks = gridDim.x;
  const int64_t matrix = rows * cols;
  const int cpart = threadIdx.x % 16, rpart = threadIdx.x / 16;
  const int64_t col = cb * 128 + cpart * 8;
  uint4 raw[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = rb * 128 + rpart + 16 * i;
    raw[i] = row < rows && col < cols ? x[(batch * matrix + row * cols + col) / 8] : make_uint4(0, 0, 0, 0);
  }
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v[8];
    unpack(raw[i], v);
    m = fmaxf(m, amax8(v));
  }
  m = block_max(m);
  const float mult = multiplier(m);
  if (threadIdx.x == 0) scale[batch * row_blocks * col_blocks + cb * row_blocks + rb] = dequant_scale(m);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = rb * 128 + rpart + 16 * i;
    float v[8];
    unpack(raw[i], v);
    if (row < rows && col < cols)
      reinterpret_cast<uint2*>(q)[(batch * matrix + row * cols + col) / 8] = quantize8(v, mult);
  }
}

// Quantise a 128x128 tile of x [rows, cols] and write it transposed (q [cols, rows], K = rows),
// with one scale per tile (kPerColumn false: 128x128 blocks, scale [K/128][N/128] per matrix)
// or one per column of x and 128 rows (kPerColumn true: 1x128 blocks of x^T, scale
// [rows/128][cols]). 128 threads a tile: thread t owns rows (t % 8) * 16 .. +16 and columns
// (t / 8) * 8 .. +8, so a column's 16 quantised bytes are contiguous in the transposed tile and
// 8 lanes store 128 contiguous bytes of one shared-memory row (no bank conflicts); the
// per-column amax is a reduction over those 8 lanes. rows % 16 == 0 (checked by the caller).
//
// With a block map (MoE expert groups, the K-grouped wgrad's operands): output column block rb
// of q [cols, out_ld] takes x rows [src, src + 128) of its group only: group g = the last with
// block_starts[g] <= rb, src = row_starts[g] + 128 * (rb - block_starts[g]), rows at or past
// row_starts[g + 1] read as zeros. So each group starts on a fresh 128-row block, as if
// quantised on its own. Blocks at or past block_starts[groups] are left unwritten.
//
// The tile stays in registers as raw bf16 (64 registers a thread). Its data takes as many
// registers as with 256 threads of 8 rows (the layout before), but each thread's other state
// is held by half as many threads, so 4-5 tiles share an SM instead of 3 and more loads are in
// flight (docs/fp8.md). Held to 5 blocks per SM the per-column kernel spills and slows down;
// the 128x128 one spills a few bytes and gains.
constexpr int kTRows = 16;
constexpr int kTRowGroups = 128 / kTRows;
constexpr int kTThreads = 16 * kTRowGroups;

template <bool kPerColumn>
__global__ void __launch_bounds__(kTThreads, kPerColumn ? 4 : 5) quantize_transposed_kernel(
    const uint4* __restrict__ x, uint8_t* __restrict__ q, float* scale, int64_t rows, int64_t cols, int64_t out_ld,
    const int32_t* __restrict__ row_starts, const int32_t* __restrict__ block_starts, int groups) {
  __shared__ __align__(16) uint8_t tile[128][128 + 16];
  const int64_t batch = blockIdx.z;
  const int64_t rb = blockIdx.y, cb = blockIdx.x;
  const int64_t matrix = rows * cols;
  int64_t src = rb * 128, src_end = rows;
  if (block_starts != nullptr) {
    if (rb >= block_starts[groups]) return;  // the whole block agrees: no barrier is skipped
    const int lo = group_of_block(block_starts, groups, rb);
    src = max(int64_t(row_starts[lo]), int64_t(0)) + 128 * (rb - block_starts[lo]);
    src_end = min(int64_t(row_starts[lo + 1]), rows);  // rows past it read as zeros
  }
  const int rgroup = threadIdx.x % kTRowGroups, cpart = threadIdx.x / kTRowGroups;
  const int64_t col = cb * 128 + cpart * 8;
  uint4 raw[kTRows];  // [row] x 8 columns of bf16
  auto value = [&](int i, int j) { return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&raw[i])[j]); };
  float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // per column
#pragma unroll
  for (int i = 0; i < kTRows; ++i) {
    const int64_t row = src + rgroup * kTRows + i;
    raw[i] = row < src_end && col < cols ? x[(batch * matrix + row * cols + col) / 8] : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kTRows; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) m[j] = fmaxf(m[j], fabsf(value(i, j)));
  }
  float mult[8];
  if constexpr (kPerColumn) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int d = 1; d < kTRowGroups; d <<= 1) m[j] = fmaxf(m[j], __shfl_xor_sync(0xffffffffu, m[j], d));  // over rgroup
      mult[j] = multiplier(m[j]);
    }
    if (rgroup == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (col + j < cols) scale[rb * cols + col + j] = dequant_scale(m[j]);
    }
  } else {
    float tile_max = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) tile_max = fmaxf(tile_max, m[j]);
    tile_max = block_max(tile_max);
#pragma unroll
    for (int j = 0; j < 8; ++j) mult[j] = multiplier(tile_max);
    if (threadIdx.x == 0) scale[batch * gridDim.y * gridDim.x + rb * gridDim.x + cb] = dequant_scale(tile_max);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint2 part[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float column[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) column[i] = value(8 * h + i, j);
      part[h] = quantize8(column, mult[j]);
    }
    uint8_t* at = &tile[cpart * 8 + j][rgroup * kTRows];
    // 16-byte stores: 8 lanes fill one 128-byte shared-memory row (no bank conflicts)
    *reinterpret_cast<uint4*>(at) = make_uint4(part[0].x, part[0].y, part[1].x, part[1].y);
  }
  __syncthreads();
  // Output rows are input columns; each thread stores 16 bytes (out_ld % 16 == 0).
#pragma unroll
  for (int i = 0; i < 1024 / kTThreads; ++i) {
    const int piece = threadIdx.x + kTThreads * i;  // 128 output rows x 8 pieces of 16 bytes
    const int out_r = piece / 8, out_c = (piece % 8) * 16;
    const int64_t orow = cb * 128 + out_r, ocol = rb * 128 + out_c;
    if (orow < cols && ocol < out_ld)
      *reinterpret_cast<uint4*>(q + batch * cols * out_ld + orow * out_ld + ocol) =
          *reinterpret_cast<const uint4*>(&tile[out_r][out_c]);
  }
}

int grid_for(int64_t work, int threads, int device) {
  const int64_t blocks = (work + threads - 1) / threads;
  const int64_t cap = int64_t(sm_count(device)) * 8;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

int check_common(const void* x, const void* q, const float* scale, int64_t cols, int align) {
  if (!x || !q || !scale) return fail(TESSERA_ERR_INVALID, "x, q and scale must be non-null");
  if (!aligned16(x) || !aligned16(q) || reinterpret_cast<uintptr_t>(scale) % 4)
    return fail(TESSERA_ERR_INVALID, "x and q must be 16-byte aligned, scale 4-byte aligned");
  if (cols <= 0 || cols % align)
    return fail(TESSERA_ERR_INVALID, "cols=%lld must be a positive multiple of %d", (long long)cols, align);
  return TESSERA_OK;
}

}  // namespace
}  // namespace tessera::fp8

using namespace tessera;
using namespace tessera::fp8;

extern "C" {

int tessera_fp8_quantize_tensorwise(const void* x, void* q, float* scale, int64_t numel, int device,
                                    void* stream) {
  if (int rc = check_common(x, q, scale, numel, 8)) return rc;
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t vecs = numel / 8;
  TESSERA_CUDA_TRY(cudaMemsetAsync(scale, 0, 2 * sizeof(float), s));
  amax_kernel<<<grid_for(vecs, 256, device), 256, 0, s>>>(static_cast<const uint4*>(x), vecs, scale);
  quantize_tensorwise_kernel<<<grid_for(vecs, 256, device), 256, 0, s>>>(
      static_cast<const uint4*>(x), static_cast<uint2*>(q), vecs, scale);
  TESSERA_CUDA_TRY(cudaGetLastError());
  return TESSERA_OK;
}

int tessera_fp8_quantize_rowwise(const void* x, void* q, float* scale, int64_t rows, int64_t cols, int device,
                                 void* stream) {
  if (int rc = check_common(x, q, scale, cols, 8)) return rc;
  if (rows <= 0 || rows > INT32_MAX) return fail(TESSERA_ERR_INVALID, "rows=%lld must be in [1, 2^31)", (long long)rows);
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  const int threads = cols >= 2048 ? 256 : 128;
  quantize_rowwise_kernel<<<static_cast<unsigned>(rows), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(x), static_cast<uint2*>(q), scale, cols / 8);
  TESSERA_CUDA_TRY(cudaGetLastError());
  return TESSERA_OK;
}

int tessera_fp8_quantize_1x128(const void* x, void* q, float* scale, int64_t rows, int64_t cols,
                               const int32_t* offsets, int num_groups, int device, void* stream) {
  if (int rc = check_common(x, q, scale, cols, 8)) return rc;
  if (rows <= 0) return fail(TESSERA_ERR_INVALID, "rows=%lld must be positive", (long long)rows);
  if (offsets && num_groups <= 0) return fail(TESSERA_ERR_INVALID, "num_groups=%d must be > 0", num_groups);
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  auto s = static_cast<cudaStream_t>(stream);
  if (offsets != nullptr) {
    const int64_t blocks = (rows + kGroupedRows - 1) / kGroupedRows;
    if (blocks > INT32_MAX) return fail(TESSERA_ERR_INVALID, "tensor too large (%lld blocks)", (long long)blocks);
    quantize_1x128_grouped_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(
        static_cast<const uint4*>(x), static_cast<uint2*>(q), scale, rows, cols, offsets, num_groups);
  } else {
    const int64_t threads = rows * ((cols + 127) / 128) * 16;
    const int64_t blocks = (threads + 255) / 256;
    if (blocks > INT32_MAX) return fail(TESSERA_ERR_INVALID, "tensor too large (%lld blocks)", (long long)blocks);
    quantize_1x128_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(static_cast<const uint4*>(x),
                                                                         static_cast<uint2*>(q), scale, rows, cols);
  }
  TESSERA_CUDA_TRY(cudaGetLastError());
  return TESSERA_OK;
}

int tessera_fp8_quantize_1x128_t(const void* x, void* q, float* scale, int64_t rows, int64_t cols, int device,
                                 void* stream) {
  if (int rc = check_common(x, q, scale, cols, 8)) return rc;
  if (rows <= 0 || rows % 16)
    return fail(TESSERA_ERR_INVALID, "rows=%lld must be a positive multiple of 16", (long long)rows);
  if ((rows + 127) / 128 > 65535) return fail(TESSERA_ERR_INVALID, "rows=%lld too large", (long long)rows);
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>((rows + 127) / 128));
  quantize_transposed_kernel<true><<<grid, kTThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(x), static_cast<uint8_t*>(q), scale, rows, cols, rows, nullptr, nullptr, 0);
  TESSERA_CUDA_TRY(cudaGetLastError());
  return TESSERA_OK;
}

int tessera_fp8_quantize_128x128(const void* x, void* q, float* scale, int64_t batch, int64_t rows, int64_t cols,
                                 int transpose, int device, void* stream) {
  if (int rc = check_common(x, q, scale, cols, transpose ? 16 : 8)) return rc;
  if (batch <= 0 || rows <= 0 || (transpose && rows % 16))
    return fail(TESSERA_ERR_INVALID, "batch=%lld rows=%lld must be positive (rows a multiple of 16 to transpose)",
                (long long)batch, (long long)rows);
  if (batch > 65535) return fail(TESSERA_ERR_INVALID, "batch=%lld exceeds 65535", (long long)batch);
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>((rows + 127) / 128),
            static_cast<unsigned>(batch));
  auto s = static_cast<cudaStream_t>(stream);
  if (transpose) {
    quantize_transposed_kernel<false><<<grid, kTThreads, 0, s>>>(static_cast<const uint4*>(x), static_cast<uint8_t*>(q),
                                                           scale, rows, cols, rows, nullptr, nullptr, 0);
  } else {
    quantize_128x128_kernel<<<grid, 256, 0, s>>>(static_cast<const uint4*>(x), static_cast<uint8_t*>(q), scale,
                                                 rows, cols);
  }
  TESSERA_CUDA_TRY(cudaGetLastError());
  return TESSERA_OK;
}

int tessera_fp8_quantize_grouped_t(const void* x, void* q, float* scale, int64_t rows, int64_t cols,
                                   const int32_t* row_starts, const int32_t* block_starts, int num_groups,
                                   int64_t out_blocks, int per_column, int device, void* stream) {
  if (int rc = check_common(x, q, scale, cols, 8)) return rc;
  if (!row_starts || !block_starts || num_groups <= 0)
    return fail(TESSERA_ERR_INVALID, "row_starts and block_starts must be non-null and num_groups=%d > 0", num_groups);
  if (rows <= 0 || out_blocks <= 0 || out_blocks > 65535)
    return fail(TESSERA_ERR_INVALID, "rows=%lld must be positive and out_blocks=%lld in [1, 65535]", (long long)rows,
                (long long)out_blocks);
  DeviceGuard guard(device);
  if (guard.status) return guard.status;
  dim3 grid(static_cast<unsigned>((cols + 127) / 128), static_cast<unsigned>(out_blocks));
  auto s = static_cast<cudaStream_t>(stream);
  auto in = static_cast<const uint4*>(x);
  auto out = static_cast<uint8_t*>(q);
  if (per_column) {
    quantize_transposed_kernel<true><<<grid, kTThreads, 0, s>>>(in, out, scale, rows, cols, out_blocks * 128, row_starts,
                                                          block_starts, num_groups);
  } else {
    quantize_transposed_kernel<false><<<grid, kTThreads, 0, s>>>(in, out, scale, rows, cols, out_blocks * 128, row_starts,
                                                           block_starts, num_groups);
  }
  TESSERA_CUDA_TRY(cudaGetLastError());
  return TESSERA_OK;
}

}  // extern "C"
