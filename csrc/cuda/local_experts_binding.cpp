// CUDA binding of local_experts (SPEC §1.7): shared checks (csrc/checks/local_experts.h), then the torch-free
// launcher of local_experts.cu on the current stream. No host sync anywhere, so the op is graph-capturable.
//
// Scratch: the five stages need a workspace (pair lists, tiles, h / z / d of the routed pairs; its size is
// cuda::local_experts_layout(...).bytes, fixed by the shapes). The launcher takes it from the caller; this public
// op, whose schema has no workspace argument, takes it from torch's caching allocator on the current stream (no
// cudaMalloc in steady state, no sync, and under CUDA-graph capture it comes from the graph's private pool).
//
// Not checked here, unlike on the CPU (each would need a device-to-host copy): routing ids below -1 (the kernels
// treat every id outside this rank's experts as "no expert", so no id can make them read or write out of bounds)
// and the UE8M0 NaN byte 255 in fp4 scales (decodes to +inf, as in the reference).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "checks/local_experts.h"
#include "cuda/local_experts.h"
#include "cuda/weight_view.h"

namespace {

using namespace static_moe;

at::Tensor local_experts_cuda(const at::Tensor& x, const std::optional<at::Tensor>& x_scale, const at::Tensor& topk_idx,
                              const at::Tensor& topk_weights, const at::Tensor& w13,
                              const std::optional<at::Tensor>& w13_scale, const at::Tensor& w2,
                              const std::optional<at::Tensor>& w2_scale, int64_t expert_offset,
                              std::optional<double> swiglu_limit, double fp8_max, c10::string_view weight_layout,
                              c10::string_view activation, double alpha, const std::optional<at::Tensor>& w13_bias,
                              const std::optional<at::Tensor>& w2_bias) {
  const char* op = "local_experts";
  const checks::WeightLayout wlayout = checks::parse_weight_layout({weight_layout.data(), weight_layout.size()}, op);
  const checks::LocalExpertsShape sh = checks::check_local_experts(
      x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, swiglu_limit, fp8_max, op,
      wlayout, {activation.data(), activation.size()}, alpha, w13_bias, w2_bias);
  checks::check_device_type(x, op, "x", c10::DeviceType::CUDA);
  checks::refuse_prepared_layout(wlayout, op, "CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({sh.rows, sh.hidden}, x.options().dtype(at::kFloat));
  if (sh.rows == 0 || sh.hidden == 0) return out;

  const at::Tensor x_c = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor xs_c = sh.act == checks::Format::FP8 ? x_scale->contiguous() : at::Tensor();
  const at::Tensor idx = topk_idx.stride(1) == 1 ? topk_idx : topk_idx.contiguous();
  const at::Tensor wts = topk_weights.stride(1) == 1 ? topk_weights : topk_weights.contiguous();
  const cuda::WeightView w1 = cuda::weight_view(w13, w13_scale, sh.weight);
  const cuda::WeightView w2v = cuda::weight_view(w2, w2_scale, sh.weight);
  // SPEC §1.9 biases widened to float32 once (bf16 exactly), contiguous [L, 2I] / [L, H].
  const at::Tensor b13 = checks::has_tensor(w13_bias) ? w13_bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor b2 = checks::has_tensor(w2_bias) ? w2_bias->to(at::kFloat).contiguous() : at::Tensor();

  cuda::LocalExpertsArgs a;
  a.x = x_c.const_data_ptr();
  a.x_row_stride = x_c.stride(0);
  a.x_group = static_cast<int>(sh.group);
  a.x_scale = xs_c.defined() ? xs_c.const_data_ptr<float>() : nullptr;
  a.x_scale_row_stride = xs_c.defined() ? xs_c.stride(0) : 0;
  a.topk_idx = idx.const_data_ptr();
  a.idx_int64 = idx.scalar_type() == at::kLong;
  a.idx_row_stride = idx.stride(0);
  a.topk_weights = wts.const_data_ptr();
  a.weights_bf16 = wts.scalar_type() == at::kBFloat16;
  a.weights_row_stride = wts.stride(0);
  a.rows = sh.rows;
  a.topk = sh.topk;
  a.expert_offset = expert_offset;
  a.w_fmt = w1.fmt;
  a.w13 = w1.data;
  a.w13_expert_stride = w1.expert_stride;
  a.w13_row_stride = w1.row_stride;
  a.w13_scale = w1.scale_data;
  a.w13_scale_expert_stride = w1.scale_expert_stride;
  a.w13_scale_row_stride = w1.scale_row_stride;
  a.w2 = w2v.data;
  a.w2_expert_stride = w2v.expert_stride;
  a.w2_row_stride = w2v.row_stride;
  a.w2_scale = w2v.scale_data;
  a.w2_scale_expert_stride = w2v.scale_expert_stride;
  a.w2_scale_row_stride = w2v.scale_row_stride;
  a.num_local = sh.num_local;
  a.hidden = sh.hidden;
  a.inter = sh.inter;
  a.has_limit = swiglu_limit.has_value();
  a.limit = a.has_limit ? static_cast<float>(*swiglu_limit) : 0.0f;
  a.fp8_max = static_cast<float>(fp8_max);
  a.act = static_cast<int>(sh.activation);
  a.alpha = static_cast<float>(alpha);
  a.w13_bias = b13.defined() ? b13.const_data_ptr<float>() : nullptr;
  a.w2_bias = b2.defined() ? b2.const_data_ptr<float>() : nullptr;
  a.out = out.mutable_data_ptr<float>();
  const char* why = cuda::local_experts_unsupported(a);
  TORCH_CHECK_VALUE(why == nullptr, op, " (CUDA): ", why ? why : "");

  const cuda::LocalExpertsLayout layout =
      cuda::local_experts_layout(sh.rows, sh.topk, sh.num_local, sh.hidden, sh.inter, a.x_group);
  // The caching allocator returns 512-byte aligned blocks, more than the workspace's 256.
  at::Tensor workspace = at::empty({layout.bytes}, x.options().dtype(at::kByte));
  const cudaError_t err =
      cuda::launch_local_experts(a, workspace.mutable_data_ptr(), layout.bytes, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CUDA, m) { m.impl("local_experts", &local_experts_cuda); }
