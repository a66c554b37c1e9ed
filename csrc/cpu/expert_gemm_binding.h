// Torch-side glue shared by the CPU bindings of expert_gemm and local_experts (csrc/cpu/expert_gemm.cpp,
// csrc/cpu/local_experts.cpp): the ISA choice as a torch error, views of weight tensors for the torch-free GEMM
// core (csrc/cpu/kernels/expert_gemm.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "checks/common.h"
#include "cpu/kernels/expert_gemm.h"
#include "cpu/simd.h"

namespace static_moe {
namespace cpu {

// The instruction set for this call (STATIC_MOE_CPU_ISA may force one); a bad request is a ValueError.
inline Isa isa_for_call(const char* op) {
  Isa isa;
  const char* err = nullptr;
  TORCH_CHECK_VALUE(select_isa(&isa, &err), op, ": ", err);
  return isa;
}

inline WeightFormat kernel_weight_format(checks::Format f) {
  return f == checks::Format::FP8 ? WeightFormat::Fp8
                                  : (f == checks::Format::FP4 ? WeightFormat::Fp4 : WeightFormat::Bf16);
}

// A weight tensor [L, N, K] (fp4: [L, N, K/2] bytes) and its scales, ready for expert views: K contiguous (the
// one copy a strided weight costs), one-byte dtypes viewed as uint8.
struct WeightTensors {
  at::Tensor q;
  at::Tensor s;
  WeightFormat format = WeightFormat::Bf16;
  int64_t k = 0;
};

inline WeightTensors weight_tensors(const at::Tensor& w, const std::optional<at::Tensor>& scale, checks::Format f,
                                    int64_t k) {
  WeightTensors t;
  t.format = kernel_weight_format(f);
  t.k = k;
  // float4_e2m1fn_x2 / float8_e8m0fnu are viewed as uint8 first: torch copies (contiguous) need not support them.
  t.q = f == checks::Format::FP4 && w.scalar_type() != at::kByte ? w.view(at::kByte) : w;
  if (t.q.stride(2) != 1) t.q = t.q.contiguous();
  if (f != checks::Format::BF16) {
    t.s = f == checks::Format::FP4 && scale->scalar_type() != at::kByte ? scale->view(at::kByte) : *scale;
    if (t.s.stride(2) != 1) t.s = t.s.contiguous();
  }
  return t;
}

// Expert e of the tensors: rows of N weights, strides in bytes (data) and elements (scales).
inline ExpertWeight expert_view(const WeightTensors& t, int64_t e) {
  ExpertWeight w;
  w.format = t.format;
  w.n = t.q.size(1);
  w.k = t.k;
  const int64_t es = t.q.element_size();
  w.data = static_cast<const uint8_t*>(t.q.const_data_ptr()) + e * t.q.stride(0) * es;
  w.row_stride = t.q.stride(1) * es;
  if (t.s.defined()) {
    w.scale = static_cast<const uint8_t*>(t.s.const_data_ptr()) + e * t.s.stride(0) * t.s.element_size();
    w.scale_row_stride = t.s.stride(1);
  }
  return w;
}

}  // namespace cpu
}  // namespace static_moe
