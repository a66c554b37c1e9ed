// The GEMM core of expert_gemm and local_experts (SPEC §1.6-1.7), torch-free: raw pointers, sizes, strides.
//
//   C[i, n] = Σ_k A[i, k] · B[n, k]   for the m prepared activation rows i and the weight rows n in [n0, n1)
//
// B is one expert's weight matrix, stored as nn.Linear stores it ([N, K], K contiguous) in bf16, fp8 e4m3fn with
// float32 1×128 scales, or fp4 e2m1 (two per byte, low nibble = even k) with UE8M0 1×32 scales. It is decoded on
// the fly, one unit (a few dozen k of one weight row) at a time, straight into registers, and used there by a block
// of up to MR activation rows × NR weight rows of accumulators (more rows: the NR weight rows, still in L1, are
// decoded again per row block, or decoded once per 512-k chunk into a panel in L1 that every row block reads) —
// never a whole weight tensor. Which kernel, blocking and path a call takes is decided once, by plan_expert_gemm
// (expert_gemm_plan.h). The next NR weight rows and their scales are prefetched one block ahead, so one core keeps
// enough DRAM reads in flight.
//
// Numerics: every operand is decoded to float32 exactly as formats.py dequantizes it (fp8: q·s rounded once in
// fp32; fp4: e2m1 · 2^(b-127), exact), so products are those of the reference. Each output is one W-lane fp32
// accumulator per (row, weight row) walked through K in increasing order, then a fixed horizontal sum: the
// arithmetic of a row never depends on which or how many other rows, weight rows or threads there are (batch
// invariance). Different ISAs use different lane counts and may differ in the last bits.
// Avx512Bf16 (expert_gemm_avx512bf16.cpp) multiplies in bf16 with vdpbf16ps where that is exact: operands that are
// bf16 numbers anyway (bf16 weights and activations; e2m1 times a power-of-two scale; e4m3fn values, and e4m3fn
// times a power-of-two scale), products exact in fp32, pairs summed into 16 fp32 lanes; an fp8 weight's float32
// block scale is applied once per 128-k block sum. Other rows take the AVX-512 float32 path. vdpbf16ps treats
// bf16 subnormals as zero: fp4 blocks with scale bytes 0 or 1 (weights below 2^-126) are decoded 2^64 larger and
// their sums scaled back, so only results (and partial sums) below 2^-126 differ from the reference's subnormals.
// Amx (expert_gemm_amx.cpp, chosen only by STATIC_MOE_CPU_ISA=amx) multiplies the same bf16 operands with AMX tiles:
// each output one fp32 sum through K, unit by unit; fp8 weights fold per 128-k block as on the fold path.
//
// A operand: the GEMM reads float32 (or, on Avx512Bf16, bf16) rows in a "lane layout" that depends on the ISA and,
// for fp4 weights, pairs each lane with the nibble order of the packed weights (see prepare_activation). Produce it
// with prepare_activation; rows may live anywhere (an array of row pointers), so callers gather rows for free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu/simd.h"

namespace static_moe {
namespace cpu {

enum class WeightFormat : int { Bf16 = 0, Fp8 = 1, Fp4 = 2 };
enum class ActFormat : int { Bf16 = 0, Fp8 = 1 };

constexpr int64_t kFp8WeightBlock = 128;  // fp8 weight scale: one float32 per 1×128 along K
constexpr int64_t kFp4WeightBlock = 32;   // fp4 weight scale: one UE8M0 byte per 1×32 along K

// One expert's weights B [n, k] (logical k; fp4 rows hold k/2 bytes).
struct ExpertWeight {
  WeightFormat format = WeightFormat::Bf16;
  int64_t n = 0;
  int64_t k = 0;                  // multiple of 32 (of 128 for fp8)
  const uint8_t* data = nullptr;  // row r starts at data + r * row_stride
  int64_t row_stride = 0;         // bytes
  const void* scale = nullptr;    // fp8: float [n, k/128]; fp4: uint8 [n, k/32]; bf16: unused
  int64_t scale_row_stride = 0;   // elements
};

enum class OutKind : int {
  StoreBf16 = 0,     // ((uint16_t*)rows[i])[n - col0] = bf16(C[i, n])
  AddBf16ToF32 = 1,  // ((float*)rows[i])[n - col0] += float(bf16(C[i, n]))
};

struct OutRows {
  OutKind kind = OutKind::StoreBf16;
  void* const* rows = nullptr;  // one pointer per prepared activation row
  int64_t col0 = 0;             // column of rows[i][0]
  // SPEC §1.9: C[i, n] + bias[n] (bias_scale null) or C[i, n] + bias_scale[i] * bias[n] (one fp32 product), added
  // in fp32 before the bf16 rounding; bias null: no bias. bias is indexed by the absolute weight row n.
  const float* bias = nullptr;
  const float* bias_scale = nullptr;  // one per row, like `rows`
};

// Converts columns [c0, c0 + k) of one activation row into the form the GEMM of `isa` reads for weights of format
// `wf`, in the prepared row `row` (room for K floats, K the row's full length).
//   x: bf16 bits (af = Bf16) or e4m3fn codes (af = Fp8) of those columns; c0 and k multiples of 32 (of 64 for fp8
//   weights; and of `group` for fp8 x); x_scale: the float32 group scales from the one covering column c0 (fp8
//   only). Returns the form:
//   false  float32: ((float*)row)[c] for the k columns, in the ISA's lane layout (a fixed permutation within each
//          32-column unit for fp4 weights, see expert_gemm_impl.h): x.float() (bf16) or e4m3fn(x)·scale rounded once
//          in fp32 (fp8), exactly as the reference
//   true   bf16: ((uint16_t*)row)[c], the dot-product layout (Avx512Bf16 and Amx only, any weight format, in the
//          order its decode of fp4 and fp8 weights produces within each 32- or 64-column piece, when every value
//          is exact in bf16: always for bf16 x; for fp8 x when the scales are powers of two >= 2^-117, so that every
//          e4m3fn(x)·scale is a normal bf16 number — the float32 value itself)
// The form depends only on the row's own values, so a row's arithmetic never depends on other rows; when a row is
// prepared in pieces, every piece must come back with the same form. Rows of one GEMM may mix both forms (pass
// the flags to plan_expert_gemm and run_expert_gemm, or to expert_gemm_rows).
bool prepare_activation(Isa isa, WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group,
                        int64_t c0, int64_t k, float* row);

// Room for `rows` prepared rows of k columns. Each row starts on a 64-byte line (a vector load never straddles two
// lines) and rows are k + 16 floats apart, one line more than k: with a stride of k floats (a multiple of 4 KiB at
// model sizes) the MR rows of a GEMM block would sit in one L1 set at every column, and evict each other and the
// streamed weight lines.
class PreparedRows {
 public:
  PreparedRows(int64_t rows, int64_t k) : stride_(k + 16), buf_(static_cast<size_t>(rows * (k + 16) + 16)) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(buf_.data());
    base_ = buf_.data() + ((64 - p % 64) % 64) / sizeof(float);
  }
  float* row(int64_t i) { return base_ + i * stride_; }

 private:
  int64_t stride_;
  std::vector<float> buf_;
  float* base_;
};

// The bf16-form rows of one GEMM operand interleaved for Isa::Amx's tiles (expert_gemm_amx.cpp): groups of 16 rows;
// for each group and 32-k unit, 16 words (k pairs, in the prepared lane order) × the group's rows, 1 KiB, 64-byte
// aligned — the layout of a tile's B operand, so each tile load reads it as it is. Built once per operand (pack),
// read by every run of the GEMM over those rows, from any thread.
class TileRows {
 public:
  // Packs the rows a[i] with a_bf16[i] != 0 (all rows where a_bf16 is null), in order, k columns each (a
  // multiple of 32). Cheap where there are none.
  void pack(const float* const* a, const uint8_t* a_bf16, int64_t m, int64_t k);
  int64_t rows() const { return rows_; }
  // The 16 × 16 words of group g (rows 16g … 16g + 15), unit u.
  const uint32_t* unit(int64_t g, int64_t u) const { return base_ + (g * (k_ / 32) + u) * 256; }

 private:
  int64_t rows_ = 0, k_ = 0;
  std::unique_ptr<uint32_t[]> buf_;  // uninitialised: a last group's unused words are never read
  int64_t capacity_ = 0;             // words in buf_
  uint32_t* base_ = nullptr;
};

// C for the m rows a[0..m) (prepared for w.format by prepare_activation; a_bf16[i] its return value, or
// a_bf16 = nullptr when all are float32) and the weight rows [n0, n1), written through `out`. Single-threaded:
// callers split [0, N) across threads. Returns false if an fp4 UE8M0 scale byte it read was 255 (NaN); the outputs
// are then meaningless. Isa::Amx reads the bf16-form rows from `tiles` (packed from the same a, a_bf16, m and w.k)
// where given, and packs them itself where not (correct, but a cost per call).
// This is plan_expert_gemm then run_expert_gemm (expert_gemm_plan.h) in one call; a caller that runs many column
// ranges over the same rows makes the plan once and runs it on each.
bool expert_gemm_rows(Isa isa, const float* const* a, const uint8_t* a_bf16, int64_t m, const ExpertWeight& w,
                      int64_t n0, int64_t n1, const OutRows& out, const TileRows* tiles = nullptr);

}  // namespace cpu
}  // namespace static_moe
