// AVX-512 (F+BW+DQ+VL) instance of the expert GEMM: 16 fp32 lanes, units of 32 k per weight row.
//   bf16 weights: zero-extend to 32 bits and shift into the fp32 high half.
//   fp8 weights:  e4m3fn byte -> fp16 bits with one sign-extend, shift and mask (sign, then exponent and mantissa
//                 moved down so the value is q·2^-8, subnormals included), vcvtph2ps, then · (s·2^8): q·2^-8 and
//                 s·2^8 are exact, so the product is q·s rounded once, as the reference (for scales below 2^120;
//                 larger ones, absurd for weights, overflow s·2^8 to inf). The NaN codes 0x7F / 0xFF get the fp16
//                 NaN exponent (the shift alone would make them ±480).
//   fp4 weights:  16 packed bytes -> 16 dword indices; vpermps on a 16-entry table of e2m1 values already times
//                 the block's power-of-two scale (exact) gives the even columns, and again on index >> 4 the odd
//                 ones (vpermps only reads the low 4 bits of each index).
// GCC 12 flags the intrinsics headers' own `__m512i __Y = __Y;` placeholders wherever they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "cpu/kernels/cast.h"
#include "cpu/kernels/expert_gemm.h"
#include "cpu/kernels/expert_gemm_plan.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2")

#include "cpu/kernels/expert_gemm_impl.h"

namespace static_moe {
namespace cpu {
namespace {

struct V512 {
  static constexpr Isa kIsa = Isa::Avx512;
  using vec = __m512;
  static constexpr int W = 16;
  static constexpr int kMR = 4;
  static constexpr int kNR = 4;
  static constexpr int kNR1 = 8;
  // 4 x 6 from a decoded panel: 24 accumulators, 6 weight vectors and one activation vector of 32 registers
  static constexpr int kPanelMR = 4;
  static constexpr int kPanelNR = 6;

  static inline vec zero() { return _mm512_setzero_ps(); }
  static inline vec load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float reduce(vec v) { return _mm512_reduce_add_ps(v); }

  static inline void decode_bf16(const uint8_t* row, int64_t k0, vec& lo, vec& hi) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + k0;
    const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  }

  static constexpr int64_t kScaleChunk = 512;  // 16 fp4 blocks: one 16-byte load of UE8M0 bytes per row

  // out[i] = s[i] · 2^8 (see decode_fp8), i < nb <= 4.
  static inline void fp8_scales(const float* s, int nb, float* out) {
    for (int i = 0; i < nb; ++i) out[i] = s[i] * 256.0f;
  }

  // out[i] = 2^(b_i - 127) exactly (b = 0: the subnormal 2^-127), i < nb <= 16; bad |= any b_i == 255.
  static inline void fp4_scales(const uint8_t* s, int nb, float* out, uint32_t& bad) {
    const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1u);
    const __m128i b = _mm_maskz_loadu_epi8(live, s);
    bad |= _mm_mask_cmpeq_epi8_mask(live, b, _mm_set1_epi8(-1)) != 0;
    const __m512i d = _mm512_cvtepu8_epi32(b);
    const __m512i bits = _mm512_mask_mov_epi32(
        _mm512_slli_epi32(d, 23), _mm512_cmpeq_epi32_mask(d, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    _mm512_storeu_ps(out, _mm512_castsi512_ps(bits));
  }

  static inline void decode_fp8(const uint8_t* row, int64_t k0, const float* s, vec& lo, vec& hi) {
    const __m512 sv = _mm512_set1_ps(*s);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k0));
    __m512i t = _mm512_cvtepi8_epi16(q);
    t = _mm512_and_si512(_mm512_slli_epi16(t, 7), _mm512_set1_epi16(static_cast<short>(0xBF80)));
    // The NaN codes 0x7F / 0xFF land on 1.875·2^7 (480 after the scale): set the fp16 exponent to all ones (NaN).
    // Their bits are 0x3F80 | sign, so adding 0x4000 in those lanes gives 0x7F80 | sign (= t | 0x7C00) in one
    // masked instruction.
    const __mmask32 nan = _mm256_cmpeq_epi8_mask(_mm256_and_si256(q, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x7F));
    t = _mm512_mask_add_epi16(t, nan, t, _mm512_set1_epi16(0x4000));
    lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(t)), sv);
    hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(t, 1)), sv);
  }

  static inline void decode_fp4(const uint8_t* row, int64_t k0, const float* s, vec& lo, vec& hi) {
    const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                        -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512 lut = _mm512_mul_ps(table, _mm512_set1_ps(*s));
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (k0 >> 1))));
    lo = _mm512_permutexvar_ps(idx, lut);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut);
  }
};

}  // namespace

namespace avx512 {

void prepare_activation(WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group, int64_t k,
                        float* out) {
  prepare_activation_impl<V512::W>(wf, af, x, x_scale, group, k, out);
}

bool run(RowPath path, const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
         const OutRows& out) {
  return GemmKernels<V512>::run(path, a, m, w, n0, n1, out);
}

}  // namespace avx512
}  // namespace cpu
}  // namespace static_moe

#pragma GCC pop_options
