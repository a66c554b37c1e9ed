// The other build's entry point for bench/micro/kernel_ab.cpp: compiled with the other revision's kernels and
// -Dstatic_moe=static_moe_b, so that its types and functions live in a namespace of their own.
#include "cpu/kernels/expert_gemm.h"

extern "C" bool kernel_ab_other(int isa, const float* const* a, const uint8_t* a_bf16, int64_t m, const void* w,
                                int64_t n0, int64_t n1, const void* out) {
  using namespace static_moe::cpu;  // static_moe_b::cpu here
  return expert_gemm_rows(static_cast<Isa>(isa), a, a_bf16, m, *static_cast<const ExpertWeight*>(w), n0, n1,
                          *static_cast<const OutRows*>(out));
}
