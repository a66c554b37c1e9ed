// Element math of swiglu_and_cast (SPEC §1.4-1.5), __host__ __device__ so tests/cuda/host/ checks it on the CPU:
//
//   g = gate, u = up (fp32); with a limit L: g = min(g, L), u = clamp(u, -L, L)
//   v = act(g, u) · w, act by SPEC §1.9 in the reference's rounding order (sigmoid(y) = 1 / (1 + exp(-y))):
//     silu        (g · sigmoid(g)) · u
//     swiglu_oai  (u + 1) · (g · sigmoid(g · alpha))
//     gelu_tanh   (g · sigmoid(kGeluTanh · (g + ((0.044715 · g) · g) · g))) · u
//   Adds and multiplies are the _rn intrinsics on the device, so nvcc does not contract them into FMAs and the
//   device rounds exactly as this code does on the host (tests/cuda/host/).
//   fp8 group of G values: amax = max(max |v|, 1e-4); s = amax / fp8_max, rounded up to a power of two with
//   pow2_scale; q = e4m3fn(clamp(v / s, -fp8_max, fp8_max)), round-to-nearest-even.
//
// amax is taken on the float bits (for non-negative floats integer order is numeric order, and a NaN, whose bits are
// above +inf, wins, as torch's amax propagates NaN). exp is the accurate expf (no fast-math), so v is within an ulp
// or two of torch's and the power-of-two scales come out bitwise equal (SPEC §2).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/numerics.cuh"

namespace static_moe {
namespace cuda {

constexpr float kSwigluAmaxFloor = 1e-4f;

// The activations of SPEC §1.9, numbered as checks::Activation.
enum class Act : int { kSilu = 0, kSwigluOai = 1, kGeluTanh = 2 };
constexpr float kGeluTanh = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

__host__ __device__ inline float sigmoid_f32(float y) { return 1.0f / (1.0f + expf(-y)); }

__host__ __device__ inline float swiglu_value(float g, float u, float w, bool has_limit, float limit,
                                              Act act = Act::kSilu, float alpha = 1.702f) {
  if (has_limit) {
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
  }
  float v;
  if (act == Act::kSwigluOai) {
    v = mul_rn(add_rn(u, 1.0f), mul_rn(g, sigmoid_f32(mul_rn(g, alpha))));
  } else if (act == Act::kGeluTanh) {
    const float y = mul_rn(kGeluTanh, add_rn(g, mul_rn(mul_rn(mul_rn(kGeluCubic, g), g), g)));
    v = mul_rn(mul_rn(g, sigmoid_f32(y)), u);
  } else {
    v = mul_rn(mul_rn(g, sigmoid_f32(g)), u);
  }
  return mul_rn(v, w);
}

// Scale of a group whose largest |v| has the float bits `amax_bits` (sign cleared).
__host__ __device__ inline float group_scale(uint32_t amax_bits, float fp8_max, bool pow2_scale) {
  float amax = bits_f32(amax_bits);
  amax = amax < kSwigluAmaxFloor ? kSwigluAmaxFloor : amax;
  const float s = amax / fp8_max;
  return pow2_scale ? round_up_pow2(s) : s;
}

__host__ __device__ inline uint8_t quantize_e4m3(float v, float s, float fp8_max) {
  float q = v / s;
  q = q > fp8_max ? fp8_max : (q < -fp8_max ? -fp8_max : q);
  return float_to_e4m3(q);
}

}  // namespace cuda
}  // namespace static_moe
