// quantize_weight CPU kernel (SPEC §1.10), torch-free: raw pointers and sizes. The same arithmetic as the Python
// quantizers it must equal bit for bit (static_moe.formats.quantize_weight_fp8 / quantize_weight_fp4):
//
//   fp8, per 1x128 block:  amax = max(max|v|, 1e-4); s = round_up_pow2(amax / 448); q = e4m3fn(clamp(v / s, ±448))
//   fp4, per 1x32 block:   amax = max|v|; y = amax / 6 in float32; e = -127 if y == 0 (amax == 0, or at most
//                          3 * 2^-149 so that y underflows), else clamp(ceil(log2 y), -127, 127); byte = e + 127;
//                          code = e2m1(v / 2^e) (round-to-nearest-even, saturating at 6, sign of zero kept);
//                          element k in byte k/2, low nibble for even k
//
// v / s is computed as v * (1 / s): s is a power of two in [2^-127, 2^127], so 1 / s is exact and the product is
// the same correctly rounded number as the quotient (subnormal results included, the FPU's default mode).
// max|v| is taken on the bits (for non-negative floats integer order is numeric order), which also tells a block
// holding NaN or ±Inf (bits at or above the infinity's): such a block is counted, not quantized, and the caller
// raises (the reference raises on it too).
//
// Loops are written to auto-vectorise (the binding compiles this header once per instruction set).
#pragma once

#include "cpu/kernels/cast.h"

#include <cstdint>

namespace static_moe {
namespace cpu {

enum class QwIn : int { F32 = 0, Bf16 = 1 };

struct QuantizeWeightParams {
  int64_t rows = 0;         // rows of K elements (the product of the weight's leading dims)
  int64_t k = 0;            // K, a multiple of the block
  const void* w = nullptr;  // [rows, K] contiguous: float32, or bf16 bits (uint16)
  QwIn in = QwIn::F32;
  uint8_t* q = nullptr;   // fp8: [rows, K] e4m3fn codes; fp4: [rows, K/2] packed e2m1 codes
  void* scale = nullptr;  // fp8: float32 [rows, K/128]; fp4: uint8 UE8M0 [rows, K/32]
};

// Blocks holding NaN or ±Inf seen by one thread: how many, and the smallest flat block index (row * K/block + b).
struct BadBlocks {
  int64_t count = 0;
  int64_t first = INT64_MAX;
  void add(int64_t idx) {
    ++count;
    first = idx < first ? idx : first;
  }
};

constexpr int64_t kQwFp8Block = 128;
constexpr int64_t kQwFp4Block = 32;
constexpr uint32_t kF32AbsInf = 0x7F800000u;

// |v| bits of element j of a row, widened to float32 bits (bf16 -> float32 is a 16-bit shift).
template <QwIn kIn>
inline uint32_t qw_abs_bits(const void* row, int64_t j) {
  if (kIn == QwIn::Bf16) return (static_cast<uint32_t>(static_cast<const uint16_t*>(row)[j]) << 16) & 0x7FFFFFFFu;
  return float_bits(static_cast<const float*>(row)[j]) & 0x7FFFFFFFu;
}

template <QwIn kIn>
inline float qw_value(const void* row, int64_t j) {
  if (kIn == QwIn::Bf16) return bf16_to_float(static_cast<const uint16_t*>(row)[j]);
  return static_cast<const float*>(row)[j];
}

template <QwIn kIn>
inline const void* qw_offset(const void* base, int64_t elems) {
  if (kIn == QwIn::Bf16) return static_cast<const uint16_t*>(base) + elems;
  return static_cast<const float*>(base) + elems;
}

// Largest |v| bits of n elements (n a compile-time block size, so the loop vectorises fully).
template <QwIn kIn, int64_t kN>
inline uint32_t qw_block_max_bits(const void* blk) {
  uint32_t m = 0;
  for (int64_t j = 0; j < kN; ++j) {
    const uint32_t a = qw_abs_bits<kIn>(blk, j);
    m = a > m ? a : m;
  }
  return m;
}

// fp8 1x128 of rows [r0, r1).
template <QwIn kIn>
inline void quantize_fp8_rows(const QuantizeWeightParams& p, int64_t r0, int64_t r1, BadBlocks* bad) {
  const int64_t K = p.k, nb = K / kQwFp8Block;
  float* scale = static_cast<float*>(p.scale);
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = qw_offset<kIn>(p.w, r * K);
    uint8_t* q_row = p.q + r * K;
    for (int64_t b = 0; b < nb; ++b) {
      const void* blk = qw_offset<kIn>(row, b * kQwFp8Block);
      uint8_t* qb = q_row + b * kQwFp8Block;
      const uint32_t m = qw_block_max_bits<kIn, kQwFp8Block>(blk);
      if (m >= kF32AbsInf) {
        bad->add(r * nb + b);
        continue;
      }
      float amax = bits_float(m);
      amax = amax < 1e-4f ? 1e-4f : amax;
      const float s = round_up_pow2(amax / 448.0f);
      const float inv = 1.0f / s;  // exact: s is a power of two in [2^-22, 2^120]
      for (int64_t j = 0; j < kQwFp8Block; ++j) {
        float v = qw_value<kIn>(blk, j) * inv;
        v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);
        qb[j] = float_to_e4m3fn(v);
      }
      scale[r * nb + b] = s;
    }
  }
}

// The UE8M0 exponent e of a 1x32 block from its largest |v| bits m (finite), as the reference computes it:
// e = -127 when y = amax / 6 is 0 in float32, else clamp(ceil(log2 y), -127, 127) with frexp's view of y.
inline int32_t fp4_block_exponent(uint32_t m) {
  if (m == 0) return -127;
  const uint32_t y = float_bits(bits_float(m) / 6.0f);
  const int32_t ey = static_cast<int32_t>(y >> 23);
  const uint32_t my = y & 0x7FFFFFu;
  int32_t c;
  if (ey != 0) {
    c = my == 0 ? ey - 127 : ey - 126;  // y = 1.m * 2^(ey-127): a power of two is its own ceiling
  } else if (my == 0) {
    c = -127;  // y rounded to 0 (amax at most 3 * 2^-149): as amax == 0, the clamp's lower end
  } else {
    c = my > (1u << 22) ? -126 : -127;  // subnormal y = my * 2^-149 < 2^-126: its ceiling is -126 or at most -127
  }
  return c < -127 ? -127 : (c > 127 ? 127 : c);
}

// 2^-e as a float, exactly, for e in [-127, 127] (2^-127 is subnormal).
inline float pow2_neg(int32_t e) {
  const int32_t t = 127 - e;  // biased exponent of 2^-e
  return t > 0 ? bits_float(static_cast<uint32_t>(t) << 23) : bits_float(0x00400000u);
}

// e2m1 code of one float (RNE on the grid 0, .5, 1, 1.5, 2, 3, 4, 6; saturating; sign of zero kept): the
// reference's thresholds, counted instead of chained so the loop has no branches.
inline uint8_t e2m1_code(float v) {
  const uint32_t u = float_bits(v);
  const float a = bits_float(u & 0x7FFFFFFFu);
  const uint32_t code =
      7u - (a <= 5.0f) - (a < 3.5f) - (a <= 2.5f) - (a < 1.75f) - (a <= 1.25f) - (a < 0.75f) - (a <= 0.25f);
  return static_cast<uint8_t>(code | ((u >> 28) & 8u));
}

// fp4 1x32 of rows [r0, r1).
template <QwIn kIn>
inline void quantize_fp4_rows(const QuantizeWeightParams& p, int64_t r0, int64_t r1, BadBlocks* bad) {
  const int64_t K = p.k, nb = K / kQwFp4Block;
  uint8_t* scale = static_cast<uint8_t*>(p.scale);
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = qw_offset<kIn>(p.w, r * K);
    uint8_t* q_row = p.q + r * (K / 2);
    for (int64_t b = 0; b < nb; ++b) {
      const void* blk = qw_offset<kIn>(row, b * kQwFp4Block);
      uint8_t* qb = q_row + b * (kQwFp4Block / 2);
      const uint32_t m = qw_block_max_bits<kIn, kQwFp4Block>(blk);
      if (m >= kF32AbsInf) {
        bad->add(r * nb + b);
        continue;
      }
      const int32_t e = fp4_block_exponent(m);
      const float inv = pow2_neg(e);
      // Codes first (a unit-stride loop that vectorises), then the nibble pairs.
      uint8_t codes[kQwFp4Block];
      for (int64_t j = 0; j < kQwFp4Block; ++j) codes[j] = e2m1_code(qw_value<kIn>(blk, j) * inv);
      for (int64_t j = 0; j < kQwFp4Block / 2; ++j)
        qb[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
      scale[r * nb + b] = static_cast<uint8_t>(e + 127);
    }
  }
}

template <QwIn kIn>
inline void quantize_weight_rows(const QuantizeWeightParams& p, bool fp4, int64_t r0, int64_t r1, BadBlocks* bad) {
  if (fp4)
    quantize_fp4_rows<kIn>(p, r0, r1, bad);
  else
    quantize_fp8_rows<kIn>(p, r0, r1, bad);
}

}  // namespace cpu
}  // namespace static_moe
