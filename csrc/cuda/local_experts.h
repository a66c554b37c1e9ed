// Host entry of the CUDA local_experts (SPEC §1.7), torch-free: the fused step 2 of the forward on one EP rank.
//
//   for each local expert e (increasing id), over the rows routed to it (weight w = sum of the row's top-k weights
//   naming e): h = bf16(x·W13_eᵀ + b13_e); z = swiglu_and_cast(h, w, act); d = bf16(z·W2_eᵀ + w·b2_e);
//   acc[row] += d   (fp32; activations and biases: SPEC §1.9)
//
// Five launches on one stream, no host synchronization, no allocation (the caller passes `workspace`):
//   1. route    (1 block): per-expert pair counts, tile list, pair lists (row, weight), per-row pair slots
//   2. GEMM1    list-mode expert GEMM over the tiles: h[pair] = x[row(pair)] · W13_eᵀ
//   3. swiglu   over the routed pairs only (their count is read on the device)
//   4. GEMM2    d[pair] = z[pair] · W2_eᵀ (same tiles)
//   5. combine  acc[row] = Σ d[pair] over the row's pairs in increasing expert order (the reference's order, so
//               the fp32 sums are deterministic and batch invariant; no atomics on the output)
// Experts no row selects get no tile: their weights are never read. Ids outside this rank's experts (other ranks'
// experts, -1, or invalid values) select nothing and are never used as addresses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/expert_gemm.h"

namespace static_moe {
namespace cuda {

struct LocalExpertsArgs {
  // x [R, H]: bf16 (x_group = 0) or e4m3fn with float32 scales [R, H/x_group]; unit column strides.
  const void* x = nullptr;
  int64_t x_row_stride = 0;
  int x_group = 0;
  const float* x_scale = nullptr;
  int64_t x_scale_row_stride = 0;
  // Routing [R, k]: ids int32 or int64, weights float32 or bf16; unit column strides.
  const void* topk_idx = nullptr;
  bool idx_int64 = false;
  int64_t idx_row_stride = 0;
  const void* topk_weights = nullptr;
  bool weights_bf16 = false;
  int64_t weights_row_stride = 0;
  int64_t rows = 0;           // R
  int64_t topk = 0;           // k
  int64_t expert_offset = 0;  // global id of local expert 0
  // Weights, as in ExpertGemmArgs: w13 [L, 2I, H], w2 [L, H, I] (fp4: last dim halved); strides in bytes, scale
  // strides in elements of the scale dtype.
  WeightFmt w_fmt = WeightFmt::kBf16;
  const void* w13 = nullptr;
  int64_t w13_expert_stride = 0, w13_row_stride = 0;
  const void* w13_scale = nullptr;
  int64_t w13_scale_expert_stride = 0, w13_scale_row_stride = 0;
  const void* w2 = nullptr;
  int64_t w2_expert_stride = 0, w2_row_stride = 0;
  const void* w2_scale = nullptr;
  int64_t w2_scale_expert_stride = 0, w2_scale_row_stride = 0;
  int64_t num_local = 0;  // L
  int64_t hidden = 0;     // H
  int64_t inter = 0;      // I
  bool has_limit = false;
  float limit = 0.0f;
  float fp8_max = 448.0f;
  int act = 0;                      // SPEC §1.9 activation (Act in swiglu_and_cast.cuh)
  float alpha = 1.702f;             // swiglu_oai
  const float* w13_bias = nullptr;  // float32 [L, 2I] contiguous, or nullptr
  const float* w2_bias = nullptr;   // float32 [L, H] contiguous, or nullptr
  float* out = nullptr;             // [R, H] float32, contiguous
};

constexpr int64_t kLocalExpertsAlign = 256;  // workspace base and parts

// Byte offsets of the workspace parts (each 256-byte aligned) and the total. P = R·min(k, L) pairs at most.
struct LocalExpertsLayout {
  int64_t max_pairs = 0;
  int64_t max_tiles = 0;
  int64_t counters = 0;  // int[2]: routed pairs, tiles
  int64_t cursor = 0;    // int[L]
  int64_t pair_row = 0;  // int[P]
  int64_t pair_w = 0;    // float[P]
  int64_t slot_pos = 0;  // int[R·k]: pair of (row, slot), -1 when the slot is not this row's first naming of a
  int64_t slot_e = 0;    // int[R·k]   local expert; its local expert id
  int64_t tiles = 0;     // GemmTile[max_tiles]
  int64_t hd = 0;        // bf16[P·max(2I, H)]: h (GEMM1 out), then d (GEMM2 out)
  int64_t z = 0;         // e4m3 [P·I] or bf16 [P·I]
  int64_t z_scale = 0;   // float[P·I/g] (fp8 activations)
  int64_t bytes = 0;
};

inline LocalExpertsLayout local_experts_layout(int64_t rows, int64_t topk, int64_t num_local, int64_t hidden,
                                               int64_t inter, int x_group) {
  LocalExpertsLayout l;
  l.max_pairs = rows * (topk < num_local ? topk : num_local);
  l.max_tiles = (l.max_pairs + kGemmTileRows - 1) / kGemmTileRows + (num_local < l.max_pairs ? num_local : l.max_pairs);
  const int64_t P = l.max_pairs;
  int64_t at = 0;
  const auto take = [&at](int64_t bytes) {
    const int64_t off = at;
    at += (bytes + kLocalExpertsAlign - 1) / kLocalExpertsAlign * kLocalExpertsAlign;
    return off;
  };
  const int64_t hd_cols = 2 * inter > hidden ? 2 * inter : hidden;
  l.counters = take(2 * 4);
  l.cursor = take(num_local * 4);
  l.pair_row = take(P * 4);
  l.pair_w = take(P * 4);
  l.slot_pos = take(rows * topk * 4);
  l.slot_e = take(rows * topk * 4);
  l.tiles = take(l.max_tiles * static_cast<int64_t>(sizeof(GemmTile)));
  l.hd = take(P * hd_cols * 2);
  l.z = take(P * inter * (x_group != 0 ? 1 : 2));
  l.z_scale = take(x_group != 0 ? P * (inter / x_group) * 4 : 0);
  l.bytes = at;
  return l;
}

// nullptr when the kernels can run these arguments, else what is wrong (alignment, sizes).
const char* local_experts_unsupported(const LocalExpertsArgs& args);

// Enqueues the five kernels on `stream`. workspace: device memory of at least layout.bytes, 256-byte aligned.
cudaError_t launch_local_experts(const LocalExpertsArgs& args, void* workspace, int64_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace cuda
}  // namespace static_moe
