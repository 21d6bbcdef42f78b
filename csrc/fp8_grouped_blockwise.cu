// FP8 (e4m3) grouped GEMM with blockwise scales for MoE experts: d_g [rows_g, N] bf16 =
// (a_g * SFA_g) (b[g] * SFB_g)^T with fp32 accumulation, on CUTLASS 3.x's ptr-array
// blockwise-scaled sm90a kernel. Covers the expert forward (b = w^T quantised with
// transpose) and dgrad (b = w quantised as stored); rows past the last group are zeroed.
//
// Layouts (what core/kernels/fp8.py's quantisers write):
//   a [rows, K] e4m3 row-major; SFA per group g = rows [s, e): [ceil(K/128)][e - s] fp32 at
//     SFA + s * ceil(K/128) (the kernel derives each group's scale layout from its M)
//   b [G, N, K] e4m3 K-major; SFB [G][ceil(K/128)][ceil(N/128)] fp32
// One translation unit per configuration: -DTESSERA_FP8_CONFIG=<index into Configs>. With
// -DTESSERA_FP8_WGRAD_F32=1 the unit holds op 2 instead: op 1 (K-grouped weight gradient) into
// an fp32 output that is also its C operand (overwrite with beta 0, add with beta 1), so the
// experts' gradient goes straight into the fp32 main grad (gradient-accumulation fusion).
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <tuple>

#include "common.cuh"
#include "grouped_common.cuh"

#ifndef TESSERA_FP8_CONFIG
#error "compile with -DTESSERA_FP8_CONFIG=<index into Configs>"
#endif
#ifndef TESSERA_FP8_WGRAD_F32
#define TESSERA_FP8_WGRAD_F32 0
#endif

namespace tessera::fp8_grouped {
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------
// Candidate configurations, selectable at run time (index = position in Configs).
// ---------------------------------------------------------------------------------------

// Two consumer warp groups on a 128x128 tile with 128-deep K tiles (one scale per tile).
// No cluster: MoE groups rarely fill an even number of tiles, and a cluster pads to one.
struct Coop128x128C1 {
  static const char* name() { return "coop_128x128x128_c1x1"; }
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Ping-pong on 64-row tiles: halves the padding of each group's last M tile (groups of a few
// hundred rows) and overlaps one warp group's promotion/epilogue with the other's WGMMAs.
struct Pingpong64x128C1 {
  static const char* name() { return "pingpong_64x128x128_c1x1"; }
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<_1, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Added after the first H100 measurements (index 2; 0 and 1 keep their meaning): twice the
// rows per tile, so each weight tile loaded serves 256 rows (half the B traffic per output).
// 256 x 128 rather than 128 x 256: with 1x128 activation scales, CUTLASS 4.2's sm90 blockwise
// mainloop only compiles one weight scale per tile along N (a 256-wide N tile fails its
// "Accumulator and scaleB must have same shape" static assert). Cost: each consumer thread
// holds 128 fp32 accumulators plus as many for the promotion. No cluster, as for config 0.
struct Coop256x128C1 {
  static const char* name() { return "coop_256x128x128_c1x1"; }
  using Tile = Shape<_256, _128, _128>;
  using Cluster = Shape<_1, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Config 0's tile in clusters of two CTAs that share the A (2x1) or the B (1x2) tile through TMA
// multicast, as the dense FP8 GEMM's default does. Tried first for the K-grouped wgrad (op 1,
// whose groups are whole weight matrices, so a cluster pads little), where it measured
// 0.90-1.10x config 0; the 1x2 cluster won on the forward and dgrad instead (1.01-1.41x on one
// H100) and is their default (core/kernels/fp8.py, GG_PREFERRED_CONFIG).
struct Coop128x128C2x1 {
  static const char* name() { return "coop_128x128x128_c2x1"; }
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_2, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

struct Coop128x128C1x2 {
  static const char* name() { return "coop_128x128x128_c1x2"; }
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

using Configs = std::tuple<Coop128x128C1, Pingpong64x128C1, Coop256x128C1, Coop128x128C2x1, Coop128x128C1x2>;
constexpr int kNumConfigs = 5;  // csrc/build.sh reads this line: which indices to build
static_assert(kNumConfigs == std::tuple_size_v<Configs>, "kNumConfigs must count Configs");
static_assert(TESSERA_FP8_CONFIG < std::tuple_size_v<Configs>, "TESSERA_FP8_CONFIG out of range");
using Config = std::tuple_element_t<TESSERA_FP8_CONFIG, Configs>;

constexpr bool kFp32Out = TESSERA_FP8_WGRAD_F32 != 0;
using ElementAB = cutlass::float_e4m3_t;
using ElementD = std::conditional_t<kFp32Out, float, cutlass::bfloat16_t>;
using ElementC = std::conditional_t<kFp32Out, float, void>;  // void: no C load at all
using Accumulator = float;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;  // b[g] stored [N, K]: K-major
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16;
constexpr int kAlignD = 16 / sizeof(ElementD);

using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
    typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, Accumulator,
    Accumulator, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
    typename Config::EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, Accumulator, ElementD>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB,
    Accumulator, typename Config::Tile, typename Config::Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    typename Config::Schedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;

struct GroupArrays {
  GroupShape* shapes;
  const ElementAB** ptr_a;
  const ElementAB** ptr_b;
  const float** ptr_sfa;
  const float** ptr_sfb;
  ElementD** ptr_d;
  const ElementD** ptr_c;  // the same addresses as ptr_d (fp32 output only)
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;  // required by the arguments; the kernel derives layouts from M, N, K
  LayoutSFB* layout_sfb;
  void* cutlass_workspace;
};

template <class C>
GroupArrays carve(C& c, int groups) {
  GroupArrays g;
  g.shapes = c.template take<GroupShape>(groups);
  g.ptr_a = c.template take<const ElementAB*>(groups);
  g.ptr_b = c.template take<const ElementAB*>(groups);
  g.ptr_sfa = c.template take<const float*>(groups);
  g.ptr_sfb = c.template take<const float*>(groups);
  g.ptr_d = c.template take<ElementD*>(groups);
  g.ptr_c = c.template take<const ElementD*>(kFp32Out ? groups : 0);
  g.stride_a = c.template take<StrideA>(groups);
  g.stride_b = c.template take<StrideB>(groups);
  g.stride_d = c.template take<StrideD>(groups);
  g.layout_sfa = c.template take<LayoutSFA>(groups);
  g.layout_sfb = c.template take<LayoutSFB>(groups);
  g.cutlass_workspace = c.template take<char>(0, 256);
  return g;
}

Gemm::Arguments make_arguments(const GroupArrays& g, int groups, int device, int sms, int raster, int swizzle,
                               bool accumulate) {
  Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{groups, g.shapes, nullptr};
  args.mainloop.ptr_A = g.ptr_a;
  args.mainloop.dA = g.stride_a;
  args.mainloop.ptr_B = g.ptr_b;
  args.mainloop.dB = g.stride_b;
  args.mainloop.ptr_SFA = g.ptr_sfa;
  args.mainloop.layout_SFA = g.layout_sfa;
  args.mainloop.ptr_SFB = g.ptr_sfb;
  args.mainloop.layout_SFB = g.layout_sfb;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = accumulate ? 1.0f : 0.0f;
  set_epilogue_source<kFp32Out>(args.epilogue, g.ptr_c, g.stride_d);  // C = the fp32 output itself
  args.epilogue.ptr_D = g.ptr_d;
  args.epilogue.dD = g.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sms;
  using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = raster ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = swizzle;
  return args;
}

size_t workspace_bytes(const GroupedArgs& p, int sms) {
  Carver counter(nullptr);
  GroupArrays g = carve(counter, p.groups);
  return counter.used + Gemm::get_workspace_size(make_arguments(g, p.groups, 0, sms, 0, 1, false));
}

// The GEMM over the per-group arrays that a prepare kernel wrote on the same stream.
int launch_gemm(const GroupArrays& g, const GroupedArgs& p, const char* what) {
  Gemm::Arguments args =
      make_arguments(g, p.groups, p.device, sm_count(p.device), p.raster, p.swizzle, p.accumulate != 0);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "%s %s: CUTLASS cannot implement (%s)", what, Config::name(),
                cutlassGetStatusString(status));
  status = gemm.initialize(args, g.cutlass_workspace, p.stream);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "%s %s: initialize failed (%s)", what, Config::name(),
                cutlassGetStatusString(status));
  status = gemm.run(p.stream);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "%s %s: launch failed (%s, %s)", what, Config::name(),
                cutlassGetStatusString(status), cudaGetErrorString(cudaGetLastError()));
  return TESSERA_OK;
}

__global__ void prepare_groups(GroupArrays g, const int32_t* __restrict__ offsets, int groups, int64_t rows,
                               int64_t k, int64_t n, const ElementAB* a, const float* sfa, const ElementAB* b,
                               const float* sfb, ElementD* d) {
  if (blockIdx.x == 0) {
    if (threadIdx.x >= 32) return;
    const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
    for_each_group(offsets, groups, rows, [&](int i, int64_t start, int64_t end) {
      const int count = static_cast<int>(end - start);
      g.shapes[i] = GroupShape{count, static_cast<int>(n), static_cast<int>(k)};
      g.ptr_a[i] = a + start * k;
      g.ptr_sfa[i] = sfa + start * kb;
      g.ptr_b[i] = b + i * n * k;
      g.ptr_sfb[i] = sfb + i * kb * nb;
      g.ptr_d[i] = d + start * n;
      g.stride_a[i] = leading_stride<StrideA>(k);
      g.stride_b[i] = leading_stride<StrideB>(k);
      g.stride_d[i] = leading_stride<StrideD>(n);
      g.layout_sfa[i] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(count, int(n), int(k), 1));
      g.layout_sfb[i] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(count, int(n), int(k), 1));
    });
    return;
  }
  const int64_t worker = int64_t(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  zero_rows_past_groups(d, offsets, groups, rows, n, sizeof(ElementD), worker, int64_t(gridDim.x - 1) * blockDim.x);
}

int run(const GroupedArgs& p) {
  Carver carver(p.workspace);
  GroupArrays g = carve(carver, p.groups);
  prepare_groups<<<1 + kZeroBlocks, 256, 0, p.stream>>>(
      g, p.offsets, p.groups, p.rows, p.k, p.n, static_cast<const ElementAB*>(p.a), static_cast<const float*>(p.sfa),
      static_cast<const ElementAB*>(p.b), static_cast<const float*>(p.sfb), static_cast<ElementD*>(p.d));
  TESSERA_CUDA_TRY(cudaGetLastError());
  return launch_gemm(g, p, "fp8 grouped");
}

// ---- op 1: grouped along K (the experts' weight gradient) ---------------------------------
// d[g] [m, n] = a_g b_g^T over group g's K range only: a [m, kp] and b [n, kp] K-major (kp the
// padded K of all groups), scales as tessera_fp8_quantize_grouped_t writes them (1x128 for a:
// [kp/128][m]; 128x128 for b: [kp/128][ceil(n/128)]). Group g owns K blocks
// [block_starts[g], block_starts[g + 1]) of 128; its block runs of a, sfa, b and sfb are
// contiguous, so each group is an ordinary GEMM with K = 128 * its blocks. Empty groups get
// M = 0 (no tiles) and a zeroed d[g].

__device__ __forceinline__ int64_t clamped_block(const int32_t* starts, int i, int64_t lo, int64_t hi) {
  const int64_t v = starts[i];
  return v < lo ? lo : (v > hi ? hi : v);
}

__global__ void prepare_wgrad(GroupArrays g, const int32_t* __restrict__ block_starts, int groups, int64_t m,
                              int64_t n, int64_t kp, const ElementAB* a, const float* sfa, const ElementAB* b,
                              const float* sfb, ElementD* d, bool accumulate) {
  const int64_t total_blocks = kp / 128, nb = (n + 127) / 128;
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < groups; i += blockDim.x) {
      // Clamped, so that no values of block_starts make a read leave a or b (groups only read
      // there; each writes its own d[g]).
      const int64_t first = clamped_block(block_starts, i, 0, total_blocks);
      const int64_t blocks = clamped_block(block_starts, i + 1, first, total_blocks) - first;
      const int k = static_cast<int>(blocks ? blocks * 128 : 128);
      g.shapes[i] = GroupShape{blocks ? static_cast<int>(m) : 0, static_cast<int>(n), k};
      g.ptr_a[i] = a + first * 128;
      g.ptr_sfa[i] = sfa + first * m;
      g.ptr_b[i] = b + first * 128;
      g.ptr_sfb[i] = sfb + first * nb;
      g.ptr_d[i] = d + i * m * n;
      if constexpr (kFp32Out) g.ptr_c[i] = d + i * m * n;
      g.stride_a[i] = leading_stride<StrideA>(kp);
      g.stride_b[i] = leading_stride<StrideB>(kp);
      g.stride_d[i] = leading_stride<StrideD>(n);
      g.layout_sfa[i] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(static_cast<int>(m), static_cast<int>(n), k, 1));
      g.layout_sfb[i] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(static_cast<int>(m), static_cast<int>(n), k, 1));
    }
    return;
  }
  const int64_t worker = int64_t(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  const int64_t workers = int64_t(gridDim.x - 1) * blockDim.x;
  if (accumulate) return;  // adding nothing: an empty group's d[g] stays as it is
  for (int i = 0; i < groups; ++i) {
    const int64_t first = clamped_block(block_starts, i, 0, total_blocks);
    if (clamped_block(block_starts, i + 1, 0, total_blocks) <= first)
      zero_fill(d + i * m * n, m * n * int64_t(sizeof(ElementD)), worker, workers);
  }
}

int run_wgrad(const GroupedArgs& p) {
  // GroupedArgs for op 1: rows = m, k = kp (the padded K, a multiple of 128), n = n,
  // offsets = block_starts [groups + 1].
  Carver carver(p.workspace);
  GroupArrays g = carve(carver, p.groups);
  prepare_wgrad<<<1 + kZeroBlocks, 256, 0, p.stream>>>(
      g, p.offsets, p.groups, p.rows, p.n, p.k, static_cast<const ElementAB*>(p.a), static_cast<const float*>(p.sfa),
      static_cast<const ElementAB*>(p.b), static_cast<const float*>(p.sfb), static_cast<ElementD*>(p.d),
      p.accumulate != 0);
  TESSERA_CUDA_TRY(cudaGetLastError());
  return launch_gemm(g, p, kFp32Out ? "fp8 grouped wgrad into fp32" : "fp8 grouped wgrad");
}

#if TESSERA_FP8_WGRAD_F32
const RegisterVariant registered_wgrad_f32(kFamilyFp8Grouped, 2, TESSERA_FP8_CONFIG, Config::name(), &run_wgrad,
                                           &workspace_bytes);
#else
const RegisterVariant registered(kFamilyFp8Grouped, 0, TESSERA_FP8_CONFIG, Config::name(), &run, &workspace_bytes);
const RegisterVariant registered_wgrad(kFamilyFp8Grouped, 1, TESSERA_FP8_CONFIG, Config::name(), &run_wgrad,
                                       &workspace_bytes);
#endif

}  // namespace
}  // namespace tessera::fp8_grouped
