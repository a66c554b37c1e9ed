// CUDA binding of expert_gemm (SPEC §1.6): shared checks (csrc/checks/expert_gemm.h), then the torch-free launcher
// of expert_gemm.cu on the current stream, in mask mode: the active rows are found on the device, so there is no
// host sync and the call is graph-capturable. The only allocation is the output.
//
// Not checked here, unlike on the CPU: the UE8M0 NaN byte 255 in b_scale (finding it would need a device-to-host
// copy); such a scale decodes to +inf, as in the reference. The loaders reject it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "checks/expert_gemm.h"
#include "cuda/expert_gemm.h"
#include "cuda/weight_view.h"

namespace {

using namespace static_moe;

at::Tensor expert_gemm_cuda(const at::Tensor& a, const std::optional<at::Tensor>& a_scale, const at::Tensor& b,
                            const std::optional<at::Tensor>& b_scale, const at::Tensor& row_mask, int64_t expert,
                            c10::string_view weight_layout, const std::optional<at::Tensor>& bias) {
  const char* op = "expert_gemm";
  const checks::WeightLayout wlayout = checks::parse_weight_layout({weight_layout.data(), weight_layout.size()}, op);
  const checks::ExpertGemmShape sh = checks::check_expert_gemm(a, a_scale, b, b_scale, row_mask, expert, wlayout, bias);
  checks::check_device_type(a, op, "a", c10::DeviceType::CUDA);
  checks::refuse_prepared_layout(wlayout, op, "CUDA");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({sh.rows, sh.n}, a.options().dtype(at::kBFloat16));
  if (sh.rows == 0 || sh.n == 0) return out;

  const at::Tensor a_c = a.stride(1) == 1 ? a : a.contiguous();
  const at::Tensor s_c = sh.act == checks::Format::FP8 ? a_scale->contiguous() : at::Tensor();
  const at::Tensor mask = row_mask.contiguous();
  const cuda::WeightView w = cuda::weight_view(b, b_scale, sh.weight);
  // SPEC §1.9: the bias widened to float32 once (a bf16 bias exactly), [L, N] contiguous.
  const at::Tensor bias_f = checks::has_tensor(bias) ? bias->to(at::kFloat).contiguous() : at::Tensor();

  cuda::ExpertGemmArgs p;
  p.a = a_c.const_data_ptr();
  p.a_row_stride = a_c.stride(0);
  p.a_group = static_cast<int>(sh.group);
  p.a_scale = s_c.defined() ? s_c.const_data_ptr<float>() : nullptr;
  p.a_scale_row_stride = s_c.defined() ? s_c.stride(0) : 0;
  p.b_fmt = w.fmt;
  p.b = w.data;
  p.b_expert_stride = w.expert_stride;
  p.b_row_stride = w.row_stride;
  p.b_scale = w.scale_data;
  p.b_scale_expert_stride = w.scale_expert_stride;
  p.b_scale_row_stride = w.scale_row_stride;
  p.n = sh.n;
  p.k = sh.k;
  p.d = out.mutable_data_ptr();
  p.d_row_stride = sh.n;
  p.row_mask = static_cast<const uint8_t*>(mask.const_data_ptr());
  p.rows = sh.rows;
  p.expert = expert;
  p.bias = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  p.bias_expert_stride = sh.n;
  const char* why = cuda::expert_gemm_unsupported(p);
  TORCH_CHECK_VALUE(why == nullptr, op, " (CUDA): ", why ? why : "");
  const cudaError_t err = cuda::launch_expert_gemm(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CUDA, m) { m.impl("expert_gemm", &expert_gemm_cuda); }
