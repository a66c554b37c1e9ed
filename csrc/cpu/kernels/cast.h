// Exact scalar conversions between float32 and the narrow formats of SPEC §1, torch-free and branch-light so that
// loops over them auto-vectorise. Each matches torch's own conversion bit for bit (tests/ops/test_swiglu_and_cast.py
// sweeps them against torch over many floats through the kernels that use them):
//   float -> float8_e4m3fn   round-to-nearest-even; saturating like torch's cast: |x| > 464 (the midpoint above
//                            448) and inf give +-448 (0x7E), NaN gives 0x7F with the input's sign
//   float -> bfloat16        round-to-nearest-even; NaN gives 0xFFFF, as torch's CPU cast does
//   power-of-two round-up    from the float's bits (SPEC §1.1: UE8M0-style scale)
#pragma once

#include <cstdint>
#include <cstring>

namespace static_moe {
namespace cpu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> float8_e4m3fn code (RNE). e4m3fn: bias 7, 3 mantissa bits, no inf, 0x7F/0xFF are NaN, max 448.
inline uint8_t float_to_e4m3fn(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal results (|f| >= 2^-6): round the 23-bit mantissa to 3 bits, ties to even; a carry out of the
  // mantissa bumps the exponent, which is what we want. Rebias 127 -> 7 by subtracting (127 - 7) << 23.
  const uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);
  const uint32_t normal = ((rounded - (120u << 23)) >> 20) & 0x7Fu;
  // Subnormal results (|f| < 2^-6): multiples of 2^-9. |f| * 512 < 8 is exact; adding and subtracting 2^23
  // rounds it to an integer with ties to even (default rounding mode), giving the code 0..8 (8 = 2^-6, the
  // smallest normal, whose code is 0x08 too).
  const float k = (bits_float(a) * 512.0f + 8388608.0f) - 8388608.0f;
  const uint32_t sub = static_cast<uint32_t>(k);
  uint32_t code = a < (121u << 23) ? sub : normal;
  code = a > 0x43E80000u ? 0x7Eu : code;  // > 464.0, inf: saturate to 448
  code = a > 0x7F800000u ? 0x7Fu : code;  // NaN
  return static_cast<uint8_t>(code | sign);
}

// float32 -> bfloat16 bits (RNE; NaN -> 0xFFFF like torch's CPU cast).
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0xFFFFu) : static_cast<uint16_t>(r);
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Positive normal float -> the smallest power of two >= it, exactly (keeps powers of two). Same bit arithmetic as
// formats.round_up_pow2, so even a NaN scale maps to the same bits (-0.0) as the reference.
inline float round_up_pow2(float s) {
  const uint32_t u = float_bits(s);
  const uint32_t e = ((u >> 23) & 0xFFu) + ((u & 0x7FFFFFu) != 0u ? 1u : 0u);
  return bits_float(e << 23);
}

}  // namespace cpu
}  // namespace static_moe
