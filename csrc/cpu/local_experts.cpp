// CPU binding of local_experts (SPEC §1.7, the fused step 2 of the forward): checks (csrc/checks/local_experts.h),
// routing bookkeeping, then one OpenMP team over all experts:
//
//   routing   per local expert e, its rows in increasing order and their weights w = Σ (in slot order) of the
//             row's top-k weights whose id is e's global id; rows / slots naming other ids are never read further
//   prepare   every routed row of x -> the GEMM operand form (float32, or bf16 where exact) and lane layout, once
//             (OpenMP over rows)
//   per expert e with rows, in increasing e (experts without rows: no work, no weight reads), each of its two
//   GEMMs planned once (csrc/cpu/kernels/expert_gemm_plan.h) and the plan run on every chunk:
//     for each chunk [i0, i1) of intermediate columns (128, or fewer on a team with more threads than chunks:
//     chunk_columns), by whichever thread takes it:
//       GEMM1  gate rows [i0, i1) and up rows [I+i0, I+i1) of W13_e (+ b13) -> h = bf16 [m, gate | up]  (thread-local)
//       SwiGLU + cast of h with w (kernel of csrc/cpu/kernels/swiglu_and_cast.h; an fp8 group never straddles
//              chunks, so scales are those of the whole row) -> z columns [i0, i1) -> prepared into zf[e % 2]
//     barrier (GEMM2 needs every column of z)
//     for each chunk [h0, h1) of hidden columns: GEMM2 rows [h0, h1) of W2_e over zf[e % 2] (+ w·b2)
//                                                -> acc[row, h0:h1] += float(bf16(d))
//   No barrier after GEMM2: a thread moves on to the next expert's GEMM1. zf is double-buffered, so that is safe:
//   a thread can only write zf[e % 2] again (expert e + 2) after the barrier of e + 1, which every thread reaches
//   only after its GEMM2 chunks of e; and GEMM2 chunks of e + 1 start after that barrier too, so every acc element
//   gets its fp32 adds in increasing expert order, as the reference, whichever threads do them.
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "checks/local_experts.h"
#include "cpu/kernels/expert_gemm.h"
#include "cpu/kernels/expert_gemm_plan.h"
#include "cpu/expert_gemm_binding.h"

// The swiglu_and_cast kernel compiled exactly as csrc/cpu/swiglu_and_cast.cpp compiles it (same options, same
// clones), so z here is bitwise the op's output: no trapping-math (lets the clamps vectorise), no FMA contraction.
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math", "fp-contract=off")
#include "cpu/kernels/swiglu_and_cast.h"

namespace {

__attribute__((target_clones("avx512f", "avx2", "default"), flatten)) void swiglu_rows(
    const static_moe::cpu::SwigluParams& p, float* scratch) {
  static_moe::cpu::swiglu_and_cast_rows(p, 0, p.rows, scratch);
}

}  // namespace
#pragma GCC pop_options

namespace {

using namespace static_moe;

// Work is handed out in chunks, first come first served (OpenMP dynamic schedule), so a thread that streams its
// weights faster does not wait at the barrier for a slower one. Chunk sizes: whole fp8 groups (g <= 128) and a
// multiple of every NR; small enough for ~16 chunks per expert at V4-Flash sizes, large enough that the
// prefetch run-in at a chunk start costs little.
constexpr int64_t kInterChunk = 128;   // intermediate columns: gate rows and the matching up rows of W13
constexpr int64_t kHiddenChunk = 256;  // hidden columns: rows of W2
// A team with more threads than those sizes give chunks (Qwen3-30B-A3B: H = 2048 is 8 hidden chunks, I = 768 six
// intermediate ones, so 8 threads at most) would leave the rest idle while the weights stream: there the chunks
// shrink to about one chunk per thread, in whole steps, while a chunk still streams kMinChunkBytes of weights
// (below that a thread's start costs more than its share saves). Any size gives the same bits: a chunk is
// a range of output columns, each of which one thread computes whole over K. Steps: 64 hidden columns; for the
// intermediate ones (z's columns) the multiple prepare_activation takes them in: 32, 64 for fp8 weights, and the
// group (32 or 128) for fp8 x, which a chunk must hold whole. Every step is a multiple of every NR and of an AMX
// tile's 16 columns, and divides the default sizes.
constexpr int64_t kHiddenStep = 64;
constexpr int64_t kMinChunkBytes = 32 << 10;

// Columns per chunk of n output columns for `threads`: n / threads rounded up to a whole step (so at most one
// chunk per thread, and chunks of near one size), at least kMinChunkBytes of weights (`bytes_per_column` per output
// column) and at most `largest` (a multiple of `step`), which a team of at most n / largest threads keeps.
int64_t chunk_columns(int64_t n, int threads, int64_t largest, int64_t step, int64_t bytes_per_column) {
  const auto round_up = [step](int64_t v) { return (v + step - 1) / step * step; };
  const int64_t even = round_up((n + threads - 1) / threads);
  const int64_t least = round_up((kMinChunkBytes + bytes_per_column - 1) / bytes_per_column);
  return std::min(largest, std::max(even, least));
}

// Rows routed to each local expert, grouped by expert (CSR), and the routing weight of each.
struct Routing {
  std::vector<int64_t> begin;    // [L + 1]: expert e's entries are [begin[e], begin[e+1])
  std::vector<int64_t> rows;     // x row of each entry, increasing within an expert
  std::vector<float> weights;    // its routing weight
  std::vector<int64_t> routed;   // rows routed to at least one local expert, increasing
  std::vector<int64_t> slot_of;  // [R]: index of the row in `routed`, -1 if none
  int64_t max_rows = 0;          // most rows of one expert
};

Routing route(const at::Tensor& topk_idx, const at::Tensor& topk_weights, int64_t expert_offset, int64_t L) {
  const char* op = "local_experts";
  const at::Tensor idx = topk_idx.to(at::kLong).contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const int64_t R = idx.size(0), k = idx.size(1);
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  const float* wp = wts.const_data_ptr<float>();
  for (int64_t i = 0; i < R * k; ++i) {
    TORCH_CHECK_VALUE(ip[i] >= -1, op, ": topk_idx must hold global expert ids >= 0 or -1 (empty slot), got ", ip[i],
                      " at [", i / k, ", ", i % k, "]");
  }
  Routing rt;
  std::vector<int64_t> count(L + 1, 0);
  std::vector<int64_t> first(static_cast<size_t>(R * k), 0);  // 1 where a slot is the row's first naming its id
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ip[r * k + j] - expert_offset;
      if (ip[r * k + j] < 0 || e < 0 || e >= L) continue;
      bool seen = false;
      for (int64_t jj = 0; jj < j; ++jj) seen = seen || ip[r * k + jj] == ip[r * k + j];
      if (!seen) {
        first[r * k + j] = 1;
        ++count[e];
      }
    }
  }
  rt.begin.assign(L + 1, 0);
  for (int64_t e = 0; e < L; ++e) rt.begin[e + 1] = rt.begin[e] + count[e];
  rt.rows.resize(rt.begin[L]);
  rt.weights.resize(rt.begin[L]);
  rt.slot_of.assign(R, -1);
  std::vector<int64_t> fill(rt.begin.begin(), rt.begin.end() - 1);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      if (!first[r * k + j]) continue;
      const int64_t id = ip[r * k + j];
      float w = 0.0f;  // the reference's slot-order sum: 0 + w_j0 + w_j1 + ... over the slots naming id
      for (int64_t jj = j; jj < k; ++jj)
        if (ip[r * k + jj] == id) w += wp[r * k + jj];
      const int64_t at = fill[id - expert_offset]++;
      rt.rows[at] = r;
      rt.weights[at] = w;
      if (rt.slot_of[r] < 0) {
        rt.slot_of[r] = static_cast<int64_t>(rt.routed.size());
        rt.routed.push_back(r);
      }
    }
  }
  for (int64_t e = 0; e < L; ++e) rt.max_rows = std::max(rt.max_rows, count[e]);
  return rt;
}

at::Tensor local_experts_cpu(const at::Tensor& x, const std::optional<at::Tensor>& x_scale, const at::Tensor& topk_idx,
                             const at::Tensor& topk_weights, const at::Tensor& w13,
                             const std::optional<at::Tensor>& w13_scale, const at::Tensor& w2,
                             const std::optional<at::Tensor>& w2_scale, int64_t expert_offset,
                             std::optional<double> swiglu_limit, double fp8_max, c10::string_view weight_layout,
                             c10::string_view activation, double alpha, const std::optional<at::Tensor>& w13_bias,
                             const std::optional<at::Tensor>& w2_bias) {
  const char* op = "local_experts";
  const checks::WeightLayout layout = checks::parse_weight_layout({weight_layout.data(), weight_layout.size()}, op);
  const checks::LocalExpertsShape sh = checks::check_local_experts(
      x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, swiglu_limit, fp8_max, op,
      layout, {activation.data(), activation.size()}, alpha, w13_bias, w2_bias);
  checks::check_device_type(x, op, "x", c10::DeviceType::CPU);
  checks::refuse_prepared_layout(layout, op, "CPU");
  const cpu::Isa isa = cpu::isa_for_call(op);
  const int64_t R = sh.rows, H = sh.hidden, I = sh.inter, L = sh.num_local;
  const Routing rt = route(topk_idx, topk_weights, expert_offset, L);

  at::Tensor acc = at::zeros({R, H}, x.options().dtype(at::kFloat));
  const int64_t n_routed = static_cast<int64_t>(rt.routed.size());
  if (n_routed == 0 || H == 0) return acc;

  const cpu::WeightTensors w13t = cpu::weight_tensors(w13, w13_scale, sh.weight, H);
  const cpu::WeightTensors w2t = cpu::weight_tensors(w2, w2_scale, sh.weight, I);
  const cpu::WeightFormat wf = w13t.format;
  const bool fp8 = sh.act == checks::Format::FP8;
  const cpu::ActFormat af = fp8 ? cpu::ActFormat::Fp8 : cpu::ActFormat::Bf16;
  const int64_t group = fp8 ? sh.group : 128;

  const at::Tensor x_c = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor xs_c = fp8 ? x_scale->contiguous() : at::Tensor();
  const uint8_t* x_base = static_cast<const uint8_t*>(x_c.const_data_ptr());
  const int64_t x_row_bytes = x_c.stride(0) * x_c.element_size();
  float* acc_base = acc.mutable_data_ptr<float>();

  // SPEC §1.9 biases, widened once to float32: [L, 2I] and [L, H], one row per local expert.
  const at::Tensor b13 = checks::has_tensor(w13_bias) ? w13_bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor b2 = checks::has_tensor(w2_bias) ? w2_bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b13_base = b13.defined() ? b13.const_data_ptr<float>() : nullptr;
  const float* b2_base = b2.defined() ? b2.const_data_ptr<float>() : nullptr;

  const int threads = omp_get_max_threads();
  // Bytes of one stored weight row (fp4: two codes a byte), as the tensors hold them.
  const int64_t w13_row_bytes = w13t.q.size(2) * w13t.q.element_size();
  const int64_t w2_row_bytes = w2t.q.size(2) * w2t.q.element_size();
  const int64_t inter_step = std::max<int64_t>(wf == cpu::WeightFormat::Fp8 ? 64 : 32, fp8 ? group : 32);
  const int64_t inter_chunk =
      chunk_columns(I, threads, kInterChunk, inter_step, 2 * w13_row_bytes);  // a gate and an up row of W13
  const int64_t hidden_chunk = chunk_columns(H, threads, kHiddenChunk, kHiddenStep, w2_row_bytes);  // a W2 row

  const int64_t M = rt.max_rows;
  cpu::PreparedRows xf(n_routed, H);       // routed rows of x, prepared for W13
  std::vector<uint8_t> xf_bf16(n_routed);  // the form prepare_activation chose for each
  cpu::PreparedRows zf(2 * M, I);          // z of the current / previous expert, for W2
  // z's form per row and intermediate chunk; a row's chunks always agree (z has power-of-two scales >= the amax
  // floor's, so every chunk is exact in bf16 where bf16 is used at all); checked before GEMM2 reads them.
  std::vector<uint8_t> zf_bf16(static_cast<size_t>(2 * M * ((I + inter_chunk - 1) / inter_chunk)));

  const int64_t n_inter_chunks = (I + inter_chunk - 1) / inter_chunk;
  const int64_t n_hidden_chunks = (H + hidden_chunk - 1) / hidden_chunk;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n_hidden_chunks)));
  const int64_t z_bytes = fp8 ? 1 : 2;
  int bad13 = 0, bad2 = 0, mixed_z = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad13, bad2, mixed_z)
  {
    // Per-thread buffers for one intermediate chunk of one expert.
    std::vector<uint16_t> h(static_cast<size_t>(M * 2 * inter_chunk));       // bf16 [m, gate | up]
    std::vector<uint8_t> z(static_cast<size_t>(M * inter_chunk * z_bytes));  // z of the chunk's columns
    std::vector<float> zs(static_cast<size_t>(M * (inter_chunk / 32)));      // their group scales (fp8)
    std::vector<float> v(static_cast<size_t>(inter_chunk));                  // swiglu scratch
    std::vector<const float*> a_rows(M);
    std::vector<uint8_t> a_bf16(M);
    std::vector<void*> out_rows(M);
    cpu::TileRows tiles;  // this expert's GEMM operand in the AMX tiles' layout (each thread packs its own)

#pragma omp for schedule(static)
    for (int64_t p = 0; p < n_routed; ++p) {
      const int64_t r = rt.routed[p];
      const float* srow = fp8 ? xs_c.const_data_ptr<float>() + r * xs_c.stride(0) : nullptr;
      xf_bf16[p] = cpu::prepare_activation(isa, wf, af, x_base + r * x_row_bytes, srow, group, 0, H, xf.row(p));
    }  // implicit barrier: xf complete

    int par = 0;
    for (int64_t e = 0; e < L; ++e) {
      const int64_t b = rt.begin[e], m = rt.begin[e + 1] - b;
      if (m == 0) continue;  // the same on every thread: the worksharing constructs and barriers match
      const cpu::ExpertWeight w1 = cpu::expert_view(w13t, e);
      uint8_t* zfe_bf16 = zf_bf16.data() + par * M * n_inter_chunks;
      for (int64_t i = 0; i < m; ++i) {
        a_rows[i] = xf.row(rt.slot_of[rt.rows[b + i]]);
        a_bf16[i] = xf_bf16[rt.slot_of[rt.rows[b + i]]];
      }
      const cpu::ExpertGemmPlan plan1 = cpu::plan_expert_gemm(isa, wf, a_bf16.data(), m);
      if (plan1.uses_tiles()) tiles.pack(a_rows.data(), a_bf16.data(), m, H);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t c = 0; c < n_inter_chunks; ++c) {
        const int64_t i0 = c * inter_chunk, i1 = std::min(I, i0 + inter_chunk), It = i1 - i0;
        for (int64_t i = 0; i < m; ++i) out_rows[i] = h.data() + i * 2 * It;
        cpu::OutRows o;
        o.kind = cpu::OutKind::StoreBf16;
        o.rows = out_rows.data();
        o.bias = b13_base != nullptr ? b13_base + e * 2 * I : nullptr;  // indexed by the w13 row
        o.col0 = i0;                                                    // gate rows [i0, i1) -> h[i][0, It)
        if (!cpu::run_expert_gemm(plan1, a_rows.data(), a_bf16.data(), w1, i0, i1, o, &tiles)) bad13 = 1;
        o.col0 = I + i0 - It;  // up rows [I+i0, I+i1) -> h[i][It, 2It)
        if (!cpu::run_expert_gemm(plan1, a_rows.data(), a_bf16.data(), w1, I + i0, I + i1, o, &tiles)) bad13 = 1;

        cpu::SwigluParams sp;
        sp.rows = m;
        sp.inter = It;
        sp.gate_up = h.data();
        sp.gate_up_bf16 = true;
        sp.gate_up_row_stride = 2 * It;
        sp.row_weight = rt.weights.data() + b;
        sp.has_limit = swiglu_limit.has_value();
        sp.limit = sp.has_limit ? static_cast<float>(*swiglu_limit) : 0.0f;
        sp.act = static_cast<cpu::Act>(sh.activation);
        sp.alpha = static_cast<float>(alpha);
        sp.out_fp8 = fp8;
        sp.group = group;
        sp.fp8_max = static_cast<float>(fp8_max);
        sp.pow2_scale = true;
        sp.out = z.data();
        sp.scale = fp8 ? zs.data() : nullptr;
        swiglu_rows(sp, v.data());
        for (int64_t i = 0; i < m; ++i) {
          zfe_bf16[i * n_inter_chunks + c] =
              cpu::prepare_activation(isa, wf, af, z.data() + i * It * z_bytes,
                                      fp8 ? zs.data() + i * (It / group) : nullptr, group, i0, It, zf.row(par * M + i));
        }
      }
#pragma omp barrier
      const cpu::ExpertWeight w2e = cpu::expert_view(w2t, e);
      for (int64_t i = 0; i < m; ++i) {
        a_rows[i] = zf.row(par * M + i);
        a_bf16[i] = n_inter_chunks > 0 ? zfe_bf16[i * n_inter_chunks] : 0;
        for (int64_t c = 1; c < n_inter_chunks; ++c) mixed_z |= zfe_bf16[i * n_inter_chunks + c] != a_bf16[i];
        out_rows[i] = acc_base + rt.rows[b + i] * H;
      }
      const cpu::ExpertGemmPlan plan2 = cpu::plan_expert_gemm(isa, wf, a_bf16.data(), m);
      if (plan2.uses_tiles() && !mixed_z) tiles.pack(a_rows.data(), a_bf16.data(), m, I);
      cpu::OutRows o;
      o.kind = cpu::OutKind::AddBf16ToF32;
      o.rows = out_rows.data();
      o.col0 = 0;
      o.bias = b2_base != nullptr ? b2_base + e * H : nullptr;  // d = bf16(z·W2ᵀ + w·b2), SPEC §1.9
      o.bias_scale = rt.weights.data() + b;
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t c = 0; c < n_hidden_chunks; ++c) {
        if (mixed_z) continue;  // never happens (see zf_bf16); reported below rather than computed wrongly
        if (!cpu::run_expert_gemm(plan2, a_rows.data(), a_bf16.data(), w2e, c * hidden_chunk,
                                  std::min(H, (c + 1) * hidden_chunk), o, &tiles)) {
          bad2 = 1;
        }
      }
      par ^= 1;
    }
  }
  TORCH_CHECK(!mixed_z, op,
              ": internal error: z rows prepared in mixed forms; please report (STATIC_MOE_CPU_ISA=avx512 "
              "avoids it)");
  TORCH_CHECK_VALUE(!bad13, op,
                    ": w13_scale holds the UE8M0 NaN byte 255 in a routed expert; scale bytes must be "
                    "0..254 (value 2^(b-127))");
  TORCH_CHECK_VALUE(!bad2, op,
                    ": w2_scale holds the UE8M0 NaN byte 255 in a routed expert; scale bytes must be "
                    "0..254 (value 2^(b-127))");
  return acc;
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CPU, m) { m.impl("local_experts", &local_experts_cpu); }
