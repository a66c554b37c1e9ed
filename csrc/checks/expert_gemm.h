// Argument checks of expert_gemm (SPEC §1.6, §4, §5), over tensor metadata only: shared by the CPU and CUDA
// bindings and by the Python fake kernel (through static_moe._C.check_expert_gemm).
#pragma once

#include "checks/activation.h"
#include "checks/common.h"

#include <optional>

namespace static_moe {
namespace checks {

struct ExpertGemmShape {
  int64_t rows = 0;         // R
  int64_t k = 0;            // K (logical)
  int64_t n = 0;            // N
  int64_t num_experts = 0;  // L
  Format act = Format::BF16;
  Format weight = Format::BF16;
  int64_t group = 0;  // activation group g (fp8 a), 0 for bf16
  WeightLayout layout = WeightLayout::Eoi;
};

// a bf16 / float8_e4m3fn [R, K] (+ a_scale float32 [R, K/g], g in {32, 128}); b [L, N, K] bf16 / fp8 (+ float32
// [L, N, K/128]) or uint8 / float4_e2m1fn_x2 [L, N, K/2] (+ UE8M0 [L, N, K/32]); row_mask bool [R];
// 0 <= expert < L; K a multiple of 128; a supported format pair; everything on a's device. Under
// layout = EIO, b and b_scale are the prepared forms of common.h (check_weight_eio), N = b.size(2).
// bias: None or float32 / bf16 [L, N] (SPEC §1.9).
inline ExpertGemmShape check_expert_gemm(const at::Tensor& a, const std::optional<at::Tensor>& a_scale,
                                         const at::Tensor& b, const std::optional<at::Tensor>& b_scale,
                                         const at::Tensor& row_mask, int64_t expert,
                                         WeightLayout layout = WeightLayout::Eoi,
                                         const std::optional<at::Tensor>& bias = std::nullopt) {
  const char* op = "expert_gemm";
  ExpertGemmShape sh;
  sh.layout = layout;
  sh.group = check_activation(a, a_scale, op, "a", "a_scale");
  sh.act = activation_format(a, op, "a");
  sh.rows = a.size(0);
  sh.k = a.size(1);
  check_divisible(sh.k, op, "K = a.size(1)", 128);
  check_defined(b, op, "b");
  sh.weight = weight_format_in(b, layout, op, "b");
  check_format_pair(sh.act, sh.weight, op, "a", "b");
  check_weight_in(layout, b, b_scale, op, "b", "b_scale", -1, -1, sh.k);
  check_same_device(b, op, "b", a, "a");
  sh.num_experts = b.size(0);
  sh.n = weight_n(b, layout);
  check_defined(row_mask, op, "row_mask");
  check_dtype(row_mask, op, "row_mask", c10::ScalarType::Bool);
  check_shape(row_mask, op, "row_mask", {sh.rows}, "[R] with R = a.size(0)");
  check_same_device(row_mask, op, "row_mask", a, "a");
  TORCH_CHECK_VALUE(expert >= 0 && expert < sh.num_experts, op,
                    ": expert must index b's experts, 0 <= expert < L = ", sh.num_experts, " (b.size(0)), got ",
                    expert);
  check_bias(bias, op, "bias", sh.num_experts, sh.n, "[L, N] (one row per expert of b)", a, "a");
  return sh;
}

}  // namespace checks
}  // namespace static_moe
