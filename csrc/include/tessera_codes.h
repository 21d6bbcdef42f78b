/* Constants of the C ABI of libtessera_kernels.so (see tessera_kernels.h): version, error
 * codes, grouped GEMM operations, kernel families. Kept apart from the function declarations
 * so that the kernel sources depend on these alone. */
#ifndef TESSERA_CODES_H
#define TESSERA_CODES_H

#define TESSERA_ABI_VERSION 5

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
 *   GG_FWD_BT_T: as GG_FWD_BT, computed as d_g^T = b[g] @ a_g^T: n is the tiles' M and the
 *              group's rows their N, which pads nothing where n is a multiple of 128 but not of
 *              256 (the data gradient of a down projection of 1408 inputs)
 *   GG_WGRAD:  a [rows, k], b [rows, n] row-major   -> d [G, k, n], d[g] = a_g^T @ b_g
 *   GG_WGRAD_F32: as GG_WGRAD into fp32 d, which it overwrites or adds to (d[g] += a_g^T @ b_g):
 *              the weight gradient written straight into an fp32 main-grad buffer
 * Rows of d past offsets[G-1] (GG_FWD*) and d[g] of empty groups (GG_WGRAD*, when not adding)
 * are zeroed. */
enum {
  TESSERA_GG_FWD = 0,
  TESSERA_GG_FWD_BT = 1,
  TESSERA_GG_WGRAD = 2,
  TESSERA_GG_WGRAD_F32 = 3,
  TESSERA_GG_FWD_BT_T = 4,
  TESSERA_GG_NUM_OPS = 5
};

/* Kernel families; each has configurations (tile, cluster, schedule) chosen at run time. */
enum { TESSERA_FAMILY_GG_BF16 = 0, TESSERA_FAMILY_FP8_GEMM = 1, TESSERA_FAMILY_FP8_GG = 2 };

#endif /* TESSERA_CODES_H */
