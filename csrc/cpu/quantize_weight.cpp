// CPU binding of quantize_weight (SPEC §1.10): checks (csrc/checks/quantize_weight.h), then the raw-pointer kernel of
// csrc/cpu/kernels/quantize_weight.h, OpenMP over rows, on the instruction set csrc/cpu/simd.h selects (one
// instance of the kernel per set, auto-vectorised; every instance gives the same bits: integer ops, exact
// multiplications, IEEE compares). Torch types stay in this file.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "checks/quantize_weight.h"
#include "cpu/simd.h"

// Kernel code only (push/pop): the clamps are float compares, which GCC's default -ftrapping-math treats as
// possibly trapping, blocking if-conversion, so the loops would not vectorise; no value depends on it.
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math", "fp-contract=off")
#include "cpu/kernels/quantize_weight.h"

namespace {

using static_moe::cpu::BadBlocks;
using static_moe::cpu::QuantizeWeightParams;
using static_moe::cpu::QwIn;

template <QwIn kIn>
inline void rows_any(const QuantizeWeightParams& p, bool fp4, int64_t r0, int64_t r1, BadBlocks* bad) {
  static_moe::cpu::quantize_weight_rows<kIn>(p, fp4, r0, r1, bad);
}

// `flatten` inlines the whole kernel into each instance so all of it is compiled for that instruction set.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2"), flatten)) void rows_avx512(
    const QuantizeWeightParams& p, bool fp4, int64_t r0, int64_t r1, BadBlocks* bad) {
  if (p.in == QwIn::Bf16)
    rows_any<QwIn::Bf16>(p, fp4, r0, r1, bad);
  else
    rows_any<QwIn::F32>(p, fp4, r0, r1, bad);
}

__attribute__((target("avx2,fma,f16c,bmi,bmi2"), flatten)) void rows_avx2(const QuantizeWeightParams& p, bool fp4,
                                                                          int64_t r0, int64_t r1, BadBlocks* bad) {
  if (p.in == QwIn::Bf16)
    rows_any<QwIn::Bf16>(p, fp4, r0, r1, bad);
  else
    rows_any<QwIn::F32>(p, fp4, r0, r1, bad);
}

__attribute__((flatten)) void rows_scalar(const QuantizeWeightParams& p, bool fp4, int64_t r0, int64_t r1,
                                          BadBlocks* bad) {
  if (p.in == QwIn::Bf16)
    rows_any<QwIn::Bf16>(p, fp4, r0, r1, bad);
  else
    rows_any<QwIn::F32>(p, fp4, r0, r1, bad);
}

}  // namespace
#pragma GCC pop_options

namespace {

using namespace static_moe;

constexpr int64_t kParallelElems = 1 << 16;  // below this many weights one thread is faster than waking a team
constexpr int64_t kRowsPerTask = 16;         // rows per OpenMP chunk: a few KiB of output each

std::tuple<at::Tensor, at::Tensor> quantize_weight_cpu(const at::Tensor& w, c10::string_view weight_format) {
  const std::string_view fmt(weight_format.data(), weight_format.size());
  const checks::QuantizeWeightShape sh = checks::check_quantize_weight(w, fmt);
  checks::check_device_type(w, "quantize_weight", "w", c10::DeviceType::CPU);
  cpu::Isa isa;
  const char* isa_error = nullptr;
  TORCH_CHECK_VALUE(cpu::select_isa(&isa, &isa_error), "quantize_weight: ", isa_error);

  const int64_t R = sh.rows, K = sh.k, nb = K / sh.block;
  std::vector<int64_t> scale_shape(w.sizes().begin(), w.sizes().end());
  scale_shape.back() = nb;
  at::Tensor q, s;
  if (sh.fp4) {
    std::vector<int64_t> q_shape(w.sizes().begin(), w.sizes().end());
    q_shape.back() = K / 2;
    q = at::empty(q_shape, w.options().dtype(at::kByte));
    s = at::empty(scale_shape, w.options().dtype(at::kByte));
  } else {
    q = at::empty(w.sizes(), w.options().dtype(at::kFloat8_e4m3fn));
    s = at::empty(scale_shape, w.options().dtype(at::kFloat));
  }
  if (R == 0 || K == 0) return {q, s};

  // float16 is widened once (a float32 copy); bf16 and float32 are read in place when contiguous.
  const at::Tensor src = w.scalar_type() == at::kHalf ? w.to(at::kFloat).contiguous() : w.contiguous();
  QuantizeWeightParams p;
  p.rows = R;
  p.k = K;
  p.w = src.const_data_ptr();
  p.in = src.scalar_type() == at::kBFloat16 ? QwIn::Bf16 : QwIn::F32;
  p.q = static_cast<uint8_t*>(q.mutable_data_ptr());
  p.scale = s.mutable_data_ptr();
  auto* run = isa >= cpu::Isa::Avx512 ? &rows_avx512 : isa == cpu::Isa::Avx2 ? &rows_avx2 : &rows_scalar;

  BadBlocks bad;
#pragma omp parallel if (R * K >= kParallelElems)
  {
    BadBlocks mine;
#pragma omp for schedule(static)
    for (int64_t r0 = 0; r0 < R; r0 += kRowsPerTask) run(p, sh.fp4, r0, std::min(R, r0 + kRowsPerTask), &mine);
#pragma omp critical
    {
      bad.count += mine.count;
      bad.first = std::min(bad.first, mine.first);
    }
  }
  if (bad.count > 0) {
    // The reference's message (formats.check_finite_blocks): the first bad block's index over [..., n, k/block].
    std::vector<int64_t> idx(static_cast<size_t>(w.dim()));
    int64_t flat = bad.first;
    idx.back() = flat % nb;
    flat /= nb;
    for (int64_t d = w.dim() - 2; d >= 0; --d) {
      idx[static_cast<size_t>(d)] = flat % w.size(d);
      flat /= w.size(d);
    }
    std::ostringstream dims;
    for (int64_t d = 0; d + 2 < w.dim(); ++d) dims << 'd' << d << ", ";
    dims << "n, k/" << sh.block;
    TORCH_CHECK_VALUE(false, "quantize_weight: w holds NaN or Inf in ", bad.count, " block(s); the first is block [",
                      dims.str(), "] = ", checks::shape_str(idx), "; quantizing it would give finite garbage");
  }
  return {q, s};
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CPU, m) { m.impl("quantize_weight", &quantize_weight_cpu); }
