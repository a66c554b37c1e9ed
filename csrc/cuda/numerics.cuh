// Exact number-format conversions used by the CUDA kernels (SPEC §1), torch-free.
//
// Every function here is __host__ __device__, so tests/cuda/host/ runs the very same code on the CPU and checks it
// bit for bit against torch (tests/cuda/test_cuda_host.py), even where no GPU is present.
//
//   e4m3fn pair     -> bf16 pair   exact (every e4m3 value is a bf16 value), via the fp16 route of cuda_fp8.h
//   e2m1 nibble     -> bf16        exact, from the bits (no table)
//   8 e2m1 nibbles  -> 8 e4m3 bytes holding value * 2^-6, exact (e2m1 sits inside e4m3's grid once the exponent
//                      is moved down by 6); the tensor-core kernels multiply their fp32 partial sums by 2^6
//   UE8M0 byte      -> float 2^(b-127) (byte 0 is the subnormal 2^-127)
//   float           -> e4m3fn (RNE, saturating: callers clamp to +-fp8_max first) and -> bf16 (RNE)
//   power-of-two round-up of a float scale, from its bits (the same arithmetic as formats.round_up_pow2)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

// `STATIC_MOE_UNROLL` for code that also compiles for the host (where gcc would warn about the unknown pragma).
#ifndef STATIC_MOE_UNROLL
#ifdef __CUDA_ARCH__
#define STATIC_MOE_UNROLL _Pragma("unroll")
#else
#define STATIC_MOE_UNROLL
#endif
#endif

namespace static_moe {
namespace cuda {

__host__ __device__ inline uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// a · b and a + b rounded once each: on the device the _rn intrinsics, which nvcc never contracts into an FMA, so
// device code rounds exactly as the same code compiled for the host (tests/cuda/host/).
__host__ __device__ inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

__host__ __device__ inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

__host__ __device__ inline float bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// PTX prmt (default mode) / __byte_perm: byte i of the result is byte s[4i+2:4i] of the 8-byte value {b, a}
// (a = bytes 0..3). Selectors used here never set bit 3 of a nibble.
__host__ __device__ inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, s);
#else
  const uint64_t v = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t idx = (s >> (4 * i)) & 7u;
    r |= static_cast<uint32_t>((v >> (8 * idx)) & 0xFFu) << (8 * i);
  }
  return r;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Decoders (weights and activations into tensor-core operands)
// ---------------------------------------------------------------------------------------------------------------

// Two e4m3fn codes (byte 0 = first element) -> two bf16 in one register (low half = first element). Exact: e4m3 ->
// fp16 is exact (hardware cvt on sm_89+, cuda_fp8.h's software path elsewhere), fp16 -> fp32 is exact, and an
// e4m3 value has at most 4 significant bits, so the top 16 bits of its fp32 are its bf16.
__host__ __device__ inline uint32_t e4m3x2_to_bf16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  __half2 hh;
  hh = h;
  const float2 f = __half22float2(hh);
  return byte_perm(f32_bits(f.x), f32_bits(f.y), 0x7632u);
}

// 8 e4m3fn codes (bytes of lo, then hi) -> 8 bf16 in r[0..3], natural order (r[i] = elements 2i, 2i+1).
__host__ __device__ inline void e4m3x8_to_bf16x8(uint32_t lo, uint32_t hi, uint32_t (&r)[4]) {
  r[0] = e4m3x2_to_bf16x2(lo);
  r[1] = e4m3x2_to_bf16x2(lo >> 16);
  r[2] = e4m3x2_to_bf16x2(hi);
  r[3] = e4m3x2_to_bf16x2(hi >> 16);
}

// One e2m1 code (bit 3 sign, bits 2..0 magnitude code e1 e0 m) -> bf16 bits, exactly.
// Magnitude code c >= 2 is 2^(e-1) * (1 + m/2): bf16 exponent e + 126 and mantissa top bit m, which is (c + 252) << 6
// since c = 2e + m. Code 1 is 0.5 (bf16 0x3F00 = 252 << 6); code 0 is zero (sign kept: -0 stays -0).
__host__ __device__ inline uint32_t e2m1_to_bf16_bits(uint32_t code) {
  const uint32_t c = code & 7u;
  const uint32_t mag = (c + 252u - (c == 1u ? 1u : 0u)) << 6;
  return (c != 0u ? mag : 0u) | ((code & 8u) << 12);
}

// 8 packed e2m1 values (4 bytes; element 2i in the low nibble of byte i, 2i+1 in its high nibble, SPEC §1.2) ->
// 8 bf16 in r[0..3], natural order.
__host__ __device__ inline void e2m1x8_to_bf16x8(uint32_t x, uint32_t (&r)[4]) {
  STATIC_MOE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const uint32_t byte = (x >> (8 * i)) & 0xFFu;
    r[i] = e2m1_to_bf16_bits(byte & 0xFu) | (e2m1_to_bf16_bits(byte >> 4) << 16);
  }
}

// 8 packed e2m1 values -> 8 e4m3fn bytes (lo = elements 0..3, hi = 4..7) whose values are the e2m1 values times
// 2^-6, exactly: code (s e1 e0 m) becomes byte (s 0 0 e1 e0 m 0 0), i.e. e4m3 exponent field e and mantissa 4m:
// 2^(e-7) * (1 + m/2) for e >= 1 and the e4m3 subnormal 2^-6 * m/2 for e = 0. Integer ops only.
__host__ __device__ inline void e2m1x8_to_e4m3x8_scaled(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t ev = x & 0x0F0F0F0Fu;         // elements 0, 2, 4, 6, one code per byte
  const uint32_t od = (x >> 4) & 0x0F0F0F0Fu;  // elements 1, 3, 5, 7
  const uint32_t ee = ((ev & 0x08080808u) << 4) | ((ev & 0x07070707u) << 2);
  const uint32_t oe = ((od & 0x08080808u) << 4) | ((od & 0x07070707u) << 2);
  lo = byte_perm(ee, oe, 0x5140u);  // e0 e1 e2 e3
  hi = byte_perm(ee, oe, 0x7362u);  // e4 e5 e6 e7
}

// What e2m1x8_to_e4m3x8_scaled multiplies by: the kernels multiply their fp32 partial sums by this to undo it
// (not the scale: 2^(b-127) · 2^6 overflows fp32 for UE8M0 bytes 253 and 254).
constexpr float kE2m1InE4m3Factor = 64.0f;

// UE8M0 exponent byte -> 2^(b-127) as float. b = 0 is the subnormal 2^-127; b = 255 gives +inf, like the
// reference's ldexp (the loaders reject 255).
__host__ __device__ inline float ue8m0_to_float(uint32_t b) { return bits_f32(b == 0u ? 0x00400000u : (b << 23)); }

// ---------------------------------------------------------------------------------------------------------------
// Encoders (swiglu_and_cast outputs)
// ---------------------------------------------------------------------------------------------------------------

// float -> e4m3fn code, round-to-nearest-even. Callers clamp to +-fp8_max (<= 448) first, so saturation never
// triggers except for NaN, which gives the NaN code.
__host__ __device__ inline uint8_t float_to_e4m3(float f) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}

// float -> bf16 bits, round-to-nearest-even.
__host__ __device__ inline uint16_t float_to_bf16_bits(float f) {
  const __nv_bfloat16 b = __float2bfloat16_rn(f);
  return static_cast<__nv_bfloat16_raw>(b).x;
}

__host__ __device__ inline float bf16_bits_to_float(uint32_t h) { return bits_f32((h & 0xFFFFu) << 16); }

// Smallest power of two >= s for a positive normal float, from the bits (formats.round_up_pow2).
__host__ __device__ inline float round_up_pow2(float s) {
  const uint32_t u = f32_bits(s);
  const uint32_t e = ((u >> 23) & 0xFFu) + ((u & 0x7FFFFFu) != 0u ? 1u : 0u);
  return bits_f32(e << 23);
}

}  // namespace cuda
}  // namespace static_moe
