// CUDA binding of swiglu_and_cast (SPEC §1.4-1.5): shared checks (csrc/checks/swiglu_and_cast.h), then the
// torch-free launcher of swiglu_and_cast.cu on the current stream. No host sync; only the outputs are allocated.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "checks/swiglu_and_cast.h"
#include "cuda/swiglu_and_cast.h"

namespace {

using namespace static_moe;

std::tuple<at::Tensor, at::Tensor> swiglu_and_cast_cuda(const at::Tensor& gate_up,
                                                        const std::optional<at::Tensor>& row_weight,
                                                        std::optional<double> swiglu_limit, c10::string_view out_format,
                                                        int64_t group_size, double fp8_max, bool pow2_scale,
                                                        c10::string_view activation, double alpha) {
  const char* op = "swiglu_and_cast";
  const std::string_view fmt(out_format.data(), out_format.size());
  const checks::SwigluShape sh =
      checks::check_swiglu_and_cast(gate_up, row_weight, swiglu_limit, fmt, group_size, fp8_max, pow2_scale,
                                    {activation.data(), activation.size()}, alpha);
  checks::check_device_type(gate_up, op, "gate_up", c10::DeviceType::CUDA);
  const bool has_weight = row_weight.has_value() && row_weight->defined();
  const c10::cuda::CUDAGuard guard(gate_up.device());

  const int64_t R = sh.rows, I = sh.inter;
  at::Tensor q = at::empty({R, I}, gate_up.options().dtype(sh.out_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
  at::Tensor s = at::empty({R, sh.out_fp8 ? I / group_size : 0}, gate_up.options().dtype(at::kFloat));
  if (R == 0 || I == 0) return {q, s};

  const at::Tensor gu = gate_up.stride(1) == 1 ? gate_up : gate_up.contiguous();
  const at::Tensor w = has_weight ? row_weight->contiguous() : at::Tensor();
  cuda::SwigluArgs a;
  a.gate_up = gu.const_data_ptr();
  a.gate_up_bf16 = gu.scalar_type() == at::kBFloat16;
  a.gate_up_row_stride = gu.stride(0);
  a.rows = R;
  a.inter = I;
  a.row_weight = has_weight ? w.const_data_ptr() : nullptr;
  a.row_weight_bf16 = has_weight && w.scalar_type() == at::kBFloat16;
  a.has_limit = swiglu_limit.has_value();
  a.limit = a.has_limit ? static_cast<float>(*swiglu_limit) : 0.0f;
  a.act = static_cast<int>(sh.activation);
  a.alpha = static_cast<float>(alpha);
  a.out_fp8 = sh.out_fp8;
  a.group = static_cast<int>(group_size);
  a.fp8_max = static_cast<float>(fp8_max);
  a.pow2_scale = pow2_scale;
  a.out = q.mutable_data_ptr();
  a.out_row_stride = I;
  a.scale = s.mutable_data_ptr<float>();
  a.scale_row_stride = sh.out_fp8 ? I / group_size : 0;
  const cudaError_t err = cuda::launch_swiglu_and_cast(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
  return {q, s};
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CUDA, m) { m.impl("swiglu_and_cast", &swiglu_and_cast_cuda); }
