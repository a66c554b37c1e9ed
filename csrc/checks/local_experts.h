// Argument checks of local_experts (SPEC §1.3, §1.7, §4, §5), over tensor metadata only: shared by the CPU and CUDA
// bindings and by the Python fake kernel (through static_moe._C.check_local_experts), and run by forward's checks for
// the arguments it hands to local_experts (with op = "forward", so messages name the op the user called). The
// routing ids are values: the eager kernels check them (ids < -1 are an error; ids >= 0 outside this rank's experts
// are other ranks').
#pragma once

#include "checks/activation.h"
#include "checks/common.h"

#include <cmath>
#include <optional>
#include <string_view>

namespace static_moe {
namespace checks {

struct LocalExpertsShape {
  int64_t rows = 0;       // R
  int64_t hidden = 0;     // H
  int64_t inter = 0;      // I
  int64_t num_local = 0;  // L
  int64_t topk = 0;       // k
  Format act = Format::BF16;
  Format weight = Format::BF16;
  int64_t group = 0;  // activation group g (fp8 x; z uses the same), 0 for bf16
  WeightLayout layout = WeightLayout::Eoi;
  Activation activation = Activation::Silu;
};

// x bf16 / float8_e4m3fn [R, H] (+ x_scale float32 [R, H/g], g in {32, 128}); topk_idx int32 / int64 [R, k];
// topk_weights float32 / bf16 [R, k]; w13 [L, 2I, H] and w2 [L, H, I] of one weight format with their scales;
// H and I multiples of 128; a supported format pair; expert_offset >= 0; swiglu_limit None or positive finite in
// float32; for fp8 x, 2 <= fp8_max <= 448 (common.h says why); everything on x's device. `op` prefixes the messages.
// Under layout = EIO, w13 [L, H, 2I] / w2 [L, I, H] (packed: [L, H/4, 2I] / [L, I/4, H]) are the prepared forms
// of common.h (check_weight_eio), both of one dtype. activation / alpha / w13_bias [L, 2I] / w2_bias [L, H]: SPEC
// §1.9 (activation.h).
inline LocalExpertsShape check_local_experts(const at::Tensor& x, const std::optional<at::Tensor>& x_scale,
                                             const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                                             const at::Tensor& w13, const std::optional<at::Tensor>& w13_scale,
                                             const at::Tensor& w2, const std::optional<at::Tensor>& w2_scale,
                                             int64_t expert_offset, std::optional<double> swiglu_limit, double fp8_max,
                                             const char* op = "local_experts", WeightLayout layout = WeightLayout::Eoi,
                                             std::string_view activation = "silu", double alpha = 1.702,
                                             const std::optional<at::Tensor>& w13_bias = std::nullopt,
                                             const std::optional<at::Tensor>& w2_bias = std::nullopt) {
  LocalExpertsShape sh;
  sh.layout = layout;
  const bool eio = layout == WeightLayout::Eio;
  sh.group = check_activation(x, x_scale, op, "x", "x_scale");
  sh.act = activation_format(x, op, "x");
  sh.rows = x.size(0);
  sh.hidden = x.size(1);
  check_divisible(sh.hidden, op, "H = x.size(1)", 128);

  check_defined(topk_idx, op, "topk_idx");
  check_dtype_in(topk_idx, op, "topk_idx", {c10::ScalarType::Int, c10::ScalarType::Long});
  check_dim(topk_idx, op, "topk_idx", 2, "[R, k]");
  check_size(topk_idx, op, "topk_idx", 0, sh.rows, "R = x.size(0)");
  check_same_device(topk_idx, op, "topk_idx", x, "x");
  sh.topk = topk_idx.size(1);
  check_defined(topk_weights, op, "topk_weights");
  check_dtype_in(topk_weights, op, "topk_weights", {c10::ScalarType::Float, c10::ScalarType::BFloat16});
  check_shape(topk_weights, op, "topk_weights", {sh.rows, sh.topk}, "[R, k] like topk_idx");
  check_same_device(topk_weights, op, "topk_weights", x, "x");

  check_defined(w13, op, "w13");
  sh.weight = weight_format_in(w13, layout, op, "w13");
  check_format_pair(sh.act, sh.weight, op, "x", "w13");
  check_weight_in(layout, w13, w13_scale, op, "w13", "w13_scale", -1, -1, sh.hidden);
  check_same_device(w13, op, "w13", x, "x");
  sh.num_local = w13.size(0);
  const int64_t two_i = weight_n(w13, layout);
  TORCH_CHECK_VALUE(two_i % 2 == 0, op, (eio ? ": w13.size(2) = 2I" : ": w13.size(1) = 2I"),
                    " must be even (gate rows, then up rows), got ", two_i);
  sh.inter = two_i / 2;
  check_divisible(sh.inter, op, eio ? "I = w13.size(2) / 2" : "I = w13.size(1) / 2", 128);
  check_defined(w2, op, "w2");
  const Format f2 = weight_format_in(w2, layout, op, "w2");
  TORCH_CHECK_VALUE(f2 == sh.weight, op, ": w2 must have the weight format of w13 (", format_name(sh.weight), ", ",
                    dtype_name(w13.scalar_type()), "), got ", format_name(f2), " (", dtype_name(w2.scalar_type()), ")");
  // One prepared form for both (fp8 MX and plain fp8 are one format but different kernels' inputs).
  TORCH_CHECK_TYPE(!eio || w2.scalar_type() == w13.scalar_type(), op, ": under weight_layout='eio' w2 must have ",
                   "the dtype of w13 (", dtype_name(w13.scalar_type()), "), got ", dtype_name(w2.scalar_type()));
  check_weight_in(layout, w2, w2_scale, op, "w2", "w2_scale", sh.num_local, sh.hidden, sh.inter);
  check_same_device(w2, op, "w2", x, "x");

  TORCH_CHECK_VALUE(expert_offset >= 0, op, ": expert_offset (global id of local expert 0) must be >= 0, got ",
                    expert_offset);
  check_swiglu_limit(swiglu_limit, op);
  if (sh.act == Format::FP8) check_fp8_max(fp8_max, op);
  sh.activation = parse_activation(activation, op);
  check_alpha(alpha, op);
  check_bias(w13_bias, op, "w13_bias", sh.num_local, 2 * sh.inter, "[L, 2I] (gate columns, then up columns)", x, "x");
  check_bias(w2_bias, op, "w2_bias", sh.num_local, sh.hidden, "[L, H]", x, "x");
  return sh;
}

}  // namespace checks
}  // namespace static_moe
