// Host entry of the CUDA expert GEMM (SPEC §1.6), torch-free: raw device pointers, sizes and strides.
//
//   D[m, n] = bf16( Σ_k A[m, k] · B_e[n, k] (+ bias) )   on dequantized values, fp32 accumulation
//
// One kernel serves two callers:
//   * mask mode (the expert_gemm op): one expert e, a bool mask over the R rows of A. Rows with mask 0 get exact
//     zeros in D and are never read; the active rows are found on the device (no host sync), so the call is
//     graph-capturable and costs nothing for an all-zero mask but the zero-fill.
//   * list mode (local_experts): a device array of tiles {expert, start, count} over "pairs" (rows of A picked
//     through row_index, or rows start.. of A when row_index is null), with the tile count in device memory.
//     D row of tile row i is start + i. Experts without tiles read no weights.
// The kernel and its numerics are described in expert_gemm.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace static_moe {
namespace cuda {

enum class WeightFmt : int { kBf16 = 0, kFp8 = 1, kFp4 = 2 };

// Rows of A per tile; local_experts sizes its tile list with it.
constexpr int kGemmTileRows = 32;

// One list-mode tile: rows [start, start + count) of the pair list, all routed to local expert `expert`.
struct GemmTile {
  int expert;
  int start;
  int count;  // 1 .. kGemmTileRows
  int pad;
};

struct ExpertGemmArgs {
  // A [*, K]: bf16 (a_group = 0) or e4m3fn with float32 scales [*, K/a_group] (a_group = 32 or 128).
  // Columns contiguous; row strides in elements.
  const void* a = nullptr;
  int64_t a_row_stride = 0;
  int a_group = 0;
  const float* a_scale = nullptr;
  int64_t a_scale_row_stride = 0;

  // B [L, N, K] bf16 / e4m3fn, or [L, N, K/2] packed e2m1 bytes; K contiguous. Strides in BYTES.
  // Scales: fp8 float32 [L, N, K/128], fp4 UE8M0 bytes [L, N, K/32]; strides in elements of the scale dtype.
  WeightFmt b_fmt = WeightFmt::kBf16;
  const void* b = nullptr;
  int64_t b_expert_stride = 0;
  int64_t b_row_stride = 0;
  const void* b_scale = nullptr;
  int64_t b_scale_expert_stride = 0;
  int64_t b_scale_row_stride = 0;

  int64_t n = 0;  // multiple of 8
  int64_t k = 0;  // multiple of 128

  // D bf16 [*, N], row stride in elements.
  void* d = nullptr;
  int64_t d_row_stride = 0;

  // SPEC §1.9: optional float32 bias [L, N] (unit column stride), added to the fp32 sum before the bf16 rounding;
  // in list mode optionally times bias_row_scale[D row] (local_experts' w·b2, one fp32 product).
  const float* bias = nullptr;
  int64_t bias_expert_stride = 0;  // elements
  const float* bias_row_scale = nullptr;

  // Mask mode (row_mask != nullptr): rows [0, rows) of A and D, one expert.
  const uint8_t* row_mask = nullptr;
  int64_t rows = 0;
  int64_t expert = 0;

  // List mode (row_mask == nullptr).
  const GemmTile* tiles = nullptr;
  const int* num_tiles = nullptr;  // device scalar, <= max_tiles
  int64_t max_tiles = 0;
  const int* row_index = nullptr;  // A row of pair p (nullptr: p itself)
};

// nullptr when the kernel can run these arguments, else what is wrong (alignment, divisibility), for the binding's
// error message. The binding's shared checks (csrc/checks/expert_gemm.h) come first; these are CUDA-only needs.
const char* expert_gemm_unsupported(const ExpertGemmArgs& args);

// Enqueues the GEMM on `stream`; no host synchronization, no allocation.
cudaError_t launch_expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace static_moe
