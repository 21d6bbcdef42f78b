// FP8 (e4m3) GEMM with blockwise scales: D [M, N] bf16 = (A * SFA) (B * SFB)^T, fp32
// accumulation, where A [M, K] carries one scale per row and 128 columns (1x128, activations)
// and B [N, K] (K-major, i.e. the weight transposed) one per 128x128 block. CUTLASS 3.x
// blockwise-scaled warp-specialised sm90a kernel: each 128-deep K block is accumulated by
// WGMMA, then scaled and added into fp32 registers ("promotion"), as DeepSeek-V3's recipe.
//
// Scale layouts (what core/kernels/fp8.py's quantisers write):
//   SFA [ceil(K/128)][M] fp32 (M-major), SFB [ceil(K/128)][ceil(N/128)] fp32.
// One translation unit per configuration: -DTESSERA_FP8_CONFIG=<index into Configs>.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <tuple>

#include "common.cuh"

#ifndef TESSERA_FP8_CONFIG
#error "compile with -DTESSERA_FP8_CONFIG=<index into Configs>"
#endif

namespace tessera::fp8_gemm {
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------
// Candidate configurations, selectable at run time (index = position in Configs).
// ---------------------------------------------------------------------------------------

// CUTLASS's own blockwise example: two consumer warp groups on a 128x128 tile, K block 128
// (one scale per K tile), a 1x2 cluster multicasting the A tile to both N neighbours.
struct Coop128x128C1x2 {
  static const char* name() { return "coop_128x128x128_c1x2"; }
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

// Ping-pong on 64-row tiles: the promotion and the epilogue of one warp group hide behind
// the other's WGMMAs; smaller tiles for skinny M.
struct Pingpong64x128C1 {
  static const char* name() { return "pingpong_64x128x128_c1x1"; }
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<_1, _1, _1>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

// Added after the first H100 measurements (index 2): 256-row tiles, each B tile loaded serves
// twice the rows; the 1x2 cluster multicasts the A tile as config 0 does. Not 128 x 256: CUTLASS
// 4.2's sm90 blockwise mainloop with 1x128 A scales compiles only one B scale per tile along N.
// Each consumer thread holds 128 fp32 accumulators plus as many for the promotion.
struct Coop256x128C1x2 {
  static const char* name() { return "coop_256x128x128_c1x2"; }
  using Tile = Shape<_256, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

// Measured and not kept: config 0's tile in 2x1 and 2x2 clusters ran 0.87-1.03x cuBLAS
// blockwise against config 0's 0.92-1.03x in the same two runs (docs/fp8.md).
using Configs = std::tuple<Coop128x128C1x2, Pingpong64x128C1, Coop256x128C1x2>;
constexpr int kNumConfigs = 3;  // csrc/build.sh reads this line: which indices to build
static_assert(kNumConfigs == std::tuple_size_v<Configs>, "kNumConfigs must count Configs");
static_assert(TESSERA_FP8_CONFIG < std::tuple_size_v<Configs>, "TESSERA_FP8_CONFIG out of range");
using Config = std::tuple_element_t<TESSERA_FP8_CONFIG, Configs>;

using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using Accumulator = float;
using LayoutA = cutlass::layout::RowMajor;     // A [M, K], K-major
using LayoutB = cutlass::layout::ColumnMajor;  // B [N, K], K-major (FP8 WGMMA needs K-major)
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16;  // 16 bytes of e4m3
constexpr int kAlignD = 8;    // 16 bytes of bf16

// 1x128 scales for A, 128x128 for B, both M/N-major (the only order sm90 supports).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
    typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, Accumulator,
    Accumulator, void, LayoutD, kAlignD, ElementD, LayoutD, kAlignD,
    typename Config::EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, Accumulator>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA, LayoutSFA>,
    kAlignAB, ElementAB, cute::tuple<LayoutB, LayoutSFB>, kAlignAB, Accumulator,
    typename Config::Tile, typename Config::Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    typename Config::Schedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                    CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

Gemm::Arguments make_arguments(const GroupedArgs& p, int sms) {
  const int m = static_cast<int>(p.rows), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop.ptr_A = static_cast<const ElementAB*>(p.a);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1});
  args.mainloop.ptr_B = static_cast<const ElementAB*>(p.b);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1});
  args.mainloop.ptr_SFA = static_cast<const float*>(p.sfa);
  args.mainloop.layout_SFA = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  args.mainloop.ptr_SFB = static_cast<const float*>(p.sfb);
  args.mainloop.layout_SFB = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.ptr_D = static_cast<ElementD*>(p.d);
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  args.hw_info.device_id = p.device;
  args.hw_info.sm_count = sms;
  using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = p.raster ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = p.swizzle;
  return args;
}

size_t workspace_bytes(const GroupedArgs& p, int sms) { return Gemm::get_workspace_size(make_arguments(p, sms)); }

int run(const GroupedArgs& p) {
  Gemm::Arguments args = make_arguments(p, sm_count(p.device));
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "fp8 gemm %s: CUTLASS cannot implement m=%lld n=%lld k=%lld (%s)",
                Config::name(), (long long)p.rows, (long long)p.n, (long long)p.k, cutlassGetStatusString(status));
  status = gemm.initialize(args, p.workspace, p.stream);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "fp8 gemm %s: initialize failed (%s)", Config::name(),
                cutlassGetStatusString(status));
  status = gemm.run(p.stream);
  if (status != cutlass::Status::kSuccess)
    return fail(TESSERA_ERR_CUTLASS, "fp8 gemm %s: launch failed (%s, %s)", Config::name(),
                cutlassGetStatusString(status), cudaGetErrorString(cudaGetLastError()));
  return TESSERA_OK;
}

const RegisterVariant registered(kFamilyFp8Gemm, 0, TESSERA_FP8_CONFIG, Config::name(), &run, &workspace_bytes);

}  // namespace
}  // namespace tessera::fp8_gemm
