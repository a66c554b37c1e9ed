// Argument checks of quantize_weight (SPEC §1.10, §4, §5), over tensor metadata only: used by the CPU binding and by
// the Python fake kernel (through static_moe._C.check_quantize_weight).
#pragma once

#include "checks/common.h"

#include <string>
#include <string_view>

namespace static_moe {
namespace checks {

struct QuantizeWeightShape {
  int64_t rows = 0;   // product of w's leading dims (every dim but the last)
  int64_t k = 0;      // K = w.size(-1)
  int64_t block = 0;  // 128 (fp8) or 32 (fp4)
  bool fp4 = false;   // weight_format == "fp4"
};

// w bf16 / float16 / float32 [..., N, K] (at least 2-D); weight_format "fp8" (K a multiple of 128) or "fp4"
// (K a multiple of 32).
inline QuantizeWeightShape check_quantize_weight(const at::Tensor& w, std::string_view weight_format) {
  const char* op = "quantize_weight";
  QuantizeWeightShape sh;
  TORCH_CHECK_VALUE(weight_format == "fp8" || weight_format == "fp4", op,
                    ": weight_format must be \"fp8\" or \"fp4\", got \"", std::string(weight_format), "\"");
  sh.fp4 = weight_format == "fp4";
  sh.block = sh.fp4 ? 32 : 128;
  check_defined(w, op, "w");
  check_dtype_in(w, op, "w", {c10::ScalarType::BFloat16, c10::ScalarType::Half, c10::ScalarType::Float});
  TORCH_CHECK_VALUE(w.dim() >= 2, op, ": w must have at least 2 dims [..., N, K], got shape ", shape_str(w.sizes()));
  sh.k = w.size(-1);
  TORCH_CHECK_VALUE(sh.k % sh.block == 0, op, ": w.size(-1) = K must be a multiple of ", sh.block, " for \"",
                    std::string(weight_format), "\" (its scale block), got K = ", sh.k);
  sh.rows = 1;
  for (int64_t d = 0; d + 1 < w.dim(); ++d) sh.rows *= w.size(d);
  return sh;
}

}  // namespace checks
}  // namespace static_moe
