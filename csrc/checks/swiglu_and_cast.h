// Argument checks of swiglu_and_cast (SPEC §1.4-1.5, §4, §5), over tensor metadata only: shared by the CPU and CUDA
// bindings and by the Python fake kernel (through static_moe._C.check_swiglu_and_cast).
#pragma once

#include "checks/activation.h"
#include "checks/common.h"

#include <cmath>
#include <optional>
#include <string>
#include <string_view>

namespace static_moe {
namespace checks {

struct SwigluShape {
  int64_t rows = 0;     // R
  int64_t inter = 0;    // I (gate_up is [R, 2I])
  bool out_fp8 = true;  // out_format == "fp8"
  Activation activation = Activation::Silu;
};

// gate_up bf16 / float32 [R, 2I]; row_weight float32 / bf16 [R] or None; swiglu_limit None or a positive number
// finite in float32; out_format "fp8" or "bf16"; for "fp8": group_size in {32, 128} dividing I and
// 2 <= fp8_max <= 448; activation a SPEC §1.9 name and alpha positive finite (activation.h).
inline SwigluShape check_swiglu_and_cast(const at::Tensor& gate_up, const std::optional<at::Tensor>& row_weight,
                                         std::optional<double> swiglu_limit, std::string_view out_format,
                                         int64_t group_size, double fp8_max, bool /*pow2_scale*/,
                                         std::string_view activation = "silu", double alpha = 1.702) {
  const char* op = "swiglu_and_cast";
  SwigluShape sh;
  TORCH_CHECK_VALUE(out_format == "fp8" || out_format == "bf16", op, ": out_format must be \"fp8\" or \"bf16\", got \"",
                    std::string(out_format), "\"");
  sh.out_fp8 = out_format == "fp8";
  sh.activation = parse_activation(activation, op);
  check_alpha(alpha, op);
  check_defined(gate_up, op, "gate_up");
  check_dtype_in(gate_up, op, "gate_up", {c10::ScalarType::BFloat16, c10::ScalarType::Float});
  check_dim(gate_up, op, "gate_up", 2, "[R, 2I]");
  sh.rows = gate_up.size(0);
  TORCH_CHECK_VALUE(gate_up.size(1) % 2 == 0, op, ": gate_up.size(1) = 2I must be even (gate half, then up half), got ",
                    gate_up.size(1));
  sh.inter = gate_up.size(1) / 2;
  if (row_weight.has_value() && row_weight->defined()) {
    const at::Tensor& w = *row_weight;
    check_dtype_in(w, op, "row_weight", {c10::ScalarType::Float, c10::ScalarType::BFloat16});
    check_shape(w, op, "row_weight", {sh.rows}, "[R] with R = gate_up.size(0)");
    check_same_device(w, op, "row_weight", gate_up, "gate_up");
  }
  check_swiglu_limit(swiglu_limit, op);
  if (sh.out_fp8) {
    TORCH_CHECK_VALUE(group_size == 32 || group_size == 128, op, ": group_size must be 32 or 128, got ", group_size);
    TORCH_CHECK_VALUE(sh.inter % group_size == 0, op,
                      ": I = gate_up.size(1) / 2 must be a multiple of group_size = ", group_size,
                      ", got I = ", sh.inter);
    check_fp8_max(fp8_max, op);
  }
  return sh;
}

}  // namespace checks
}  // namespace static_moe
