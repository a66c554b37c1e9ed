// CPU binding of expert_gemm (SPEC §1.6): checks (csrc/checks/expert_gemm.h), then the torch-free GEMM core
// (csrc/cpu/kernels/expert_gemm.h). Torch types stay in this file and csrc/cpu/expert_gemm_binding.h.
//
//   1. the active rows are the set bits of row_mask; only they are read (masked rows may hold NaN / 0xFF);
//   2. they are converted once to the GEMM's operand form (float32, or bf16 where exact) and lane layout (OpenMP
//      over rows);
//   3. the GEMM is planned once (kernel and path per row form, csrc/cpu/kernels/expert_gemm_plan.h); the expert's N
//      weight rows are cut in chunks of columns that the OpenMP threads take as they go, each running the plan, so
//      each weight byte is streamed once, by one thread, and decoded on the fly for every active row;
//   4. masked rows stay exact zeros; an optional bias [L, N] is added in fp32 before the bf16 rounding (SPEC §1.9).
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "checks/expert_gemm.h"
#include "cpu/column_chunks.h"
#include "cpu/kernels/expert_gemm.h"
#include "cpu/kernels/expert_gemm_plan.h"
#include "cpu/expert_gemm_binding.h"

namespace {

using namespace static_moe;

constexpr int64_t kParallelMacs = 1 << 18;  // below this many multiply-adds one thread beats waking a team

at::Tensor expert_gemm_cpu(const at::Tensor& a, const std::optional<at::Tensor>& a_scale, const at::Tensor& b,
                           const std::optional<at::Tensor>& b_scale, const at::Tensor& row_mask, int64_t expert,
                           c10::string_view weight_layout, const std::optional<at::Tensor>& bias) {
  const char* op = "expert_gemm";
  const checks::WeightLayout layout = checks::parse_weight_layout({weight_layout.data(), weight_layout.size()}, op);
  const checks::ExpertGemmShape sh = checks::check_expert_gemm(a, a_scale, b, b_scale, row_mask, expert, layout, bias);
  checks::check_device_type(a, op, "a", c10::DeviceType::CPU);
  checks::refuse_prepared_layout(layout, op, "CPU");
  const cpu::Isa isa = cpu::isa_for_call(op);
  const int64_t R = sh.rows, K = sh.k, N = sh.n;

  at::Tensor out = at::zeros({R, N}, a.options().dtype(at::kBFloat16));
  const at::Tensor mask = row_mask.contiguous();
  const bool* mp = mask.const_data_ptr<bool>();
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < R; ++r)
    if (mp[r]) rows.push_back(r);
  const int64_t m = static_cast<int64_t>(rows.size());
  if (m == 0 || N == 0) return out;

  const cpu::WeightTensors wt = cpu::weight_tensors(b, b_scale, sh.weight, K);
  const cpu::ExpertWeight w = cpu::expert_view(wt, expert);

  // Active rows of A -> float32 [m, K] in the lane layout of (isa, weight format).
  const at::Tensor a_c = a.stride(1) == 1 ? a : a.contiguous();
  const at::Tensor s_c = sh.act == checks::Format::FP8 ? a_scale->contiguous() : at::Tensor();
  const cpu::ActFormat af = sh.act == checks::Format::FP8 ? cpu::ActFormat::Fp8 : cpu::ActFormat::Bf16;
  cpu::PreparedRows a32(m, K);
  std::vector<uint8_t> a_bf16(m);  // the form prepare_activation chose for each row
  std::vector<const float*> a_rows(m);
  std::vector<void*> out_rows(m);
  const uint8_t* a_base = static_cast<const uint8_t*>(a_c.const_data_ptr());
  const int64_t a_row_bytes = a_c.stride(0) * a_c.element_size();
  uint16_t* out_base = static_cast<uint16_t*>(out.mutable_data_ptr());
  for (int64_t i = 0; i < m; ++i) {
    a_rows[i] = a32.row(i);
    out_rows[i] = out_base + rows[i] * N;
  }
  const bool parallel = m * N * K >= kParallelMacs;
#pragma omp parallel for schedule(static) if (parallel && m > 1)
  for (int64_t i = 0; i < m; ++i) {
    const float* srow = s_c.defined() ? s_c.const_data_ptr<float>() + rows[i] * s_c.stride(0) : nullptr;
    a_bf16[i] =
        cpu::prepare_activation(isa, w.format, af, a_base + rows[i] * a_row_bytes, srow, sh.group, 0, K, a32.row(i));
  }

  const cpu::ExpertGemmPlan plan = cpu::plan_expert_gemm(isa, w.format, a_bf16.data(), m);
  cpu::TileRows tiles;  // the bf16 rows in the AMX tiles' layout, once for every chunk
  if (plan.uses_tiles()) tiles.pack(a_rows.data(), a_bf16.data(), m, K);

  cpu::OutRows o;
  o.kind = cpu::OutKind::StoreBf16;
  o.rows = out_rows.data();
  o.col0 = 0;
  // SPEC §1.9: the expert's bias row, widened once to float32, added before the bf16 rounding.
  const at::Tensor bias_f =
      checks::has_tensor(bias) ? bias->select(0, expert).to(at::kFloat).contiguous() : at::Tensor();
  if (bias_f.defined()) o.bias = bias_f.const_data_ptr<float>();
  const int threads = parallel ? omp_get_max_threads() : 1;
  const std::vector<int64_t> bounds = cpu::column_chunk_bounds(N, threads);
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  const int nt = static_cast<int>(std::min<int64_t>(threads, chunks));
  int bad_scale = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(| : bad_scale)
  for (int64_t c = 0; c < chunks; ++c) {
    if (!cpu::run_expert_gemm(plan, a_rows.data(), a_bf16.data(), w, bounds[c], bounds[c + 1], o, &tiles))
      bad_scale = 1;
  }
  TORCH_CHECK_VALUE(!bad_scale, op, ": b_scale of expert ", expert,
                    " holds the UE8M0 NaN byte 255; scale bytes must be 0..254 (value 2^(b-127))");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CPU, m) { m.impl("expert_gemm", &expert_gemm_cpu); }
