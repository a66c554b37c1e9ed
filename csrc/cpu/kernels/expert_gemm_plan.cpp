// Instruction-set dispatch of the expert GEMM (expert_gemm.h). Compiled for baseline x86-64.
#include "cpu/kernels/expert_gemm.h"

#include <algorithm>

namespace static_moe {
namespace cpu {

bool prepare_activation(Isa isa, WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group,
                        int64_t c0, int64_t k, float* row) {
  switch (isa) {
    case Isa::Amx:
    case Isa::Avx512Bf16: return avx512bf16::prepare_activation(wf, af, x, x_scale, group, c0, k, row);
    case Isa::Avx512: avx512::prepare_activation(wf, af, x, x_scale, group, k, row + c0); return false;
    case Isa::Avx2: avx2::prepare_activation(wf, af, x, x_scale, group, k, row + c0); return false;
    case Isa::Scalar: break;
  }
  scalar::prepare_activation(wf, af, x, x_scale, group, k, row + c0);
  return false;
}

bool expert_gemm_rows(Isa isa, const float* const* a, const uint8_t* a_bf16, int64_t m, const ExpertWeight& w,
                      int64_t n0, int64_t n1, const OutRows& out, const TileRows* tiles) {
  switch (isa) {
    case Isa::Amx: return amx::expert_gemm_rows(a, a_bf16, m, w, n0, n1, out, tiles);
    case Isa::Avx512Bf16: return avx512bf16::expert_gemm_rows(a, a_bf16, m, w, n0, n1, out);
    case Isa::Avx512: return avx512::expert_gemm_rows(a, m, w, n0, n1, out);
    case Isa::Avx2: return avx2::expert_gemm_rows(a, m, w, n0, n1, out);
    case Isa::Scalar: break;
  }
  return scalar::expert_gemm_rows(a, m, w, n0, n1, out);
}

void TileRows::pack(const float* const* a, const uint8_t* a_bf16, int64_t m, int64_t k) {
  std::vector<const uint32_t*> src;  // the bf16 rows, as pairs of bf16 words
  for (int64_t i = 0; i < m; ++i)
    if (a_bf16 == nullptr || a_bf16[i] != 0) src.push_back(reinterpret_cast<const uint32_t*>(a[i]));
  rows_ = static_cast<int64_t>(src.size());
  k_ = k;
  const int64_t groups = (rows_ + 15) / 16, units = k / 32;
  const int64_t words = groups * units * 256 + 16;  // + 16: room to align the base to 64 bytes
  if (words > capacity_) {
    buf_.reset(new uint32_t[static_cast<size_t>(words)]);
    capacity_ = words;
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf_.get());
  base_ = buf_.get() + ((64 - p % 64) % 64) / sizeof(uint32_t);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = std::min<int64_t>(16, rows_ - 16 * g);
    for (int64_t u = 0; u < units; ++u) {
      uint32_t* d = base_ + (g * units + u) * 256;
      for (int64_t kp = 0; kp < 16; ++kp)
        for (int64_t i = 0; i < rows; ++i) d[kp * 16 + i] = src[16 * g + i][u * 16 + kp];
    }
  }
}

}  // namespace cpu
}  // namespace static_moe
