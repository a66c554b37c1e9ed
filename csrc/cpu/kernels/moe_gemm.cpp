// Instruction-set dispatch of the expert GEMM (moe_gemm.h). Compiled for baseline x86-64.
#include "cpu/kernels/moe_gemm.h"

namespace static_moe {
namespace cpu {

bool prepare_activation(Isa isa, WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group,
                        int64_t c0, int64_t k, float* row) {
  switch (isa) {
    case Isa::Avx512Bf16: return avx512bf16::prepare_activation(wf, af, x, x_scale, group, c0, k, row);
    case Isa::Avx512: avx512::prepare_activation(wf, af, x, x_scale, group, k, row + c0); return false;
    case Isa::Avx2: avx2::prepare_activation(wf, af, x, x_scale, group, k, row + c0); return false;
    case Isa::Scalar: break;
  }
  scalar::prepare_activation(wf, af, x, x_scale, group, k, row + c0);
  return false;
}

bool expert_gemm_rows(Isa isa, const float* const* a, const uint8_t* a_bf16, int64_t m, const ExpertWeight& w,
                      int64_t n0, int64_t n1, const OutRows& out) {
  switch (isa) {
    case Isa::Avx512Bf16: return avx512bf16::expert_gemm_rows(a, a_bf16, m, w, n0, n1, out);
    case Isa::Avx512: return avx512::expert_gemm_rows(a, m, w, n0, n1, out);
    case Isa::Avx2: return avx2::expert_gemm_rows(a, m, w, n0, n1, out);
    case Isa::Scalar: break;
  }
  return scalar::expert_gemm_rows(a, m, w, n0, n1, out);
}

}  // namespace cpu
}  // namespace static_moe
