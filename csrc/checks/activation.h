// Argument checks of the activation variants and the expert biases (SPEC §1.9, §5), over tensor metadata only:
// shared by the swiglu_and_cast, expert_gemm and local_experts checks (and so by forward's).
#pragma once

#include "checks/common.h"

#include <cmath>
#include <optional>
#include <string>
#include <string_view>

namespace static_moe {
namespace checks {

// The gated activations of SPEC §1.9; the values are the kernels' template / switch keys.
enum class Activation : int { Silu = 0, SwigluOai = 1, GeluTanh = 2 };

inline Activation parse_activation(std::string_view name, const char* op) {
  if (name == "silu") return Activation::Silu;
  if (name == "swiglu_oai") return Activation::SwigluOai;
  if (name == "gelu_tanh") return Activation::GeluTanh;
  TORCH_CHECK_VALUE(false, op, ": activation must be \"silu\", \"swiglu_oai\" or \"gelu_tanh\", got \"",
                    std::string(name), "\"");
  return Activation::Silu;
}

// alpha (read by "swiglu_oai", checked for every activation): positive and finite, also once rounded to float32.
inline void check_alpha(double alpha, const char* op) {
  const float f = static_cast<float>(alpha);
  TORCH_CHECK_VALUE(std::isfinite(alpha) && alpha > 0 && std::isfinite(f) && f > 0.0f, op,
                    ": alpha must be a positive finite number (finite and positive in float32), got ", alpha);
}

// A per-expert bias: None, or float32 / bf16 [L, N] on the device of `like`.
inline void check_bias(const std::optional<at::Tensor>& bias, const char* op, const char* name, int64_t num_experts,
                       int64_t n, const char* what, const at::Tensor& like, const char* like_name) {
  if (!bias.has_value() || !bias->defined()) return;
  const at::Tensor& b = *bias;
  check_dtype_in(b, op, name, {c10::ScalarType::Float, c10::ScalarType::BFloat16});
  check_shape(b, op, name, {num_experts, n}, what);
  check_same_device(b, op, name, like, like_name);
}

inline bool has_tensor(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

}  // namespace checks
}  // namespace static_moe
