// AVX2 + FMA + F16C instance of the expert GEMM: 8 fp32 lanes, units of 16 k per weight row.
//   bf16 and fp8 weights: as the AVX-512 instance (expert_gemm_avx512.cpp), 16 values per unit, NaN codes included.
//   fp4 weights: 8 packed bytes -> 8 dword indices; vpermps has only 8 entries, so it looks up the magnitude
//                (low 3 bits, table already times the block's power-of-two scale) and the sign bit 3 is moved to
//                bit 31 and xor-ed in (e2m1 is sign-magnitude, -0 included).
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
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")

#include "cpu/kernels/expert_gemm_impl.h"

namespace static_moe {
namespace cpu {
namespace {

struct V256 {
  static constexpr Isa kIsa = Isa::Avx2;
  using vec = __m256;
  static constexpr int W = 8;
  static constexpr int kMR = 4;
  static constexpr int kNR = 2;
  static constexpr int kNR1 = 4;
  // 4 x 3 from a decoded panel: 12 accumulators, 3 weight vectors and one activation vector of 16 registers
  static constexpr int kPanelMR = 4;
  static constexpr int kPanelNR = 3;

  static inline vec zero() { return _mm256_setzero_ps(); }
  static inline vec load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float reduce(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  static inline void decode_bf16(const uint8_t* row, int64_t k0, vec& lo, vec& hi) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + k0;
    const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
  }

  static constexpr int64_t kScaleChunk = 512;

  // out[i] = s[i] · 2^8 (see decode_fp8), i < nb.
  static inline void fp8_scales(const float* s, int nb, float* out) {
    for (int i = 0; i < nb; ++i) out[i] = s[i] * 256.0f;
  }

  // out[i] = 2^(b_i - 127) exactly, i < nb; bad |= any b_i == 255.
  static inline void fp4_scales(const uint8_t* s, int nb, float* out, uint32_t& bad) {
    for (int i = 0; i < nb; ++i) {
      bad |= s[i] == 0xFFu;
      out[i] = ue8m0_to_float(s[i]);
    }
  }

  static inline void decode_fp8(const uint8_t* row, int64_t k0, const float* s, vec& lo, vec& hi) {
    const __m256 sv = _mm256_set1_ps(*s);
    const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0)));
    __m256i t = _mm256_and_si256(_mm256_slli_epi16(q, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    // The NaN codes 0x7F / 0xFF (low 7 bits all ones) get the fp16 NaN exponent; the shift alone gives ±480.
    const __m256i low7 = _mm256_set1_epi16(0x7F);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(q, low7), low7);
    t = _mm256_or_si256(t, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
    lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(t)), sv);
    hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(t, 1)), sv);
  }

  static inline void decode_fp4(const uint8_t* row, int64_t k0, const float* s, vec& lo, vec& hi) {
    const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256 lut = _mm256_mul_ps(table, _mm256_set1_ps(*s));
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (k0 >> 1))));
    const __m256i s_lo = _mm256_and_si256(_mm256_slli_epi32(idx, 28), sign);
    const __m256i s_hi = _mm256_and_si256(_mm256_slli_epi32(idx, 24), sign);
    lo = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, idx), _mm256_castsi256_ps(s_lo));
    hi = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, _mm256_srli_epi32(idx, 4)), _mm256_castsi256_ps(s_hi));
  }
};

}  // namespace

namespace avx2 {

void prepare_activation(WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group, int64_t k,
                        float* out) {
  prepare_activation_impl<V256::W>(wf, af, x, x_scale, group, k, out);
}

bool run(RowPath path, const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
         const OutRows& out) {
  return GemmKernels<V256>::run(path, a, m, w, n0, n1, out);
}

}  // namespace avx2
}  // namespace cpu
}  // namespace static_moe

#pragma GCC pop_options
