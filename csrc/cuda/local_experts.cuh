// Per-row pieces of the local_experts route and combine kernels (local_experts.cu), __host__ __device__ so that
// tests/cuda/host/ runs the same code on the CPU.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/expert_gemm.h"
#include "cuda/local_experts.h"
#include "cuda/numerics.cuh"
#include "cuda/swiglu_and_cast.h"

namespace static_moe {
namespace cuda {

struct RouteArgs {
  const void* idx;  // [R, k] int32 or int64
  int64_t idx_row_stride;
  const void* weights;  // [R, k] float32 or bf16
  int64_t weights_row_stride;
  int64_t rows, topk, offset, num_local;
  int* counters;  // [0] routed pairs, [1] tiles
  int* cursor;    // [L]: per-expert counts, then the next free pair of each expert
  int* pair_row;  // [P]
  float* pair_w;  // [P]
  int* slot_pos;  // [R, k]
  int* slot_e;    // [R, k]
  GemmTile* tiles;
};

template <typename IdxT>
__host__ __device__ inline int64_t route_id(const RouteArgs& r, int64_t row, int64_t j) {
  return static_cast<int64_t>(static_cast<const IdxT*>(r.idx)[row * r.idx_row_stride + j]);
}

template <bool kBf16W>
__host__ __device__ inline float route_weight(const RouteArgs& r, int64_t row, int64_t j) {
  if constexpr (kBf16W)
    return bf16_bits_to_float(static_cast<const uint16_t*>(r.weights)[row * r.weights_row_stride + j]);
  else
    return static_cast<const float*>(r.weights)[row * r.weights_row_stride + j];
}

// Local expert named by slot j of `row`, or -1 when the slot names none of this rank's experts (padding -1, other
// ranks' ids, invalid ids) or repeats an id of an earlier slot of the row. *id_out = the slot's id.
template <typename IdxT>
__host__ __device__ inline int64_t first_local_expert(const RouteArgs& r, int64_t row, int64_t j, int64_t* id_out) {
  const int64_t id = route_id<IdxT>(r, row, j);
  *id_out = id;
  const int64_t e = id - r.offset;
  if (e < 0 || e >= r.num_local) return -1;
  for (int64_t j2 = 0; j2 < j; ++j2)
    if (route_id<IdxT>(r, row, j2) == id) return -1;
  return e;
}

// The row's routing weight for the expert first named at slot j: the sum of the weights of every slot naming `id`,
// in slot order from 0 (earlier slots cannot name it), as the reference sums them. Slots naming other ids are
// never read, so NaN weights of padded rows cannot leak.
template <typename IdxT, bool kBf16W>
__host__ __device__ inline float routed_weight(const RouteArgs& r, int64_t row, int64_t j, int64_t id) {
  float w = 0.0f;
  for (int64_t j2 = j; j2 < r.topk; ++j2)
    if (route_id<IdxT>(r, row, j2) == id) w += route_weight<kBf16W>(r, row, j2);
  return w;
}

// Tiles of expert e with `count` pairs starting at pair p0, written from tiles[t0]. Returns the number written.
__host__ __device__ inline int write_expert_tiles(GemmTile* tiles, int t0, int e, int p0, int count) {
  int m = 0;
  for (; m * kGemmTileRows < count; ++m) {
    const int left = count - m * kGemmTileRows;
    tiles[t0 + m] = GemmTile{e, p0 + m * kGemmTileRows, left < kGemmTileRows ? left : kGemmTileRows, 0};
  }
  return m;
}

// acc[0..8) = Σ d[pair, col .. col+8) (bf16 -> fp32) over the row's pairs in increasing local expert id, starting
// from 0 — the reference's acc[rows_e] += d order. sp / se: the row's slot_pos / slot_e.
__host__ __device__ inline void combine_row(const uint16_t* d, int64_t hidden, const int* sp, const int* se,
                                            int64_t topk, int64_t col, float (&acc)[8]) {
  STATIC_MOE_UNROLL
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  int prev = -1;
  while (true) {
    int best_e = INT_MAX, best_p = -1;
    for (int64_t j = 0; j < topk; ++j) {
      const int p = sp[j], e = se[j];
      if (p >= 0 && e > prev && e < best_e) {
        best_e = e;
        best_p = p;
      }
    }
    if (best_p < 0) break;
    const uint16_t* src = d + static_cast<int64_t>(best_p) * hidden + col;
    STATIC_MOE_UNROLL
    for (int i = 0; i < 8; ++i) acc[i] += bf16_bits_to_float(src[i]);
    prev = best_e;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Argument wiring of the five stages over the workspace (ws = nullptr leaves the workspace pointers null, for
// checking the caller's operands only). Host code; the emulation in tests/cuda/host/ uses it too.
// ---------------------------------------------------------------------------------------------------------------
template <typename T>
inline T* ws_part(uint8_t* ws, int64_t offset) {
  return ws != nullptr ? reinterpret_cast<T*>(ws + offset) : nullptr;
}

inline RouteArgs le_route_args(const LocalExpertsArgs& a, const LocalExpertsLayout& l, uint8_t* ws) {
  return RouteArgs{a.topk_idx,
                   a.idx_row_stride,
                   a.topk_weights,
                   a.weights_row_stride,
                   a.rows,
                   a.topk,
                   a.expert_offset,
                   a.num_local,
                   ws_part<int>(ws, l.counters),
                   ws_part<int>(ws, l.cursor),
                   ws_part<int>(ws, l.pair_row),
                   ws_part<float>(ws, l.pair_w),
                   ws_part<int>(ws, l.slot_pos),
                   ws_part<int>(ws, l.slot_e),
                   ws_part<GemmTile>(ws, l.tiles)};
}

// h[pair] = x[pair_row[pair]] · W13_eᵀ (+ b13_e) over the route's tiles.
inline ExpertGemmArgs le_gemm1_args(const LocalExpertsArgs& a, const LocalExpertsLayout& l, uint8_t* ws) {
  ExpertGemmArgs g;
  g.a = a.x;
  g.a_row_stride = a.x_row_stride;
  g.a_group = a.x_group;
  g.a_scale = a.x_scale;
  g.a_scale_row_stride = a.x_scale_row_stride;
  g.b_fmt = a.w_fmt;
  g.b = a.w13;
  g.b_expert_stride = a.w13_expert_stride;
  g.b_row_stride = a.w13_row_stride;
  g.b_scale = a.w13_scale;
  g.b_scale_expert_stride = a.w13_scale_expert_stride;
  g.b_scale_row_stride = a.w13_scale_row_stride;
  g.n = 2 * a.inter;
  g.k = a.hidden;
  g.d = ws_part<uint16_t>(ws, l.hd);
  g.d_row_stride = 2 * a.inter;
  g.tiles = ws_part<GemmTile>(ws, l.tiles);
  g.num_tiles = ws_part<int>(ws, l.counters) != nullptr ? ws_part<int>(ws, l.counters) + 1 : nullptr;
  g.max_tiles = l.max_tiles;
  g.row_index = ws_part<int>(ws, l.pair_row);
  g.bias = a.w13_bias;
  g.bias_expert_stride = 2 * a.inter;
  return g;
}

// z[pair] = swiglu_and_cast(h[pair], pair_w[pair]): fp8 with x's group, or bf16 for bf16 x (SPEC §1.7); only the
// routed pairs (their count is on the device).
inline SwigluArgs le_swiglu_args(const LocalExpertsArgs& a, const LocalExpertsLayout& l, uint8_t* ws) {
  SwigluArgs s;
  s.gate_up = ws_part<uint16_t>(ws, l.hd);
  s.gate_up_bf16 = true;
  s.gate_up_row_stride = 2 * a.inter;
  s.rows = l.max_pairs;
  s.inter = a.inter;
  s.rows_dev = ws_part<int>(ws, l.counters);
  s.row_weight = ws_part<float>(ws, l.pair_w);
  s.row_weight_bf16 = false;
  s.has_limit = a.has_limit;
  s.limit = a.limit;
  s.act = a.act;
  s.alpha = a.alpha;
  s.out_fp8 = a.x_group != 0;
  s.group = a.x_group != 0 ? a.x_group : 128;
  s.fp8_max = a.fp8_max;
  s.pow2_scale = true;
  s.out = ws_part<uint8_t>(ws, l.z);
  s.out_row_stride = a.inter;
  s.scale = a.x_group != 0 ? ws_part<float>(ws, l.z_scale) : nullptr;
  s.scale_row_stride = a.x_group != 0 ? a.inter / a.x_group : 0;
  return s;
}

// d[pair] = z[pair] · W2_eᵀ over the same tiles, written over h.
inline ExpertGemmArgs le_gemm2_args(const LocalExpertsArgs& a, const LocalExpertsLayout& l, uint8_t* ws) {
  ExpertGemmArgs g;
  g.a = ws_part<uint8_t>(ws, l.z);
  g.a_row_stride = a.inter;
  g.a_group = a.x_group;
  g.a_scale = a.x_group != 0 ? ws_part<float>(ws, l.z_scale) : nullptr;
  g.a_scale_row_stride = a.x_group != 0 ? a.inter / a.x_group : 0;
  g.b_fmt = a.w_fmt;
  g.b = a.w2;
  g.b_expert_stride = a.w2_expert_stride;
  g.b_row_stride = a.w2_row_stride;
  g.b_scale = a.w2_scale;
  g.b_scale_expert_stride = a.w2_scale_expert_stride;
  g.b_scale_row_stride = a.w2_scale_row_stride;
  g.n = a.hidden;
  g.k = a.inter;
  g.d = ws_part<uint16_t>(ws, l.hd);
  g.d_row_stride = a.hidden;
  g.tiles = ws_part<GemmTile>(ws, l.tiles);
  g.num_tiles = ws_part<int>(ws, l.counters) != nullptr ? ws_part<int>(ws, l.counters) + 1 : nullptr;
  g.max_tiles = l.max_tiles;
  g.row_index = nullptr;
  g.bias = a.w2_bias;  // d = bf16(z·W2ᵀ + w·b2): the pair's routing weight times the bias (SPEC §1.9)
  g.bias_expert_stride = a.hidden;
  g.bias_row_scale = a.w2_bias != nullptr ? ws_part<float>(ws, l.pair_w) : nullptr;
  return g;
}

}  // namespace cuda
}  // namespace static_moe
