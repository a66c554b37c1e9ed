// swiglu_and_cast CPU kernel (SPEC §1.4-1.5), torch-free: raw pointers, sizes and strides.
//
//   g = gate_up[r, :I], u = gate_up[r, I:] in fp32; with a limit L: g = min(g, L), u = clamp(u, -L, L)
//   v = act(g, u) * w[r], act by SPEC §1.9, each in the reference's rounding order:
//     silu        (g * sigmoid(g)) * u
//     swiglu_oai  (u + 1) * (g * sigmoid(g * alpha))
//     gelu_tanh   (g * sigmoid(kGeluTanh * (g + ((0.044715 * g) * g) * g))) * u     (0.5(1 + tanh y) = sigmoid(2y))
//   bf16 out: v -> bf16 (RNE)
//   fp8 out, per group of G columns: amax = max(max|v|, 1e-4); s = amax / fp8_max (rounded up to a power of
//            two with pow2_scale); q = e4m3fn(clamp(v / s, -fp8_max, fp8_max)) (RNE)
//
// Each row is computed on its own, by the same instruction sequence whatever the row count (batch invariance).
// Loops are written to auto-vectorise; sigmoid uses exp_approx below, within ~1 ulp of exp, so scales are
// bitwise those of the reference with power-of-two scales, and q bytes differ only where a 1-ulp difference in
// v crosses an fp8 rounding midpoint (SPEC §2 allows that).
#pragma once

#include "cpu/kernels/cast.h"

#include <cstdint>

namespace static_moe {
namespace cpu {

// exp(x) for float, accurate to about 1 ulp; no libm call, so loops over it vectorise. Cody-Waite reduction
// x = n*ln2 + r (|r| <= ln2/2, ln2 split in a 16-bit head whose product with n is exact, and a tail), then the
// degree-7 Taylor polynomial of e^r (truncation error < 2^-27 relative; 1.21 ulp worst case measured over
// every third float in [-86, 88.7]), then the exact scaling by 2^n built
// from the exponent bits. Arguments are clamped to [-86, 89]: below, the result stays a tiny normal number
// (callers only add it to 1); above, 2^(n-1) * p * 2 overflows to +inf as exp does. NaN propagates.
inline float exp_approx(float x) {
  x = x < -86.0f ? -86.0f : x;
  x = x > 89.0f ? 89.0f : x;
  // n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer and leaves n in the low mantissa bits.
  const float t = x * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  const int32_t ni = static_cast<int32_t>(float_bits(t) - 0x4B400000u);
  float r = x - n * 0.693145751953125f;    // ln2 head: 16 significant bits, so n * head is exact
  r = r - n * 1.42860682030941723212e-6f;  // ln2 tail
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as 2^(n-1) * 2 so that n = 128 (x near 88.7) still has a representable first factor.
  const float half_scale = bits_float(static_cast<uint32_t>(ni + 126) << 23);
  return (p * half_scale) * 2.0f;
}

inline float sigmoid_approx(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

// The activations of SPEC §1.9, as checks::Activation numbers them.
enum class Act : int { Silu = 0, SwigluOai = 1, GeluTanh = 2 };

constexpr float kGeluTanh = 1.5957691216057308f;  // 2 * sqrt(2 / pi): gelu_tanh(g) = g * sigmoid(kGeluTanh * ...)
constexpr float kGeluCubic = 0.044715f;

// act(g, u) of SPEC §1.9, unweighted; the rounding order of the reference (static_moe.activations.gated).
template <Act kAct>
inline float gated_value(float g, float u, float alpha) {
  if (kAct == Act::SwigluOai) return (u + 1.0f) * (g * sigmoid_approx(g * alpha));
  if (kAct == Act::GeluTanh) {
    const float y = kGeluTanh * (g + ((kGeluCubic * g) * g) * g);
    return (g * sigmoid_approx(y)) * u;
  }
  return (g * sigmoid_approx(g)) * u;
}

struct SwigluParams {
  int64_t rows = 0;
  int64_t inter = 0;              // I
  const void* gate_up = nullptr;  // [rows, 2I], bf16 bits (uint16) or float32, unit column stride
  bool gate_up_bf16 = false;
  int64_t gate_up_row_stride = 0;     // elements
  const float* row_weight = nullptr;  // [rows] or nullptr (weight 1)
  bool has_limit = false;
  float limit = 0.0f;
  Act act = Act::Silu;
  float alpha = 1.702f;  // swiglu_oai
  bool out_fp8 = true;
  int64_t group = 128;  // G (fp8 out)
  float fp8_max = 448.0f;
  bool pow2_scale = true;
  void* out = nullptr;     // [rows, I]: e4m3fn codes (uint8) or bf16 bits (uint16), contiguous rows
  float* scale = nullptr;  // [rows, I/G] contiguous (fp8 out)
};

constexpr float kAmaxFloor = 1e-4f;

// v[0, I) = the weighted SwiGLU of row r. Templated so the per-element loop has no branches.
template <bool kBf16In, bool kLimit, Act kAct>
inline void swiglu_row_values(const SwigluParams& p, int64_t r, float* v) {
  const int64_t I = p.inter;
  const float w = p.row_weight ? p.row_weight[r] : 1.0f;  // x * 1 == x exactly: same as not weighting
  const float lim = p.limit;
  const float alpha = p.alpha;
  if (kBf16In) {
    const uint16_t* g_row = static_cast<const uint16_t*>(p.gate_up) + r * p.gate_up_row_stride;
    const uint16_t* u_row = g_row + I;
    for (int64_t i = 0; i < I; ++i) {
      float g = bf16_to_float(g_row[i]);
      float u = bf16_to_float(u_row[i]);
      if (kLimit) {
        g = g > lim ? lim : g;
        u = u > lim ? lim : (u < -lim ? -lim : u);
      }
      v[i] = gated_value<kAct>(g, u, alpha) * w;
    }
  } else {
    const float* g_row = static_cast<const float*>(p.gate_up) + r * p.gate_up_row_stride;
    const float* u_row = g_row + I;
    for (int64_t i = 0; i < I; ++i) {
      float g = g_row[i];
      float u = u_row[i];
      if (kLimit) {
        g = g > lim ? lim : g;
        u = u > lim ? lim : (u < -lim ? -lim : u);
      }
      v[i] = gated_value<kAct>(g, u, alpha) * w;
    }
  }
}

template <Act kAct>
inline void swiglu_row_values_for(const SwigluParams& p, int64_t r, float* v) {
  if (p.gate_up_bf16) {
    if (p.has_limit)
      swiglu_row_values<true, true, kAct>(p, r, v);
    else
      swiglu_row_values<true, false, kAct>(p, r, v);
  } else {
    if (p.has_limit)
      swiglu_row_values<false, true, kAct>(p, r, v);
    else
      swiglu_row_values<false, false, kAct>(p, r, v);
  }
}

// Rows [r0, r1) end to end; v is scratch of I floats.
inline void swiglu_and_cast_rows(const SwigluParams& p, int64_t r0, int64_t r1, float* v) {
  const int64_t I = p.inter;
  for (int64_t r = r0; r < r1; ++r) {
    switch (p.act) {
      case Act::Silu:
        swiglu_row_values_for<Act::Silu>(p, r, v);
        break;
      case Act::SwigluOai:
        swiglu_row_values_for<Act::SwigluOai>(p, r, v);
        break;
      case Act::GeluTanh:
        swiglu_row_values_for<Act::GeluTanh>(p, r, v);
        break;
    }
    if (!p.out_fp8) {
      uint16_t* o = static_cast<uint16_t*>(p.out) + r * I;
      for (int64_t i = 0; i < I; ++i) o[i] = float_to_bf16(v[i]);
      continue;
    }
    const int64_t G = p.group;
    const float fmax = p.fp8_max;
    uint8_t* q_row = static_cast<uint8_t*>(p.out) + r * I;
    float* s_row = p.scale + r * (I / G);
    for (int64_t gi = 0; gi < I / G; ++gi) {
      const float* vg = v + gi * G;
      uint8_t* qg = q_row + gi * G;
      // max |v| on the bits: for non-negative floats integer order is numeric order, and a NaN (bits above
      // +inf) wins, as torch's amax propagates NaN.
      int32_t m = 0;
      for (int64_t j = 0; j < G; ++j) {
        const int32_t a = static_cast<int32_t>(float_bits(vg[j]) & 0x7FFFFFFFu);
        m = a > m ? a : m;
      }
      float amax = bits_float(static_cast<uint32_t>(m));
      amax = amax < kAmaxFloor ? kAmaxFloor : amax;
      float s = amax / fmax;
      if (p.pow2_scale) {
        s = round_up_pow2(s);
        const float inv = 1.0f / s;  // exact: s is a power of two well inside the normal range
        for (int64_t j = 0; j < G; ++j) {
          float q = vg[j] * inv;
          q = q > fmax ? fmax : (q < -fmax ? -fmax : q);
          qg[j] = float_to_e4m3fn(q);
        }
      } else {
        for (int64_t j = 0; j < G; ++j) {
          float q = vg[j] / s;
          q = q > fmax ? fmax : (q < -fmax ? -fmax : q);
          qg[j] = float_to_e4m3fn(q);
        }
      }
      s_row[gi] = s;
    }
  }
}

}  // namespace cpu
}  // namespace static_moe
