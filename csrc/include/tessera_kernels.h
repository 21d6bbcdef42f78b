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

#include "tessera_codes.h"

#if defined(__GNUC__)
#define TESSERA_API __attribute__((visibility("default")))
#else
#define TESSERA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

TESSERA_API int tessera_abi_version(void);
TESSERA_API const char* tessera_last_error(void);
/* Device compute capability as major*10+minor, or -1 (with last_error) when no device. */
TESSERA_API int tessera_device_capability(int device);

/* One more than the highest configuration index of `family` built into this library (a
 * build may leave some out: see build.sh TESSERA_GG_CONFIGS / TESSERA_FP8_CONFIGS). */
TESSERA_API int tessera_num_configs(int family);
/* Name of configuration `config` of `family`, or NULL if not built. */
TESSERA_API const char* tessera_config_name(int family, int config);

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

/* TESSERA_GG_WGRAD_F32 (its own op index for tessera_gg_bf16_workspace): a, b bf16 as for
 * TESSERA_GG_WGRAD, d fp32 [G, k, n]; accumulate = 0 overwrites d (empty groups zeroed),
 * 1 adds to it (fp32 accumulator + d, one rounding to fp32; empty groups left as they are). */
TESSERA_API int tessera_gg_bf16_wgrad_f32(int config, const void* a, const void* b, float* d,
                                          const int32_t* offsets, int num_groups, int64_t rows,
                                          int64_t k, int64_t n, int accumulate, void* workspace,
                                          size_t workspace_bytes, int device, void* stream,
                                          int raster, int swizzle);

/* FP8 (e4m3) GEMMs with blockwise scales, fp32 accumulation, bf16 output (CUTLASS sm90a).
 * a: e4m3 row-major [rows, k] with 1x128 scales sfa (fp32, M-major: see
 * tessera_fp8_quantize_1x128); b: e4m3 K-major [n, k] (per group [G, n, k]) with 128x128
 * scales sfb [ceil(k/128)][ceil(n/128)] (per group, one after another); d: bf16 [rows, n].
 * k and n multiples of 16, pointers 16-byte aligned; raster/swizzle as for tessera_gg_bf16. */
TESSERA_API int tessera_fp8_gemm_workspace(int config, int64_t m, int64_t n, int64_t k, int device,
                                           size_t* bytes);
/* d = (a * sfa) @ (b * sfb)^T; sfa is [ceil(k/128)][m], m a multiple of 4 and sfa 16-byte
 * aligned (its rows are loaded with TMA). */
TESSERA_API int tessera_fp8_gemm(int config, const void* a, const float* sfa, const void* b,
                                 const float* sfb, void* d, int64_t m, int64_t n, int64_t k,
                                 void* workspace, size_t workspace_bytes, int device, void* stream,
                                 int raster, int swizzle);
TESSERA_API int tessera_fp8_gg_workspace(int config, int num_groups, int device, size_t* bytes);
/* Grouped: rows of a grouped by offsets as in tessera_gg_bf16, sfa in the grouped layout
 * of tessera_fp8_quantize_1x128; d_g = (a_g * sfa_g) @ (b[g] * sfb[g])^T, rows past the last
 * group zeroed. */
TESSERA_API int tessera_fp8_gg(int config, const void* a, const float* sfa, const void* b,
                               const float* sfb, void* d, const int32_t* offsets, int num_groups,
                               int64_t rows, int64_t n, int64_t k, void* workspace,
                               size_t workspace_bytes, int device, void* stream, int raster,
                               int swizzle);

/* Grouped along K (the experts' weight gradient): d[g] [m, n] = (a * sfa) @ (b * sfb)^T over
 * the K columns [128 * block_starts[g], 128 * block_starts[g + 1]) only; a [m, kp] and b [n, kp]
 * e4m3 K-major with the scales of tessera_fp8_quantize_grouped_t (sfa 1x128: [kp/128][m];
 * sfb 128x128: [kp/128][ceil(n/128)]). block_starts has num_groups + 1 int32 entries (clamped
 * to [0, kp/128]); an empty group's d[g] is zeroed. m a multiple of 4, kp of 128. The
 * workspace is tessera_fp8_gg_workspace's (the same kernel). */
TESSERA_API int tessera_fp8_gg_wgrad(int config, const void* a, const float* sfa, const void* b,
                                     const float* sfb, void* d, const int32_t* block_starts,
                                     int num_groups, int64_t m, int64_t n, int64_t kp, void* workspace,
                                     size_t workspace_bytes, int device, void* stream, int raster,
                                     int swizzle);
/* As tessera_fp8_gg_wgrad into fp32 d [G, m, n]: accumulate = 0 overwrites d (empty groups
 * zeroed), 1 adds to it (empty groups left as they are). Its own workspace query. */
TESSERA_API int tessera_fp8_gg_wgrad_f32_workspace(int config, int num_groups, int device, size_t* bytes);
TESSERA_API int tessera_fp8_gg_wgrad_f32(int config, const void* a, const float* sfa, const void* b,
                                         const float* sfb, float* d, const int32_t* block_starts,
                                         int num_groups, int64_t m, int64_t n, int64_t kp, int accumulate,
                                         void* workspace, size_t workspace_bytes, int device, void* stream,
                                         int raster, int swizzle);

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
 * scale[s * KB + kb * (e - s) + (r - s)], KB = ceil(cols / 128); rows past the last group
 * form one more group [offsets[G-1], rows). */
TESSERA_API int tessera_fp8_quantize_1x128(const void* x, void* q, float* scale, int64_t rows,
                                           int64_t cols, const int32_t* offsets, int num_groups,
                                           int device, void* stream);
/* x [rows, cols] -> q = x^T [cols, rows] with one scale per row of q (column of x) and 128
 * columns of q (rows of x): scale[kb * cols + c], kb = row / 128, the layout of
 * tessera_fp8_quantize_1x128 applied to x^T. rows a multiple of 16. */
TESSERA_API int tessera_fp8_quantize_1x128_t(const void* x, void* q, float* scale, int64_t rows,
                                             int64_t cols, int device, void* stream);
/* x [batch, rows, cols] -> one scale per 128x128 block. transpose == 0: q [batch, rows, cols]
 * (K = cols), scale [batch][ceil(cols/128)][ceil(rows/128)]; transpose != 0: q [batch, cols,
 * rows] (K = rows), scale [batch][ceil(rows/128)][ceil(cols/128)]. Either way q is K-major
 * and scale is [K blocks][N blocks], the layout the blockwise GEMMs take for B. */
/* x [rows, cols] -> q [cols, 128 * out_blocks]: x^T with each MoE group on its own run of
 * 128-row blocks, as the K-grouped wgrad reads it. Group g = x rows [row_starts[g],
 * row_starts[g + 1]) fills q's column blocks [block_starts[g], block_starts[g + 1]) (the caller
 * makes that ceil(rows_g / 128) blocks), zero-padded at its end. per_column != 0: 1x128 scales
 * (one per column of x and 128-row block), scale [out_blocks][cols]; else 128x128 scales,
 * scale [out_blocks][ceil(cols/128)]. Blocks from block_starts[num_groups] on are not written. */
TESSERA_API int tessera_fp8_quantize_grouped_t(const void* x, void* q, float* scale, int64_t rows,
                                               int64_t cols, const int32_t* row_starts,
                                               const int32_t* block_starts, int num_groups,
                                               int64_t out_blocks, int per_column, int device,
                                               void* stream);
TESSERA_API int tessera_fp8_quantize_128x128(const void* x, void* q, float* scale, int64_t batch,
                                             int64_t rows, int64_t cols, int transpose, int device,
                                             void* stream);

#ifdef __cplusplus
}
#endif

#endif /* TESSERA_KERNELS_H */
