// The public op schemas of the `static_moe` namespace, defined once (SPEC §4, docs/spec.md).
// Backends only implement them: csrc/cpu/<op>.cpp registers the CPU kernels, csrc/cuda/<op>_binding.cpp the CUDA
// ones; fake (meta) kernels live in Python beside each op's wrapper (python/static_moe/ops/<op>.py).
// Later arguments may be added only with defaults, at the end.
#include <torch/extension.h>

#include "checks/expert_gemm.h"
#include "checks/local_experts.h"
#include "checks/pack_rows.h"
#include "checks/quantize_weight.h"
#include "checks/swiglu_and_cast.h"
#include "cpu/kernels/cast.h"

TORCH_LIBRARY(static_moe, m) {
  m.def("pack_rows(Tensor[] parts, int capacity) -> Tensor");
  m.def("unpack_rows(Tensor packed, int offset, int nbytes, ScalarType dtype, int[] row_shape) -> Tensor");
  m.def(
      "swiglu_and_cast(Tensor gate_up, Tensor? row_weight, float? swiglu_limit, str out_format=\"fp8\", "
      "int group_size=128, float fp8_max=448., bool pow2_scale=True, str activation=\"silu\", float alpha=1.702) "
      "-> (Tensor, Tensor)");
  m.def(
      "expert_gemm(Tensor a, Tensor? a_scale, Tensor b, Tensor? b_scale, Tensor row_mask, int expert, "
      "str weight_layout=\"eoi\", Tensor? bias=None) -> Tensor");
  m.def(
      "local_experts(Tensor x, Tensor? x_scale, Tensor topk_idx, Tensor topk_weights, Tensor w13, "
      "Tensor? w13_scale, Tensor w2, Tensor? w2_scale, int expert_offset, float? swiglu_limit, "
      "float fp8_max=448., str weight_layout=\"eoi\", str activation=\"silu\", float alpha=1.702, "
      "Tensor? w13_bias=None, Tensor? w2_bias=None) -> Tensor");
  m.def(
      "forward(Tensor x, Tensor? x_scale, Tensor topk_idx, Tensor topk_weights, Tensor w13, Tensor? w13_scale, "
      "Tensor w2, Tensor? w2_scale, Tensor? shared_output, int num_experts, int capacity, float? swiglu_limit, "
      "str group_name, int ep_rank, int ep_size, float fp8_max=448., str weight_layout=\"eoi\", "
      "str activation=\"silu\", float alpha=1.702, Tensor? w13_bias=None, Tensor? w2_bias=None, "
      "str dispatch=\"all_gather\", str combine=\"fp32\", int dispatch_capacity=0) -> Tensor");
  // Offline weight quantization (SPEC §1.10): bf16 / float16 / float32 [..., N, K] -> fp8 1x128 or fp4 1x32 + UE8M0.
  m.def("quantize_weight(Tensor w, str weight_format) -> (Tensor, Tensor)");
}

// `import static_moe._C` loads this library, which runs the registrations above and in every backend file.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "static_moe C++ extension: op registrations for the CPU (and, when built, CUDA) backends";
  // Per-op metadata checks, called by the Python fake kernels so traced graphs reject bad shapes too
  // (they read sizes / dtypes / devices only, so FakeTensors work).
  m.def(
      "check_pack_rows",
      [](const std::vector<at::Tensor>& parts, int64_t capacity) {
        return static_moe::checks::check_pack_rows(parts, capacity).width;
      },
      "pack_rows argument checks; returns the packed row width W");
  m.def(
      "check_unpack_rows",
      [](const at::Tensor& packed, int64_t offset, int64_t nbytes, at::ScalarType dtype,
         std::vector<int64_t> row_shape) {
        static_moe::checks::check_unpack_rows(packed, offset, nbytes, dtype, row_shape);
      },
      "unpack_rows argument checks");
  m.def(
      "check_swiglu_and_cast",
      [](const at::Tensor& gate_up, std::optional<at::Tensor> row_weight, std::optional<double> swiglu_limit,
         std::string out_format, int64_t group_size, double fp8_max, bool pow2_scale, std::string activation,
         double alpha) {
        static_moe::checks::check_swiglu_and_cast(gate_up, row_weight, swiglu_limit, out_format, group_size, fp8_max,
                                                  pow2_scale, activation, alpha);
      },
      "swiglu_and_cast argument checks", py::arg("gate_up"), py::arg("row_weight"), py::arg("swiglu_limit"),
      py::arg("out_format"), py::arg("group_size"), py::arg("fp8_max"), py::arg("pow2_scale"),
      py::arg("activation") = "silu", py::arg("alpha") = 1.702);
  m.def(
      "check_expert_gemm",
      [](const at::Tensor& a, std::optional<at::Tensor> a_scale, const at::Tensor& b, std::optional<at::Tensor> b_scale,
         const at::Tensor& row_mask, int64_t expert, const std::string& weight_layout, std::optional<at::Tensor> bias) {
        static_moe::checks::check_expert_gemm(a, a_scale, b, b_scale, row_mask, expert,
                                              static_moe::checks::parse_weight_layout(weight_layout, "expert_gemm"),
                                              bias);
      },
      "expert_gemm argument checks", py::arg("a"), py::arg("a_scale"), py::arg("b"), py::arg("b_scale"),
      py::arg("row_mask"), py::arg("expert"), py::arg("weight_layout") = "eoi", py::arg("bias") = py::none());
  m.def(
      "check_local_experts",
      [](const at::Tensor& x, std::optional<at::Tensor> x_scale, const at::Tensor& topk_idx,
         const at::Tensor& topk_weights, const at::Tensor& w13, std::optional<at::Tensor> w13_scale,
         const at::Tensor& w2, std::optional<at::Tensor> w2_scale, int64_t expert_offset,
         std::optional<double> swiglu_limit, double fp8_max, const std::string& op, const std::string& weight_layout,
         const std::string& activation, double alpha, std::optional<at::Tensor> w13_bias,
         std::optional<at::Tensor> w2_bias) {
        static_moe::checks::check_local_experts(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale,
                                                expert_offset, swiglu_limit, fp8_max, op.c_str(),
                                                static_moe::checks::parse_weight_layout(weight_layout, op.c_str()),
                                                activation, alpha, w13_bias, w2_bias);
      },
      "local_experts argument checks; op names the op in the messages (forward runs them too)", py::arg("x"),
      py::arg("x_scale"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("w13"), py::arg("w13_scale"),
      py::arg("w2"), py::arg("w2_scale"), py::arg("expert_offset"), py::arg("swiglu_limit"), py::arg("fp8_max"),
      py::arg("op") = "local_experts", py::arg("weight_layout") = "eoi", py::arg("activation") = "silu",
      py::arg("alpha") = 1.702, py::arg("w13_bias") = py::none(), py::arg("w2_bias") = py::none());
  m.def(
      "check_quantize_weight",
      [](const at::Tensor& w, const std::string& weight_format) {
        static_moe::checks::check_quantize_weight(w, weight_format);
      },
      "quantize_weight argument checks");
  // Test hooks: the CPU kernels' exact float32 -> e4m3fn / bf16 casts, elementwise (tests/ops/test_swiglu_and_cast.py
  // compares them with torch's casts bit for bit).
  m.def("_cast_e4m3fn", [](const at::Tensor& x) {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.device().is_cpu(),
                      "_cast_e4m3fn: x must be a CPU float32 tensor");
    const at::Tensor c = x.contiguous();
    at::Tensor out = at::empty(c.sizes(), c.options().dtype(at::kFloat8_e4m3fn));
    const float* src = c.const_data_ptr<float>();
    auto* dst = static_cast<uint8_t*>(out.mutable_data_ptr());
    for (int64_t i = 0; i < c.numel(); ++i) dst[i] = static_moe::cpu::float_to_e4m3fn(src[i]);
    return out;
  });
  m.def("_cast_bf16", [](const at::Tensor& x) {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.device().is_cpu(),
                      "_cast_bf16: x must be a CPU float32 tensor");
    const at::Tensor c = x.contiguous();
    at::Tensor out = at::empty(c.sizes(), c.options().dtype(at::kBFloat16));
    const float* src = c.const_data_ptr<float>();
    auto* dst = static_cast<uint16_t*>(out.mutable_data_ptr());
    for (int64_t i = 0; i < c.numel(); ++i) dst[i] = static_moe::cpu::float_to_bf16(src[i]);
    return out;
  });
}
