// Binding-side helper shared by the CUDA expert_gemm and local_experts bindings: the raw pointers and strides the
// torch-free launchers take for one expert weight tensor and its scales (SPEC §1.2 layouts, "EOI" [L, N, K]).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "checks/common.h"
#include "cuda/expert_gemm.h"

namespace static_moe {
namespace cuda {

struct WeightView {
  at::Tensor w, scale;  // kept alive; last dim contiguous
  WeightFmt fmt = WeightFmt::kBf16;
  const void* data = nullptr;
  int64_t expert_stride = 0, row_stride = 0;  // bytes
  const void* scale_data = nullptr;
  int64_t scale_expert_stride = 0, scale_row_stride = 0;  // elements of the scale dtype
};

// w [L, N, K] bf16 / fp8 or [L, N, K/2] fp4 bytes, already checked (csrc/checks). A tensor whose last dim is not
// contiguous is copied once.
inline WeightView weight_view(const at::Tensor& w, const std::optional<at::Tensor>& scale, checks::Format f) {
  WeightView v;
  v.fmt = f == checks::Format::BF16 ? WeightFmt::kBf16 : (f == checks::Format::FP8 ? WeightFmt::kFp8 : WeightFmt::kFp4);
  v.w = w.stride(2) == 1 ? w : w.contiguous();
  v.data = v.w.const_data_ptr();
  v.expert_stride = v.w.stride(0) * v.w.element_size();
  v.row_stride = v.w.stride(1) * v.w.element_size();
  if (f != checks::Format::BF16 && scale.has_value() && scale->defined()) {
    v.scale = scale->stride(2) == 1 ? *scale : scale->contiguous();
    v.scale_data = v.scale.const_data_ptr();
    v.scale_expert_stride = v.scale.stride(0);
    v.scale_row_stride = v.scale.stride(1);
  }
  return v;
}

}  // namespace cuda
}  // namespace static_moe
