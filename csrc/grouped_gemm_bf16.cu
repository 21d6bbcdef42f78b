// Grouped GEMM for MoE experts: bf16 in, fp32 accumulate, bf16 out, on CUTLASS 3.x's
// ptr-array grouped kernel for sm90a (TMA loads, warp-specialised WGMMA, persistent tiles).
//
// One translation unit = one (operation, configuration) pair, chosen by the build with
// -DTESSERA_GG_OP=<0..2> -DTESSERA_GG_CONFIG=<0..>, so build.sh compiles the variants in
// parallel and each registers itself in the table the C ABI dispatches on.
//
// Graph capture: the per-group problem sizes, pointers and strides are written on the
// device by prepare_groups() from the int32 offsets (no host sync), into the caller's
// workspace, then the CUTLASS kernel reads them; both go on the caller's stream.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <tuple>

#include "common.cuh"
#include "grouped_common.cuh"

#ifndef TESSERA_GG_OP
#error "compile with -DTESSERA_GG_OP=<0 fwd | 1 fwd_bt | 2 wgrad | 3 wgrad_f32 | 4 fwd_bt_t>"
#endif
#ifndef TESSERA_GG_CONFIG
#error "compile with -DTESSERA_GG_CONFIG=<index into Configs>"
#endif

namespace tessera::gg_bf16 {
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------
// Candidate configurations, all selectable at run time (config index = position below).
// Measure them per MoE shape with bench/kernels.py; the Python side picks one per call.
// ---------------------------------------------------------------------------------------

// Two consumer warp groups share a 128x256 tile; a 2x1 cluster multicasts each weight tile
// to both M neighbours. torch._grouped_mm's choice for large groups: the parity baseline.
struct Coop128x256C2x1 {
  static const char* name() { return "coop_128x256x64_c2x1"; }
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Ping-pong: one warp group's epilogue overlaps the other's mainloop, which pays off when
// K is short (fine-grained experts). 128-wide N divides 1408 and 2048 exactly, and no
// cluster means no M-tile padding to a cluster multiple on small groups.
struct Pingpong128x128C1 {
  static const char* name() { return "pingpong_128x128x64_c1x1"; }
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// 64-row tiles halve the padding of the last M tile of each group, which dominates when
// groups hold a few hundred rows (E=128 experts); 256-wide N keeps WGMMA efficient.
struct Pingpong64x256C1 {
  static const char* name() { return "pingpong_64x256x64_c1x1"; }
  using Tile = Shape<_64, _256, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Configurations added after the first H100 measurements (coop_128x256x64_c2x1 was the best of
// the three above on every shape). Indices 0-2 stay as they are: benches and TESSERA_GG_CONFIG
// refer to them. A cluster pads every group's tile count to a multiple of the cluster along
// that dimension (the grouped tile scheduler), so the cluster shape matters as much as the tile.

// 128-wide N tiles: N = 1408 (fine-grained experts' hidden size, 11 x 128) has no N padding,
// where the 256-wide tile computes 1536 columns (9% waste). 256 rows per tile keep the same
// WGMMA work per warp group as the 128x256 tile (each warp group owns 128x128); the 2x1
// cluster multicasts the weight tile. Fits wgrad best (M = the layer's input size, 512 | M).
struct Coop256x128C2x1 {
  static const char* name() { return "coop_256x128x64_c2x1"; }
  using Tile = Shape<_256, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Same 128-wide N, but 128-row tiles: a group's rows are padded to 256 (the 2x1 cluster), not
// to 512 as with the 256x128 tile in a 2x1 cluster; twice the tiles, half the work per tile.
struct Coop128x128C2x1 {
  static const char* name() { return "coop_128x128x64_c2x1"; }
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Config 0 without its cluster: no padding of a group's rows beyond the 128-row tile. With
// groups of ~512 rows (E=128, top-8) the 2x1 cluster rounds 4-5 tiles up to 4-6: on the
// bench's random routing 81% of the computed tiles' work is useful, 89.5% without the cluster.
// It gives up the weight multicast for that.
struct Coop128x256C1 {
  static const char* name() { return "coop_128x256x64_c1x1"; }
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Config 0's tile in a 1x2 cluster: multicasts the activation tile to both N
// neighbours, and pads a group's N tiles (not its row tiles) to an even count, which costs
// nothing where the group's N is a multiple of 512 or rounds up to one anyway (1408 -> 1536).
struct Coop128x256C1x2 {
  static const char* name() { return "coop_128x256x64_c1x2"; }
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Measured and not kept: a 128x176 tile (1408 = 8 x 176, no N padding) ran at 0.52-0.58x
// torch._grouped_mm on every shape and pass (docs/performance-notes.md).
using Configs = std::tuple<Coop128x256C2x1, Pingpong128x128C1, Pingpong64x256C1, Coop256x128C2x1,
                           Coop128x128C2x1, Coop128x256C1, Coop128x256C1x2>;
constexpr int kNumConfigs = 7;  // csrc/build.sh reads this line: which indices to build
static_assert(kNumConfigs == std::tuple_size_v<Configs>, "kNumConfigs must count Configs");
static_assert(TESSERA_GG_CONFIG < kNumConfigs, "TESSERA_GG_CONFIG out of range");
using Config = std::tuple_element_t<TESSERA_GG_CONFIG, Configs>;

constexpr int kOp = TESSERA_GG_OP;
static_assert(kOp >= 0 && kOp < TESSERA_GG_NUM_OPS, "TESSERA_GG_OP out of range");

// ---------------------------------------------------------------------------------------
// Operand layouts per operation, in CUTLASS's (M, N, K) terms:
//   fwd:    M = rows of group, N = n, K = k; A = a_g row-major, B = b[g] (k x n, N-major)
//   fwd_bt: same, B = b[g] stored n x k (K-major)
//   wgrad:  M = k, N = n, K = rows of group; A = a_g^T (M-major), B = b_g (N-major)
//   wgrad_f32: as wgrad, D fp32 and, when accumulating, C = D with beta = 1 (the main grad)
//   fwd_bt_t: M = n, N = rows of group, K = k; A = b[g] (n x k, K-major), B = a_g^T (K-major),
//           D = d_g^T, column-major: the same memory as fwd_bt's row-major d_g
// ---------------------------------------------------------------------------------------
constexpr bool kWgrad = kOp == TESSERA_GG_WGRAD || kOp == TESSERA_GG_WGRAD_F32;
constexpr bool kTransposed = kOp == TESSERA_GG_FWD_BT_T;
constexpr bool kFp32Out = kOp == TESSERA_GG_WGRAD_F32;
using Element = cutlass::bfloat16_t;
using Accumulator = float;
using ElementD = std::conditional_t<kFp32Out, float, Element>;
// No C operand for bf16 outputs (void skips the C load); the fp32 output reads itself as C.
using ElementC = std::conditional_t<kFp32Out, float, void>;
using LayoutA = std::conditional_t<kWgrad, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
using LayoutB = std::conditional_t<kOp == TESSERA_GG_FWD_BT || kTransposed, cutlass::layout::ColumnMajor,
                                   cutlass::layout::RowMajor>;
using LayoutD = std::conditional_t<kTransposed, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
constexpr int kAlignment = 16 / sizeof(Element);  // TMA moves 16-byte rows
constexpr int kAlignmentD = 16 / sizeof(ElementD);

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;

// D = acc + beta * C: beta 0 (bf16 outputs have no C operand at all; an fp32 output that is
// overwritten skips the C load at run time), beta 1 when adding into the fp32 main grad.
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
    typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, Accumulator,
    Accumulator, ElementC, LayoutD*, kAlignmentD, ElementD, LayoutD*, kAlignmentD,
    typename Config::EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, Accumulator,
                                                 std::conditional_t<kFp32Out, float, Element>>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element,
    LayoutB*, kAlignment, Accumulator, typename Config::Tile, typename Config::Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    typename Config::Schedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                    CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;

// The per-group arrays CUTLASS reads, carved from the workspace.
struct GroupArrays {
  GroupShape* shapes;
  const Element** ptr_a;
  const Element** ptr_b;
  ElementD** ptr_d;
  const ElementD** ptr_c;  // the same addresses as ptr_d (fp32 output only)
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  void* cutlass_workspace;
};

template <class C>
GroupArrays carve(C& c, int groups) {
  GroupArrays g;
  g.shapes = c.template take<GroupShape>(groups);
  g.ptr_a = c.template take<const Element*>(groups);
  g.ptr_b = c.template take<const Element*>(groups);
  g.ptr_d = c.template take<ElementD*>(groups);
  g.ptr_c = c.template take<const ElementD*>(kFp32Out ? groups : 0);
  g.stride_a = c.template take<StrideA>(groups);
  g.stride_b = c.template take<StrideB>(groups);
  g.stride_d = c.template take<StrideD>(groups);
  g.cutlass_workspace = c.template take<char>(0, 256);
  return g;
}

Gemm::Arguments make_arguments(const GroupArrays& g, int groups, int device, int sms, int raster,
                               int swizzle, bool accumulate) {
  Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{groups, g.shapes, nullptr};  // sizes live on the device only
  args.mainloop.ptr_A = g.ptr_a;
  args.mainloop.dA = g.stride_a;
  args.mainloop.ptr_B = g.ptr_b;
  args.mainloop.dB = g.stride_b;
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

// Block 0 (one warp) writes the per-group arrays; the other blocks zero what no GEMM tile
// writes (fwd: rows past the last group; wgrad: d[g] of empty groups, unless adding to d), so
// the output is fully defined without a memset of all of it.
__global__ void prepare_groups(GroupArrays g, const int32_t* __restrict__ offsets, int groups,
                               int64_t rows, int64_t k, int64_t n, const Element* a,
                               const Element* b, ElementD* d, bool accumulate) {
  if (blockIdx.x == 0) {
    if (threadIdx.x >= 32) return;
    for_each_group(offsets, groups, rows, [&](int i, int64_t start, int64_t end) {
      const int count = static_cast<int>(end - start);
      if constexpr (kWgrad) {
        // K = rows of the group; an empty group gets M = 0 (no tiles) and is zeroed below.
        g.shapes[i] = GroupShape{count ? static_cast<int>(k) : 0, static_cast<int>(n), count};
        g.ptr_a[i] = a + start * k;
        g.ptr_b[i] = b + start * n;
        g.ptr_d[i] = d + i * k * n;
        if constexpr (kFp32Out) g.ptr_c[i] = d + i * k * n;
        g.stride_a[i] = leading_stride<StrideA>(k);
        g.stride_b[i] = leading_stride<StrideB>(n);
      } else if constexpr (kTransposed) {
        // An empty group has N = 0: no tiles.
        g.shapes[i] = GroupShape{static_cast<int>(n), count, static_cast<int>(k)};
        g.ptr_a[i] = b + i * k * n;
        g.ptr_b[i] = a + start * k;
        g.ptr_d[i] = d + start * n;
        g.stride_a[i] = leading_stride<StrideA>(k);
        g.stride_b[i] = leading_stride<StrideB>(k);
      } else {
        g.shapes[i] = GroupShape{count, static_cast<int>(n), static_cast<int>(k)};
        g.ptr_a[i] = a + start * k;
        g.ptr_b[i] = b + i * k * n;
        g.ptr_d[i] = d + start * n;
        g.stride_a[i] = leading_stride<StrideA>(k);
        g.stride_b[i] = leading_stride<StrideB>(kOp == TESSERA_GG_FWD_BT ? k : n);
      }
      g.stride_d[i] = leading_stride<StrideD>(n);
    });
    return;
  }
  const int64_t worker = int64_t(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  const int64_t workers = int64_t(gridDim.x - 1) * blockDim.x;
  if constexpr (kWgrad) {
    if (!accumulate) zero_empty_groups(d, offsets, groups, rows, k, n, sizeof(ElementD), worker, workers);
  } else {
    zero_rows_past_groups(d, offsets, groups, rows, n, sizeof(Element), worker, workers);
  }
}

int run(const GroupedArgs& p) {
  Carver carver(p.workspace);
  GroupArrays g = carve(carver, p.groups);
  prepare_groups<<<1 + kZeroBlocks, 256, 0, p.stream>>>(
      g, p.offsets, p.groups, p.rows, p.k, p.n, static_cast<const Element*>(p.a),
      static_cast<const Element*>(p.b), static_cast<ElementD*>(p.d), p.accumulate != 0);
  TESSERA_CUDA_TRY(cudaGetLastError());

  Gemm::Arguments args =
      make_arguments(g, p.groups, p.device, sm_count(p.device), p.raster, p.swizzle, p.accumulate != 0);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "%s: CUTLASS cannot implement (%s)", Config::name(),
                cutlassGetStatusString(status));
  status = gemm.initialize(args, g.cutlass_workspace, p.stream);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "%s: initialize failed (%s)", Config::name(),
                cutlassGetStatusString(status));
  status = gemm.run(p.stream);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "%s: launch failed (%s, %s)", Config::name(),
                cutlassGetStatusString(status), cudaGetErrorString(cudaGetLastError()));
  return TESSERA_OK;
}

const RegisterVariant registered(kFamilyGroupedBf16, kOp, TESSERA_GG_CONFIG, Config::name(), &run,
                                 &workspace_bytes);

}  // namespace
}  // namespace tessera::gg_bf16
