// The expert GEMM's plan and its run (expert_gemm_plan.h), the instruction-set dispatch of prepare_activation, and
// TileRows::pack. Compiled for baseline x86-64: nothing here runs an instruction the CPU may lack.
#include "cpu/kernels/expert_gemm_plan.h"

#include <algorithm>
#include <vector>

namespace static_moe {
namespace cpu {

bool prepare_activation(Isa isa, WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group,
                        int64_t c0, int64_t k, float* row) {
  switch (isa) {
    case Isa::Amx:
    case Isa::Avx512Bf16:
      return avx512bf16::prepare_activation(wf, af, x, x_scale, group, c0, k, row);
    case Isa::Avx512:
      avx512::prepare_activation(wf, af, x, x_scale, group, k, row + c0);
      return false;
    case Isa::Avx2:
      avx2::prepare_activation(wf, af, x, x_scale, group, k, row + c0);
      return false;
    case Isa::Scalar:
      break;
  }
  scalar::prepare_activation(wf, af, x, x_scale, group, k, row + c0);
  return false;
}

namespace {

// The path of `kernel` over `rows` rows of weights `wf`: one row; more rows than one register block on a panel
// where the kernel has one (Dot: fp4 and fp8 weights; bf16 weights need no decode); blocks of rows otherwise.
RowPath row_path(GemmKernel kernel, Isa isa, WeightFormat wf, int64_t rows) {
  if (kernel == GemmKernel::Tiles) return RowPath::Tiles;
  if (rows == 1) return RowPath::OneRow;
  bool panel = false;
  if (kernel == GemmKernel::Float32) {
    panel = float32_has_panel(isa) && rows > kFloat32BlockRows;
  } else if (wf == WeightFormat::Fp4) {
    panel = rows > kDotBlockRows;
  } else if (wf == WeightFormat::Fp8) {
    panel = rows > kDotFp8BlockRows;
  }
  return panel ? RowPath::Panel : RowPath::Blocks;
}

RowsPlan rows_plan(GemmKernel kernel, Isa isa, WeightFormat wf, int64_t rows) {
  RowsPlan p;
  if (rows <= 0) return p;  // GemmKernel::None
  p.kernel = kernel;
  p.isa = isa;
  p.path = row_path(kernel, isa, wf, rows);
  p.rows = rows;
  return p;
}

}  // namespace

ExpertGemmPlan plan_expert_gemm(Isa isa, WeightFormat wf, const uint8_t* a_bf16, int64_t m) {
  ExpertGemmPlan plan;
  plan.isa = isa;
  plan.weight_format = wf;
  // Row forms: only avx512bf16 and amx prepare rows in bf16 (prepare_activation); every other ISA's are float32.
  const bool bf16_products = isa == Isa::Avx512Bf16 || isa == Isa::Amx;
  int64_t n_bf16 = 0;
  if (bf16_products && a_bf16 != nullptr)
    for (int64_t i = 0; i < m; ++i) n_bf16 += a_bf16[i] != 0;
  plan.forms = n_bf16 == 0 ? RowForms::Float32 : (n_bf16 == m ? RowForms::Bf16 : RowForms::Mixed);
  // float32 rows: the fp32-FMA kernel of the ISA (avx512bf16 and amx: avx512's).
  plan.f32 = rows_plan(GemmKernel::Float32, bf16_products ? Isa::Avx512 : isa, wf, m - n_bf16);
  // bf16 rows: vdpbf16ps, or the tiles with vdpbf16ps for the weight rows they leave.
  if (isa == Isa::Amx) {
    plan.bf16 = rows_plan(GemmKernel::Tiles, Isa::Amx, wf, n_bf16);
    plan.fallback = rows_plan(GemmKernel::Dot, Isa::Avx512Bf16, wf, n_bf16);
  } else {
    plan.bf16 = rows_plan(GemmKernel::Dot, Isa::Avx512Bf16, wf, n_bf16);
  }
  return plan;
}

namespace {

// One RowsPlan over its p.rows rows a.
bool run_rows(const RowsPlan& p, const RowsPlan& fallback, const float* const* a, const ExpertWeight& w, int64_t n0,
              int64_t n1, const OutRows& out, const TileRows* tiles) {
  switch (p.kernel) {
    case GemmKernel::None:
      return true;
    case GemmKernel::Float32:
      switch (p.isa) {
        case Isa::Avx512:
          return avx512::run(p.path, a, p.rows, w, n0, n1, out);
        case Isa::Avx2:
          return avx2::run(p.path, a, p.rows, w, n0, n1, out);
        default:
          return scalar::run(p.path, a, p.rows, w, n0, n1, out);
      }
    case GemmKernel::Dot:
      return avx512bf16::run(p.path, a, p.rows, w, n0, n1, out);
    case GemmKernel::Tiles:
      return amx::run(fallback, a, p.rows, w, n0, n1, out, tiles);
  }
  return true;
}

}  // namespace

bool run_expert_gemm(const ExpertGemmPlan& plan, const float* const* a, const uint8_t* a_bf16, const ExpertWeight& w,
                     int64_t n0, int64_t n1, const OutRows& out, const TileRows* tiles) {
  if (n1 <= n0) return true;
  switch (plan.forms) {
    case RowForms::Float32:
      return run_rows(plan.f32, plan.fallback, a, w, n0, n1, out, tiles);
    case RowForms::Bf16:
      return run_rows(plan.bf16, plan.fallback, a, w, n0, n1, out, tiles);
    case RowForms::Mixed:
      break;
  }
  // Both forms: each kernel over the rows of its form, in order, with their outputs.
  std::vector<const float*> rows[2];
  std::vector<void*> outs[2];
  std::vector<float> bias_scales[2];
  for (int64_t i = 0; i < plan.f32.rows + plan.bf16.rows; ++i) {
    rows[a_bf16[i] != 0].push_back(a[i]);
    outs[a_bf16[i] != 0].push_back(out.rows[i]);
    if (out.bias_scale != nullptr) bias_scales[a_bf16[i] != 0].push_back(out.bias_scale[i]);
  }
  OutRows o32 = out, o16 = out;
  o32.rows = outs[0].data();
  o16.rows = outs[1].data();
  if (out.bias_scale != nullptr) {
    o32.bias_scale = bias_scales[0].data();
    o16.bias_scale = bias_scales[1].data();
  }
  const bool ok32 = run_rows(plan.f32, plan.fallback, rows[0].data(), w, n0, n1, o32, tiles);
  const bool ok16 = run_rows(plan.bf16, plan.fallback, rows[1].data(), w, n0, n1, o16, tiles);
  return ok32 && ok16;
}

bool expert_gemm_rows(Isa isa, const float* const* a, const uint8_t* a_bf16, int64_t m, const ExpertWeight& w,
                      int64_t n0, int64_t n1, const OutRows& out, const TileRows* tiles) {
  return run_expert_gemm(plan_expert_gemm(isa, w.format, a_bf16, m), a, a_bf16, w, n0, n1, out, tiles);
}

void TileRows::pack(const float* const* a, const uint8_t* a_bf16, int64_t m, int64_t k) {
  std::vector<const uint32_t*> src;  // the bf16 rows, as pairs of bf16 words
  for (int64_t i = 0; i < m; ++i)
    if (a_bf16 == nullptr || a_bf16[i] != 0) src.push_back(reinterpret_cast<const uint32_t*>(a[i]));
  rows_ = static_cast<int64_t>(src.size());
  k_ = k;
  const int64_t groups = (rows_ + 15) / 16, units = k / 32;
  const int64_t words = groups * units * 256 + 16;  // + 16: room to align the base to 64 bytes
  if (words > capacity_) {
    buf_.reset(new uint32_t[static_cast<size_t>(words)]);
    capacity_ = words;
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf_.get());
  base_ = buf_.get() + ((64 - p % 64) % 64) / sizeof(uint32_t);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = std::min<int64_t>(16, rows_ - 16 * g);
    for (int64_t u = 0; u < units; ++u) {
      uint32_t* d = base_ + (g * units + u) * 256;
      for (int64_t kp = 0; kp < 16; ++kp)
        for (int64_t i = 0; i < rows; ++i) d[kp * 16 + i] = src[16 * g + i][u * 16 + kp];
    }
  }
}

}  // namespace cpu
}  // namespace static_moe
