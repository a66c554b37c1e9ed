// CUDA swiglu_and_cast (SPEC §1.4-1.5). One warp per unit of one row: a group of G columns for fp8 output (G = 32:
// one value per lane; G = 128: four), or 128 columns for bf16 output. Lane l holds columns c0 + l + 32·e, so every
// load and store instruction of the warp touches consecutive addresses. The group amax is a warp shuffle
// reduction; each row's numbers never depend on other rows (batch invariance). Element math: swiglu_and_cast.cuh.
#include "cuda/device_info.h"
#include "cuda/swiglu_and_cast.h"
#include "cuda/swiglu_and_cast.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace static_moe {
namespace cuda {

namespace {

constexpr int kThreads = 256;

template <bool kBf16In>
__device__ inline float load_elem(const void* base, int64_t idx) {
  if constexpr (kBf16In)
    return bf16_bits_to_float(static_cast<const uint16_t*>(base)[idx]);
  else
    return static_cast<const float*>(base)[idx];
}

// EPL: values per lane (chunk = 32·EPL columns).
template <int EPL, bool kBf16In>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const SwigluArgs a) {
  constexpr int kChunk = 32 * EPL;
  const int lane = threadIdx.x & 31;
  const int64_t chunks = (a.inter + kChunk - 1) / kChunk;
  int64_t rows = a.rows;
  if (a.rows_dev != nullptr) rows = std::min<int64_t>(rows, *a.rows_dev);
  const int64_t units = rows * chunks;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t u = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; u < units; u += warps) {
    const int64_t r = u / chunks;
    const int64_t c0 = (u % chunks) * kChunk;
    float w = 1.0f;
    if (a.row_weight != nullptr)
      w = a.row_weight_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(a.row_weight)[r])
                            : static_cast<const float*>(a.row_weight)[r];
    const int64_t row0 = r * a.gate_up_row_stride;
    float v[EPL];
    uint32_t amax_bits = 0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int64_t col = c0 + lane + 32 * e;
      v[e] = 0.0f;
      if (col < a.inter) {
        const float g = load_elem<kBf16In>(a.gate_up, row0 + col);
        const float up = load_elem<kBf16In>(a.gate_up, row0 + a.inter + col);
        v[e] = swiglu_value(g, up, w, a.has_limit, a.limit, static_cast<Act>(a.act), a.alpha);
        const uint32_t b = f32_bits(v[e]) & 0x7FFFFFFFu;
        amax_bits = b > amax_bits ? b : amax_bits;
      }
    }
    if (!a.out_fp8) {
      uint16_t* out = static_cast<uint16_t*>(a.out) + r * a.out_row_stride;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const int64_t col = c0 + lane + 32 * e;
        if (col < a.inter) out[col] = float_to_bf16_bits(v[e]);
      }
      continue;
    }
    // fp8 output: the chunk is exactly one group (the launcher picks EPL = group / 32; I % group == 0).
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, amax_bits, o);
      amax_bits = other > amax_bits ? other : amax_bits;
    }
    const float s = group_scale(amax_bits, a.fp8_max, a.pow2_scale);
    uint8_t* out = static_cast<uint8_t*>(a.out) + r * a.out_row_stride;
#pragma unroll
    for (int e = 0; e < EPL; ++e) out[c0 + lane + 32 * e] = quantize_e4m3(v[e], s, a.fp8_max);
    if (lane == 0) a.scale[r * a.scale_row_stride + c0 / kChunk] = s;
  }
}

template <int EPL>
cudaError_t launch_epl(const SwigluArgs& a, cudaStream_t stream) {
  constexpr int kChunk = 32 * EPL;
  const int64_t units = a.rows * ((a.inter + kChunk - 1) / kChunk);
  cudaError_t err = cudaSuccess;
  const int sms = current_sm_count(&err);
  if (err != cudaSuccess) return err;
  // Enough warps to cover the units, capped at a few blocks per SM (the kernel loops over the rest).
  const int64_t blocks = std::min<int64_t>((units + kThreads / 32 - 1) / (kThreads / 32), int64_t{8} * sms);
  if (blocks <= 0) return cudaSuccess;
  if (a.gate_up_bf16)
    swiglu_kernel<EPL, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  else
    swiglu_kernel<EPL, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_swiglu_and_cast(const SwigluArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.inter == 0) return cudaSuccess;
  if (a.out_fp8) {
    if (a.group == 32 && a.inter % 32 == 0) return launch_epl<1>(a, stream);
    if (a.group == 128 && a.inter % 128 == 0) return launch_epl<4>(a, stream);
    return cudaErrorInvalidValue;
  }
  return launch_epl<4>(a, stream);
}

}  // namespace cuda
}  // namespace static_moe
