/* C ABI of libtessera_kernels.so: CUTLASS kernels for Hopper (sm_90a), callable without torch.
 *
 * Every pointer is a raw device pointer; `stream` is a cudaStream_t (0: legacy default
 * stream). Functions return 0 on success or a TESSERA_ERR_* code; tessera_last_error()
 * then says what went wrong (thread-local, valid until the next call on that thread).
 * No function synchronises the host or allocates memory: scratch space comes from the
 * caller (`workspace`, at least the size the matching *_workspace function reports), so a
 * caching allocator and CUDA graph capture see every allocation.
 */
#ifndef TESSERA_KERNELS_H
#define TESSERA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define TESSERA_API __attribute__((visibility("default")))
#else
#define TESSERA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define TESSERA_ABI_VERSION 1

enum {
  TESSERA_OK = 0,
  TESSERA_ERR_INVALID = 1,     /* bad argument: shape, alignment, null pointer, unknown op/config */
  TESSERA_ERR_WORKSPACE = 2,   /* workspace smaller than required */
  TESSERA_ERR_UNSUPPORTED = 3, /* device or kernel variant not available in this build */
  TESSERA_ERR_CUDA = 4,        /* a CUDA runtime call failed */
  TESSERA_ERR_CUTLASS = 5      /* CUTLASS refused or failed */
};

/* Grouped GEMM operations. Rows of `a` are grouped: offsets[g] (int32, device, cumulative,
 * non-decreasing) is the end row of group g; group g is rows [offsets[g-1], offsets[g]).
 *   GG_FWD:    a [rows, k] row-major, b [G, k, n]   -> d [rows, n], d_g = a_g @ b[g]
 *   GG_FWD_BT: a [rows, k] row-major, b [G, n, k]   -> d [rows, n], d_g = a_g @ b[g]^T
 *   GG_WGRAD:  a [rows, k], b [rows, n] row-major   -> d [G, k, n], d[g] = a_g^T @ b_g
 * Rows of d past offsets[G-1] (GG_FWD*) and d[g] of empty groups (GG_WGRAD) are zeroed. */
enum { TESSERA_GG_FWD = 0, TESSERA_GG_FWD_BT = 1, TESSERA_GG_WGRAD = 2, TESSERA_GG_NUM_OPS = 3 };

TESSERA_API int tessera_abi_version(void);
TESSERA_API const char* tessera_last_error(void);
/* Device compute capability as major*10+minor, or -1 (with last_error) when no device. */
TESSERA_API int tessera_device_capability(int device);

/* One more than the highest bf16 grouped GEMM configuration index built into this library
 * (a build may leave some out: see build.sh TESSERA_GG_CONFIGS). */
TESSERA_API int tessera_gg_bf16_num_configs(void);
/* Name of configuration `config` (tile, schedule, cluster), or NULL if not built. */
TESSERA_API const char* tessera_gg_bf16_config_name(int config);

/* Bytes of workspace tessera_gg_bf16 needs for `num_groups` groups on `device`. */
TESSERA_API int tessera_gg_bf16_workspace(int op, int config, int num_groups, int device,
                                          size_t* bytes);

/* bf16 inputs, fp32 accumulation, bf16 output. k and n must be multiples of 8 and every
 * pointer 16-byte aligned (TMA). `device` is the CUDA device of all pointers and of
 * `stream` (made current for the call). raster: 0 along M, 1 along N; swizzle: 1, 2, 4, 8. */
TESSERA_API int tessera_gg_bf16(int op, int config, const void* a, const void* b, void* d,
                                const int32_t* offsets, int num_groups, int64_t rows, int64_t k,
                                int64_t n, void* workspace, size_t workspace_bytes, int device,
                                void* stream, int raster, int swizzle);

/* FP8 (float8_e4m3) quantisation of bf16 tensors: q = round_sat(x * 448 / amax) per block,
 * with fp32 dequantisation scales amax / 448 (1 for an all-zero block), so x ~= q * scale.
 * x and q 16-byte aligned; cols a multiple of 8 (16 for a transposed 128x128 output). */

/* One scale. `scale` holds 2 floats: [0] the scale, [1] the amax (also a scratch slot). */
TESSERA_API int tessera_fp8_quantize_tensorwise(const void* x, void* q, float* scale, int64_t numel,
                                                int device, void* stream);
/* x [rows, cols] -> q [rows, cols], scale [rows]. */
TESSERA_API int tessera_fp8_quantize_rowwise(const void* x, void* q, float* scale, int64_t rows,
                                             int64_t cols, int device, void* stream);
/* x [rows, cols] -> q [rows, cols] with one scale per row and 128 columns, stored M-major as
 * the blockwise GEMMs read them: offsets NULL -> scale[kb * rows + r]; with int32 offsets
 * (num_groups cumulative non-decreasing group ends) -> for row r of group g = [s, e):
 * scale[s * KB + kb * (e - s) + (r - s)], KB = ceil(cols / 128). Rows past the last group
 * get no scale. */
TESSERA_API int tessera_fp8_quantize_1x128(const void* x, void* q, float* scale, int64_t rows,
                                           int64_t cols, const int32_t* offsets, int num_groups,
                                           int device, void* stream);
/* x [batch, rows, cols] -> one scale per 128x128 block. transpose == 0: q [batch, rows, cols]
 * (K = cols), scale [batch][ceil(cols/128)][ceil(rows/128)]; transpose != 0: q [batch, cols,
 * rows] (K = rows), scale [batch][ceil(rows/128)][ceil(cols/128)]. Either way q is K-major
 * and scale is [K blocks][N blocks], the layout the blockwise GEMMs take for B. */
TESSERA_API int tessera_fp8_quantize_128x128(const void* x, void* q, float* scale, int64_t batch,
                                             int64_t rows, int64_t cols, int transpose, int device,
                                             void* stream);

#ifdef __cplusplus
}
#endif

#endif /* TESSERA_KERNELS_H */
