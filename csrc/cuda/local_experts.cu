// CUDA local_experts (local_experts.h): the route and combine kernels, and the five-launch sequence around the
// expert GEMM (expert_gemm.cu) and swiglu_and_cast (swiglu_and_cast.cu) launchers.
#include "cuda/local_experts.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/expert_gemm.h"
#include "cuda/local_experts.cuh"
#include "cuda/numerics.cuh"
#include "cuda/swiglu_and_cast.h"

namespace static_moe {
namespace cuda {

namespace {

constexpr int kRouteThreads = 1024;
constexpr int kCombineThreads = 128;

// One block. (1) count rows per local expert, (2) warp 0 scans the counts into pair offsets and the tile list,
// (3) every row claims its pair slots. Pair order inside an expert comes from atomics and may differ between runs;
// results do not (a row's arithmetic never depends on its tile position), and the combine order is by expert id.
template <typename IdxT, bool kBf16W>
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const RouteArgs r) {
  const int tid = threadIdx.x;
  for (int64_t e = tid; e < r.num_local; e += kRouteThreads) r.cursor[e] = 0;
  __syncthreads();
  for (int64_t row = tid; row < r.rows; row += kRouteThreads) {
    for (int64_t j = 0; j < r.topk; ++j) {
      int64_t id;
      const int64_t e = first_local_expert<IdxT>(r, row, j, &id);
      if (e >= 0) atomicAdd(&r.cursor[e], 1);
    }
  }
  __syncthreads();
  if (tid < 32) {
    const int lane = tid;
    const int64_t per = (r.num_local + 31) / 32;
    const int64_t e0 = min(lane * per, r.num_local), e1 = min(e0 + per, r.num_local);
    int pairs = 0, tiles = 0;
    for (int64_t e = e0; e < e1; ++e) {
      const int c = r.cursor[e];
      pairs += c;
      tiles += (c + kGemmTileRows - 1) / kGemmTileRows;
    }
    int inc_pairs = pairs, inc_tiles = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int vp = __shfl_up_sync(0xffffffffu, inc_pairs, o);
      const int vt = __shfl_up_sync(0xffffffffu, inc_tiles, o);
      if (lane >= o) {
        inc_pairs += vp;
        inc_tiles += vt;
      }
    }
    int p0 = inc_pairs - pairs, t0 = inc_tiles - tiles;
    for (int64_t e = e0; e < e1; ++e) {
      const int c = r.cursor[e];
      t0 += write_expert_tiles(r.tiles, t0, static_cast<int>(e), p0, c);
      r.cursor[e] = p0;  // from here on: the next free pair of expert e
      p0 += c;
    }
    if (lane == 31) {
      r.counters[0] = inc_pairs;
      r.counters[1] = inc_tiles;
    }
  }
  __syncthreads();
  for (int64_t row = tid; row < r.rows; row += kRouteThreads) {
    for (int64_t j = 0; j < r.topk; ++j) {
      int64_t id;
      const int64_t e = first_local_expert<IdxT>(r, row, j, &id);
      int pos = -1;
      if (e >= 0) {
        pos = atomicAdd(&r.cursor[e], 1);
        r.pair_row[pos] = static_cast<int>(row);
        r.pair_w[pos] = routed_weight<IdxT, kBf16W>(r, row, j, id);
      }
      r.slot_pos[row * r.topk + j] = pos;
      r.slot_e[row * r.topk + j] = static_cast<int>(e);
    }
  }
}

// out[row, 8 columns per thread] = the row's expert outputs summed in increasing expert order (combine_row).
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const uint16_t* d, int64_t hidden, const int* slot_pos, const int* slot_e, int64_t topk,
                   float* out) {
  const int64_t row = blockIdx.x;
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * kCombineThreads + threadIdx.x) * 8;
  if (col >= hidden) return;
  float acc[8];
  combine_row(d, hidden, slot_pos + row * topk, slot_e + row * topk, topk, col, acc);
  float4* o = reinterpret_cast<float4*>(out + row * hidden + col);
  o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

}  // namespace

const char* local_experts_unsupported(const LocalExpertsArgs& a) {
  if (a.hidden % 128 != 0 || a.inter % 128 != 0) return "H and I must be multiples of 128";
  if (a.rows * a.topk >= (int64_t{1} << 31)) return "R * k must be below 2^31";
  if (a.x_group != 0 && a.inter % a.x_group != 0) return "I must be a multiple of the activation group";
  const LocalExpertsLayout l = local_experts_layout(a.rows, a.topk, a.num_local, a.hidden, a.inter, a.x_group);
  // The workspace operands are aligned by construction (nullptr stands for them here); this checks the caller's.
  if (const char* why = expert_gemm_unsupported(le_gemm1_args(a, l, nullptr))) return why;
  return expert_gemm_unsupported(le_gemm2_args(a, l, nullptr));
}

cudaError_t launch_local_experts(const LocalExpertsArgs& a, void* workspace, int64_t workspace_bytes,
                                 cudaStream_t stream) {
  if (local_experts_unsupported(a) != nullptr) return cudaErrorInvalidValue;
  if (a.rows == 0 || a.hidden == 0) return cudaSuccess;
  const LocalExpertsLayout l = local_experts_layout(a.rows, a.topk, a.num_local, a.hidden, a.inter, a.x_group);
  if (workspace_bytes < l.bytes || reinterpret_cast<uintptr_t>(workspace) % kLocalExpertsAlign != 0)
    return cudaErrorInvalidValue;
  uint8_t* ws = static_cast<uint8_t*>(workspace);

  // 1. route
  const RouteArgs r = le_route_args(a, l, ws);
  if (a.idx_int64) {
    if (a.weights_bf16)
      route_kernel<int64_t, true><<<1, kRouteThreads, 0, stream>>>(r);
    else
      route_kernel<int64_t, false><<<1, kRouteThreads, 0, stream>>>(r);
  } else {
    if (a.weights_bf16)
      route_kernel<int32_t, true><<<1, kRouteThreads, 0, stream>>>(r);
    else
      route_kernel<int32_t, false><<<1, kRouteThreads, 0, stream>>>(r);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  if (a.num_local > 0 && a.inter > 0 && l.max_pairs > 0) {
    // 2. GEMM1: h[pair] = x[pair_row[pair]] · W13ᵀ
    if ((err = launch_expert_gemm(le_gemm1_args(a, l, ws), stream)) != cudaSuccess) return err;
    // 3. z = swiglu_and_cast(h, pair weight): fp8 with x's group, or bf16 (SPEC §1.7)
    if ((err = launch_swiglu_and_cast(le_swiglu_args(a, l, ws), stream)) != cudaSuccess) return err;
    // 4. GEMM2: d[pair] = z[pair] · W2ᵀ (written over h, which is no longer needed)
    if ((err = launch_expert_gemm(le_gemm2_args(a, l, ws), stream)) != cudaSuccess) return err;
  }

  // 5. combine (also writes the zeros of rows no local expert serves)
  const dim3 grid(static_cast<unsigned>(a.rows),
                  static_cast<unsigned>((a.hidden / 8 + kCombineThreads - 1) / kCombineThreads));
  combine_kernel<<<grid, kCombineThreads, 0, stream>>>(reinterpret_cast<const uint16_t*>(ws + l.hd), a.hidden,
                                                       r.slot_pos, r.slot_e, a.topk, a.out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace static_moe
