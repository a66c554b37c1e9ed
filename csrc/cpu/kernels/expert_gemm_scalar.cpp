// Portable instance of the expert GEMM (no SIMD): one lane, units of 2 k (one fp4 byte), natural k order.
// The fallback for CPUs without AVX2, and the plainest statement of the arithmetic the SIMD instances follow.
#include <cstddef>
#include <cstdint>

#include "cpu/kernels/cast.h"
#include "cpu/kernels/expert_gemm.h"
#include "cpu/kernels/expert_gemm_plan.h"
#include "cpu/kernels/expert_gemm_impl.h"

namespace static_moe {
namespace cpu {
namespace {

constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct V1 {
  static constexpr Isa kIsa = Isa::Scalar;
  using vec = float;
  static constexpr int W = 1;
  static constexpr int kMR = 4;
  static constexpr int kNR = 2;
  static constexpr int kNR1 = 4;
  // no panel: the fallback decodes in place
  static constexpr int kPanelMR = 4;
  static constexpr int kPanelNR = 0;

  static inline vec zero() { return 0.0f; }
  static inline vec load(const float* p) { return *p; }
  static inline void store(float* p, vec v) { *p = v; }
  static inline vec fma(vec a, vec b, vec c) { return a * b + c; }  // baseline x86-64: two roundings, no FMA
  static inline float reduce(vec v) { return v; }

  static inline void decode_bf16(const uint8_t* row, int64_t k0, vec& lo, vec& hi) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + k0;
    lo = bf16_to_float(p[0]);
    hi = bf16_to_float(p[1]);
  }
  static constexpr int64_t kScaleChunk = 512;

  static inline void fp8_scales(const float* s, int nb, float* out) {
    for (int i = 0; i < nb; ++i) out[i] = s[i];
  }
  static inline void fp4_scales(const uint8_t* s, int nb, float* out, uint32_t& bad) {
    for (int i = 0; i < nb; ++i) {
      bad |= s[i] == 0xFFu;
      out[i] = ue8m0_to_float(s[i]);
    }
  }
  static inline void decode_fp8(const uint8_t* row, int64_t k0, const float* s, vec& lo, vec& hi) {
    lo = e4m3fn_to_float(row[k0]) * *s;
    hi = e4m3fn_to_float(row[k0 + 1]) * *s;
  }
  static inline void decode_fp4(const uint8_t* row, int64_t k0, const float* s, vec& lo, vec& hi) {
    const uint8_t q = row[k0 >> 1];
    lo = kE2m1[q & 0xF] * *s;
    hi = kE2m1[q >> 4] * *s;
  }
};

}  // namespace

namespace scalar {

void prepare_activation(WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group, int64_t k,
                        float* out) {
  prepare_activation_impl<1>(wf, af, x, x_scale, group, k, out);
}

bool run(RowPath path, const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
         const OutRows& out) {
  return GemmKernels<V1>::run(path, a, m, w, n0, n1, out);
}

}  // namespace scalar
}  // namespace cpu
}  // namespace static_moe
