// CPU binding of swiglu_and_cast (SPEC §1.4-1.5): checks (csrc/checks/swiglu_and_cast.h), then the raw-pointer
// kernel of csrc/cpu/kernels/swiglu_and_cast.h, OpenMP over rows. Torch types stay in this file.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "checks/swiglu_and_cast.h"

// Kernel code only (push/pop): the kernel's selects (clamps) are float compares, which GCC's default
// -ftrapping-math treats as possibly trapping, blocking if-conversion, so the loops would not vectorise; no value
// or rounding depends on it. fp-contract=off keeps the AVX-512 clone from fusing a*b+c into an FMA, so every
// clone rounds exactly like the baseline.
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math", "fp-contract=off")
#include "cpu/kernels/swiglu_and_cast.h"

namespace {

// One definition per ISA, picked once at load time (GCC function multi-versioning), so the default build needs
// no -march flag; `flatten` inlines the whole kernel into each clone so all of it is compiled for that ISA.
// Results are bitwise the same on every clone (IEEE ops, no FMA), so they do not depend on the machine; only a
// NaN in gate_up may come out with a different NaN sign bit (checked with -mno-avx vs -mavx512f builds).
__attribute__((target_clones("avx512f", "avx2", "default"), flatten)) void swiglu_rows_dispatch(
    const static_moe::cpu::SwigluParams& p, int64_t r0, int64_t r1, float* scratch) {
  static_moe::cpu::swiglu_and_cast_rows(p, r0, r1, scratch);
}

}  // namespace
#pragma GCC pop_options

namespace {

using namespace static_moe;

constexpr int64_t kParallelElems = 1 << 14;  // below this many outputs one thread is faster than waking a team

std::tuple<at::Tensor, at::Tensor> swiglu_and_cast_cpu(const at::Tensor& gate_up,
                                                       const std::optional<at::Tensor>& row_weight,
                                                       std::optional<double> swiglu_limit, c10::string_view out_format,
                                                       int64_t group_size, double fp8_max, bool pow2_scale,
                                                       c10::string_view activation, double alpha) {
  const std::string_view fmt(out_format.data(), out_format.size());
  const checks::SwigluShape sh =
      checks::check_swiglu_and_cast(gate_up, row_weight, swiglu_limit, fmt, group_size, fp8_max, pow2_scale,
                                    {activation.data(), activation.size()}, alpha);
  checks::check_device_type(gate_up, "swiglu_and_cast", "gate_up", c10::DeviceType::CPU);
  const bool has_weight = row_weight.has_value() && row_weight->defined();
  if (has_weight) checks::check_device_type(*row_weight, "swiglu_and_cast", "row_weight", c10::DeviceType::CPU);

  const int64_t R = sh.rows, I = sh.inter;
  at::Tensor q = at::empty({R, I}, gate_up.options().dtype(sh.out_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
  at::Tensor s = at::empty({R, sh.out_fp8 ? I / group_size : 0}, gate_up.options().dtype(at::kFloat));
  if (R == 0 || I == 0) return {q, s};

  const at::Tensor gu = gate_up.stride(1) == 1 ? gate_up : gate_up.contiguous();
  // bf16 routing weights are widened once (R floats), as the reference's row_weight.float() does.
  const at::Tensor w = has_weight ? row_weight->to(at::kFloat).contiguous() : at::Tensor();

  cpu::SwigluParams p;
  p.rows = R;
  p.inter = I;
  p.gate_up = gu.const_data_ptr();
  p.gate_up_bf16 = gu.scalar_type() == at::kBFloat16;
  p.gate_up_row_stride = gu.stride(0);
  p.row_weight = has_weight ? w.const_data_ptr<float>() : nullptr;
  p.has_limit = swiglu_limit.has_value();
  p.limit = p.has_limit ? static_cast<float>(*swiglu_limit) : 0.0f;
  p.act = static_cast<cpu::Act>(sh.activation);
  p.alpha = static_cast<float>(alpha);
  p.out_fp8 = sh.out_fp8;
  p.group = group_size;
  p.fp8_max = static_cast<float>(fp8_max);
  p.pow2_scale = pow2_scale;
  p.out = q.mutable_data_ptr();
  p.scale = s.mutable_data_ptr<float>();

#pragma omp parallel if (R * I >= kParallelElems)
  {
    std::vector<float> scratch(static_cast<size_t>(I));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) swiglu_rows_dispatch(p, r, r + 1, scratch.data());
  }
  return {q, s};
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CPU, m) { m.impl("swiglu_and_cast", &swiglu_and_cast_cpu); }
