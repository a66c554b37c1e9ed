// The one decision of the CPU expert GEMM (expert_gemm.h has the operation and its numerics): which kernel reads
// which rows, on which path, chosen once from the shape of the call and then run.
//
//   plan = plan_expert_gemm(isa, weight format, row forms, m)     once per GEMM operand (expert_gemm: per call;
//   run_expert_gemm(plan, rows, weight rows [n0, n1), ...)         local_experts: per expert and GEMM), then run on
//                                                                  every column range the threads take
//
// A plan fixes, from the ISA, the weight format and the rows alone:
//   row forms  prepare_activation chose float32 or bf16 for each row by its own values; each form runs through its
//              own kernel over its own rows (Mixed: the rows split by form), so a row's arithmetic never depends on
//              the other rows'
//   kernel     per form: Float32, fp32 FMA (expert_gemm_impl.h, compiled per ISA: scalar, avx2, avx512; the float32
//              rows of avx512bf16 and amx take avx512's); Dot, vdpbf16ps (expert_gemm_avx512bf16.cpp); Tiles,
//              TDPBF16PS (expert_gemm_amx.cpp)
//   row path   per kernel and row count, how it walks the rows for each block of weight rows (RowPath)
// What a plan cannot fix is data: the kind of each weight row's scales. An fp8 weight row takes Dot's pow2 or fold
// path by its own 1×128 scales, an fp4 chunk with a scale byte outside [2, 252] the slow decode, and Tiles leaves
// such fp4 rows to `fallback`. The kernels decide those per weight row (or chunk) from that row's scales alone, so
// a row's bits never depend on which weight rows share its block or its column range.
//
// Bits: every path of a kernel gives a row the same bits (each output one accumulator sequence through K in
// increasing order, whatever the blocking); the kernels differ from each other in the last bits (lane counts, bf16
// against fp32 products), so the plan never picks a kernel by row count.
#pragma once

#include <cstdint>

#include "cpu/kernels/expert_gemm.h"
#include "cpu/simd.h"

namespace static_moe {
namespace cpu {

enum class GemmKernel : int {
  None = 0,  // no rows of this form
  Float32,   // fp32 FMA over float32 rows
  Dot,       // vdpbf16ps over bf16 rows
  Tiles,     // AMX tiles over bf16 rows
};

// How a kernel walks the m rows for each block of NR weight rows.
enum class RowPath : int {
  OneRow = 0,  // m = 1: wider blocks of weight rows, so that one row still has enough accumulator chains
  Blocks,      // blocks of MR rows, each decoding the weight rows' units again (from L1)
  Panel,       // each 512-k chunk of the weight rows decoded once into a panel in L1 that every block of rows reads
  Tiles,       // AMX: groups of 16 rows, up to 80 per pass over K
};

// Rows per register block of the kernels, which plan_expert_gemm compares m with: more rows than one block take the
// decoded panel where the kernel has one (the kernels static_assert that they block this many rows).
constexpr int kFloat32BlockRows = 4;  // Float32, every ISA (V::kMR)
constexpr int kDotBlockRows = 6;      // Dot, bf16 and fp4 weights
constexpr int kDotFp8BlockRows = 4;   // Dot, fp8 weights: two accumulators per output (running sum, 128-k block)

// Whether the Float32 kernel of `isa` has a decoded panel (V::kPanelNR > 0): avx2 and avx512; scalar decodes in place.
constexpr bool float32_has_panel(Isa isa) { return isa == Isa::Avx2 || isa == Isa::Avx512; }

// One kernel over the rows of one form.
struct RowsPlan {
  GemmKernel kernel = GemmKernel::None;
  Isa isa = Isa::Scalar;  // the instruction set the kernel is compiled for
  RowPath path = RowPath::OneRow;
  int64_t rows = 0;  // rows of this form
};

enum class RowForms : int { Float32 = 0, Bf16, Mixed };

struct ExpertGemmPlan {
  Isa isa = Isa::Scalar;  // the instruction set of the call
  WeightFormat weight_format = WeightFormat::Bf16;
  RowForms forms = RowForms::Float32;
  RowsPlan f32;       // the float32-form rows
  RowsPlan bf16;      // the bf16-form rows (avx512bf16, amx)
  RowsPlan fallback;  // Tiles: the weight rows the tiles leave, over all the bf16 rows
  // Whether run_expert_gemm reads a TileRows: pack one (TileRows::pack) before running this plan.
  bool uses_tiles() const { return bf16.kernel == GemmKernel::Tiles; }
};

// The plan for m rows prepared by prepare_activation(isa, wf, ...) with forms a_bf16 (nullptr: all float32).
ExpertGemmPlan plan_expert_gemm(Isa isa, WeightFormat wf, const uint8_t* a_bf16, int64_t m);

// C for the rows a[0..m) (the a, a_bf16 and m the plan was made for) and weight rows [n0, n1) of w (of the plan's
// weight format), written through `out`, as expert_gemm_rows. tiles: where plan.uses_tiles(), the rows packed by
// TileRows::pack from the same a, a_bf16, m and w.k (nullptr: packed per call).
bool run_expert_gemm(const ExpertGemmPlan& plan, const float* const* a, const uint8_t* a_bf16, const ExpertWeight& w,
                     int64_t n0, int64_t n1, const OutRows& out, const TileRows* tiles = nullptr);

// The kernels, one source each (expert_gemm_<isa>.cpp), run by run_expert_gemm on the m > 0 rows of their form
// and n0 < n1; prepare_activation's per-ISA halves (dispatch in expert_gemm_plan.cpp). Float32 instances take
// float32 rows and prepare them from column c0 at row + c0.
namespace scalar {
void prepare_activation(WeightFormat, ActFormat, const void*, const float*, int64_t, int64_t, float*);
bool run(RowPath, const float* const* a, int64_t m, const ExpertWeight&, int64_t n0, int64_t n1, const OutRows&);
}  // namespace scalar
namespace avx2 {
void prepare_activation(WeightFormat, ActFormat, const void*, const float*, int64_t, int64_t, float*);
bool run(RowPath, const float* const* a, int64_t m, const ExpertWeight&, int64_t n0, int64_t n1, const OutRows&);
}  // namespace avx2
namespace avx512 {
void prepare_activation(WeightFormat, ActFormat, const void*, const float*, int64_t, int64_t, float*);
bool run(RowPath, const float* const* a, int64_t m, const ExpertWeight&, int64_t n0, int64_t n1, const OutRows&);
}  // namespace avx512
namespace avx512bf16 {  // Dot: a holds bf16-form rows
bool prepare_activation(WeightFormat, ActFormat, const void*, const float*, int64_t, int64_t, int64_t, float*);
bool run(RowPath, const float* const* a, int64_t m, const ExpertWeight&, int64_t n0, int64_t n1, const OutRows&);
}  // namespace avx512bf16
namespace amx {  // Tiles: a holds bf16-form rows; prepare_activation is avx512bf16's (the same lane layout)
bool run(const RowsPlan& fallback, const float* const* a, int64_t m, const ExpertWeight&, int64_t n0, int64_t n1,
         const OutRows&, const TileRows* tiles);
}  // namespace amx

}  // namespace cpu
}  // namespace static_moe
