// AVX-512 + AVX512_BF16 instance of the expert GEMM: bf16 products with vdpbf16ps (32 k per instruction into 16 fp32
// lanes, twice the multiply-adds of an fp32 FMA), used only where every operand is a bf16 number anyway, so each
// product is exact in fp32 as on the float32 path:
//   weights  bf16: loaded as they are. fp4: e2m1 times the block's power-of-two scale is a bf16 number; a 32-entry
//            bf16 table (the 16 e2m1 values, twice, so vpermw may ignore index bit 4) with the scale added to its
//            exponent field (non-zero entries; scale bytes 2..252: the fast path, all 251 tables precomputed in
//            kFp4Tables, which vpermw reads from memory), or, in
//            a chunk where some weight row has another byte, is built in fp32 and rounded (exact). Bytes 0 and 1
//            make every non-zero weight a bf16 subnormal (e2m1 · 2^(b-127) < 2^-126), which vdpbf16ps would read
//            as zero (DAZ, whatever MXCSR says): their units decode with the table of b + 64 instead (normal,
//            exact) into accumulators of their own, folded in once per 512-k chunk as acc = fma(lifted, 2^-64,
//            acc) (an exact power-of-two scale). A lifted product is normal whenever the true a·w is at least
//            2^-190, so every product that fp32 (the reference) does not flush is exact; what remains: a row's
//            result (or a lane's partial sum, which the next vdpbf16ps reads as zero if it is) below 2^-126 is
//            rounded differently from the reference's subnormal arithmetic (results ~1e-38, zero in bf16 terms
//            at any sensible scale), and for bytes >= 2 a product a·w below 2^-126 is flushed (with a block scale
//            of 2^-10, |a| < 2^-116; bf16 subnormal activations read as zero for every weight format). The 16
//            packed bytes, broadcast to the four 128-bit lanes, give the 32 word indices of one vpermw through one
//            vpsrlvw (each lane's words shifted right by their own count, so each keeps a different nibble), or,
//            decoding into the panel, one vpmultishiftqb (AVX512_VBMI): the same indices.
//            fp8: every e4m3fn value is a bf16 number (3 mantissa bits, exponents 2^-9..2^8). The 64 codes of a
//            cache line decode in six instructions: two vpermi2b (AVX512_VBMI: a 128-entry byte table, the code's
//            bits 0-6) give the low and the high byte of each magnitude's bf16 (NaN codes give NaN), one
//            vpternlogd ORs the code's sign bit into the high byte, and two vpunpck{l,h}bw interleave the bytes
//            into two units of 32 bf16 — in the lane order of fp8_column, which the activations take too;
//            products with bf16 activations are exact in fp32. The float32 1×128 block scales choose one of two
//            paths per weight row (fp8_row_pow2), by that row's scales alone, so that a row's bits never depend
//            on the rows blocked with it:
//            pow2 path: every scale of the row a power of two in [2^-117, 2^119] (UE8M0-style checkpoints, and
//              what quantize_weight_fp8 gives): the block's tables come with the scale already added to the
//              exponent fields (kFp8Scaled, exact: every product is a normal bf16 number), so that the weights
//              decode scaled and all of K sums into one accumulator, as fp4 does.
//            fold path (any other row): each 128-k block sums into accumulators of its own, then
//              acc = fma(block, s, acc) (the scale applied once per block instead of per weight: the last bits
//              differ from the float32 path's q·s rounding, within the reference tolerance; a product a·q below
//              2^-126, which vdpbf16ps flushes, needs an activation within 2^9 of the bf16 normal floor). The
//              fold costs 12 vfmadd per 48 vdpbf16ps and a second set of accumulators.
//   activations  rows prepared as bf16 when exact (see prepare_activation in expert_gemm.h), others float32 for the
//            AVX-512 path: run_expert_gemm splits a GEMM's rows by form (expert_gemm_plan.h), and this kernel
//            (GemmKernel::Dot) reads the bf16 ones.
// Lane layout of a 32-k unit: natural for bf16 weights; for fp4, position w holds column fp4_column(w) (the order
// the shifts produce); for fp8, position w of the line's unit v holds column fp8_column(v, w) of the line (the
// order the byte unpacks produce); activations are permuted the same way.
// GCC 12 flags the intrinsics headers' own `__m512i __Y = __Y;` placeholders wherever they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/kernels/cast.h"
#include "cpu/kernels/expert_gemm.h"
#include "cpu/kernels/expert_gemm_plan.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,avx2,fma,f16c,bmi,bmi2")

#include "cpu/kernels/bf16_units.h"
#include "cpu/kernels/expert_gemm_impl.h"

namespace static_moe {
namespace cpu {
namespace {

constexpr int64_t kChunk = 512;  // k per prepared chunk of fp4 scales (16 blocks)
// Blocking: MR activation rows × NR weight rows of accumulators, 6 × 4 = 24 of the 32 zmm registers. Each decoded
// weight unit serves MR rows, so a larger MR spends less decode per vdpbf16ps.
constexpr int kMR = 6;   // activation rows per block
constexpr int kNR = 4;   // weight rows per block
constexpr int kNR1 = 4;  // weight rows per block when there is one activation row
// fp8 weights keep two accumulators per (row, weight row) (the running sum and the 128-k block's): a smaller
// block, 4 × 3 × 2 = 24 zmm in the fold path's panels, so that both sets stay in the 32 zmm registers next to the
// panel's units. Decoding as it goes (2-4 rows, dot_block_fp8), a block is 4 × 2: 16 accumulators, the four
// decode-table registers and the line's four decoded units, so each activation unit is loaded once for both
// weight rows (4 × 3 left no register for that; docs/backends/cpu.md, "fp8 at 2–4 rows", has the times).
constexpr int kMRFp8 = 4;
constexpr int kNRFp8 = 3;
constexpr int kNRFp8Direct = 2;  // weight rows per block on the fp8 few-rows path (RowPath::Blocks)
static_assert(kMR == kDotBlockRows && kMRFp8 == kDotFp8BlockRows,
              "plan_expert_gemm takes the panel (RowPath::Panel) above these row counts");
// The decoded-panel path (RowPath::Panel): blocks of kMRPanel rows × kNRPanel weight rows (4 × 6 = 24
// accumulators) read the panel of fp4 weights (dot_panel_fp4) and of fp8 weights on the pow2 path; the fold path's
// panels hold kNRFp8 weight rows (two accumulators per output).
constexpr int kMRPanel = 4;
constexpr int kNRPanel = 6;
// Software prefetches of the next weight rows go to L2 (prefetcht1), not L1: L2 keeps more misses in flight, and
// one core streaming a weight row needs many in flight to reach DRAM bandwidth.
constexpr int kStreamHint = 2;

// fp4 scale bytes below kFp4LowByte make bf16 subnormals (e2m1 · 2^(b-127) < 2^-126), which vdpbf16ps reads as
// zero: their units decode with the table of b + kFp4Lift instead and sum apart, scaled by 2^-kFp4Lift at the end.
constexpr uint8_t kFp4LowByte = 2;
constexpr uint8_t kFp4Lift = 64;

// The fp4 scales of one chunk of a weight row.
struct Fp4Chunk {
  alignas(16) uint8_t byte[16];
  bool fast;  // every b in [2, 252]: the exponent add is exact for all non-zero e2m1 values
};

inline void fp4_chunk(const uint8_t* s, int nb, Fp4Chunk& c, uint32_t& bad) {
  const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1u);
  const __m128i b = _mm_maskz_loadu_epi8(live, s);
  bad |= _mm_mask_cmpeq_epi8_mask(live, b, _mm_set1_epi8(-1)) != 0;
  const __mmask16 low = _mm_mask_cmplt_epu8_mask(live, b, _mm_set1_epi8(2));
  const __mmask16 high = _mm_mask_cmpgt_epu8_mask(live, b, _mm_set1_epi8(static_cast<char>(252)));
  c.fast = (low | high) == 0;
  _mm_store_si128(reinterpret_cast<__m128i*>(c.byte), b);
}

// The scales of the chunk [kc, kend) of NR weight rows into ch (byte 255 sets bad); whether all are on the fast path.
template <int NR>
inline bool fp4_chunks(const uint8_t* const* rs, int64_t kc, int64_t kend, Fp4Chunk* ch, uint32_t& bad) {
  bool fast = true;
  for (int j = 0; j < NR; ++j) {
    fp4_chunk(rs[j] + kc / kFp4WeightBlock, static_cast<int>((kend - kc) / kFp4WeightBlock), ch[j], bad);
    fast = fast && ch[j].fast;
  }
  return fast;
}

// bf16 table of e2m1 · 2^(b-127) for a scale byte outside [2, 252]: built in fp32 (exact), rounded to bf16.
inline __m512i fp4_table_slow(uint8_t b) {
  const __m512 t = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                  -3.0f, -4.0f, -6.0f);
  const __m256i h = (__m256i)(_mm512_cvtneps_pbh(_mm512_mul_ps(t, _mm512_set1_ps(ue8m0_to_float(b)))));
  return _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
}

template <WeightFormat F, bool Fast>
inline __m512i decode(const uint8_t* row, int64_t k0, const uint8_t* scale_row) {
  if constexpr (F == WeightFormat::Bf16) {
    return _mm512_loadu_si512(row + 2 * k0);
  } else {
    static_assert(Fast, "chunks with scale bytes outside [2, 252] take slow_fp4_chunk");
    return fp4_unit(row, k0, fp4_table(scale_row, k0));
  }
}

// The MR activation units at k0 into av, each loaded once for all the weight rows of a block. The empty asm makes
// each value opaque to the compiler, so it stays in a register: with 24 accumulators live (the fp8 panel's running
// and block sums) GCC otherwise folds the load back into every vdpbf16ps, 12 + 3 loads per 12 products, where the
// core issues one zmm load per cycle (bench/micro/issue_rates.cpp) — the loads, not the products, would bound the
// block. The same bits either way. dot_block keeps its loads folded into the products, which suits it better.
template <int MR>
__attribute__((always_inline)) inline void load_units(const uint16_t* const* ap, int64_t k0, __m512i (&av)[MR]) {
  for (int i = 0; i < MR; ++i) {
    av[i] = _mm512_loadu_si512(ap[i] + k0);
    asm("" : "+v"(av[i]));
  }
}

// f(std::integral_constant<int, R>()) for the runtime row count r = R, 1 <= r <= MR: a block of exactly r rows,
// its accumulators in registers.
template <int MR, typename F>
__attribute__((always_inline)) inline void with_rows(int r, F&& f) {
  if constexpr (MR > 0) {
    if (r != MR) return with_rows<MR - 1>(r, f);
    f(std::integral_constant<int, MR>());
  }
}

template <int MR, int NR>
struct Accumulators {
  __m512 v[MR][NR];
};

// The units [kc, kend) of a chunk in which some weight row has a scale byte outside [2, 252] (see the header).
// Units with b >= 2 add into acc as on the fast path (table built in fp32, the same bf16 values); units with b < 2
// use the table of b + 64 (normal bf16 numbers, exact) and add into accumulators of their own, which
// acc = fma(lifted, 2^-64, acc) folds in when the chunk ends (exact, bar a subnormal result). A weight row whose
// chunk has no such byte keeps exactly the fast path's arithmetic, whatever the other rows of the block hold.
// Out of line (and reached through a copy of the accumulators), so that this rare path does not change the
// register allocation of dot_block's fast loop.
template <int MR, int NR>
__attribute__((noinline)) void slow_fp4_chunk(const uint16_t* const* ap, const uint8_t* const* rq, const Fp4Chunk* ch,
                                              int64_t kc, int64_t kend, Accumulators<MR, NR>& accs) {
  auto& acc = accs.v;
  const int nu = static_cast<int>((kend - kc) / kUnit);
  bool low[NR];
  bool any = false;
  for (int j = 0; j < NR; ++j) {
    low[j] = false;
    for (int u = 0; u < nu; ++u) low[j] = low[j] || ch[j].byte[u] < kFp4LowByte;
    any = any || low[j];
  }
  __m512 lifted[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) lifted[i][j] = _mm512_setzero_ps();
  for (int64_t k0 = kc; k0 < kend; k0 += kUnit) {
    const int u = static_cast<int>((k0 - kc) / kUnit);
    for (int j = 0; j < NR; ++j) {
      const uint8_t b = ch[j].byte[u];
      const bool lift = b < kFp4LowByte;
      const __m512i lut = fp4_table_slow(static_cast<uint8_t>(lift ? b + kFp4Lift : b));
      const __m512bh wv = (__m512bh)(fp4_unit(rq[j], k0, lut));
      if (lift) {
        for (int i = 0; i < MR; ++i)
          lifted[i][j] = _mm512_dpbf16_ps(lifted[i][j], (__m512bh)(_mm512_loadu_si512(ap[i] + k0)), wv);
      } else {
        for (int i = 0; i < MR; ++i)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)(_mm512_loadu_si512(ap[i] + k0)), wv);
      }
    }
  }
  if (!any) return;
  const __m512 down = _mm512_set1_ps(0x1p-64f);  // 2^-kFp4Lift
  for (int j = 0; j < NR; ++j) {
    if (!low[j]) continue;
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(lifted[i][j], down, acc[i][j]);
  }
}

// Software prefetches ask for weight rows at least this many bytes ahead of the block being read. A block's next
// rows are far enough where a block is long (4 rows of 2 KiB or more), but 4 fp8 rows of 768 bytes (Qwen3-30B's
// w2) are 3 KiB, which one core streams in about the time a DRAM read takes, so the next block's lines were still
// on their way when it began (docs/backends/cpu.md, "How far ahead", has the times; 16 KiB gained no more).
constexpr int64_t kPrefetchAheadBytes = 8192;

// Where a block of NR weight rows from n sends its prefetches: to the rows `ahead` after n, the next block's or, for
// short rows, as many blocks of NR further as make kPrefetchAheadBytes. A multiple of NR, so that every block
// asks for one later block's rows and every block past the first `ahead` rows of a range is asked for once.
template <int NR>
inline int64_t prefetch_ahead_rows(const ExpertWeight& w) {
  if (w.row_stride <= 0) return NR;  // no stream of rows to run ahead of
  int64_t ahead = NR;
  while (ahead * w.row_stride < kPrefetchAheadBytes) ahead += NR;  // a few steps (fp4 rows: 16 bytes or more)
  return ahead;
}

// The NR weight rows n … n + NR − 1 of w (bytes q, scales s of type S) and the start of the NR rows that block's
// prefetches ask for, prefetch_ahead_rows after n (next, next_s: hints only, never dereferenced). s is null where w
// has no scales (bf16).
template <typename S, int NR>
struct WeightRows {
  const uint8_t* q[NR];
  const S* s[NR];
  const uint8_t* next;
  const S* next_s;
  WeightRows(const ExpertWeight& w, int64_t n) {
    const S* scale = static_cast<const S*>(w.scale);
    for (int j = 0; j < NR; ++j) {
      q[j] = w.data + (n + j) * w.row_stride;
      s[j] = scale ? scale + (n + j) * w.scale_row_stride : nullptr;
    }
    const int64_t ahead = prefetch_ahead_rows<NR>(w);
    next = w.data + (n + ahead) * w.row_stride;
    next_s = scale ? scale + (n + ahead) * w.scale_row_stride : nullptr;
  }
};

// MR bf16 activation rows × NR weight rows, all of K: one 16-lane fp32 accumulator each, walked through K in order.
template <WeightFormat F, int MR, int NR>
void dot_block(const uint16_t* const* a, int64_t i0, const ExpertWeight& w, int64_t n, const OutRows& out,
               bool prefetch, uint32_t& bad_out) {
  constexpr int64_t KL = F == WeightFormat::Fp4 ? 128 : kUnit;  // k per 64-byte line of a weight row
  const uint16_t* ap[MR];
  for (int i = 0; i < MR; ++i) ap[i] = a[i0 + i];
  const WeightRows<uint8_t, NR> rows(w, n);  // fp4: UE8M0 scale bytes; bf16: no scales
  const auto& rq = rows.q;
  const auto& rs = rows.s;
  const uint8_t* const next = rows.next;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t K = w.k;
  // The units [kc, kend), with the fp4 table read for the block's byte (Fast) or built in fp32 (rare bytes).
  auto units = [&](int64_t kc, int64_t kend, auto fast) {
    for (int64_t kl = kc; kl < kend; kl += KL) {
      if (prefetch) {
        const int64_t byte = F == WeightFormat::Fp4 ? kl / 2 : kl * 2;
        for (int j = 0; j < NR; ++j) __builtin_prefetch(next + j * w.row_stride + byte, 0, kStreamHint);
      }
      for (int64_t k0 = kl; k0 < kl + KL; k0 += kUnit) {
        for (int j = 0; j < NR; ++j) {
          const __m512bh wv = (__m512bh)(decode<F, decltype(fast)::value>(rq[j], k0, rs[j]));
          for (int i = 0; i < MR; ++i) {
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)(_mm512_loadu_si512(ap[i] + k0)), wv);
          }
        }
      }
    }
  };
  auto prefetch_scales = [&](int64_t kc) {  // the next rows' scales of this chunk: a stream of its own
    if (F == WeightFormat::Fp4 && prefetch) {
      const uint8_t* ns = rows.next_s + kc / kFp4WeightBlock;
      for (int j = 0; j < NR; ++j) __builtin_prefetch(ns + j * w.scale_row_stride, 0, 3);
    }
  };
  if (F != WeightFormat::Fp4 || rows_fast<NR>(rs, K / kFp4WeightBlock)) {
    // Every scale byte fast (bf16 weights: no scales): one loop over K with no slow-path branch, so the
    // accumulators stay in registers from the first unit to the last (the same operations in the same order).
    for (int64_t kc = 0; kc < K; kc += kChunk) {
      prefetch_scales(kc);
      units(kc, K - kc < kChunk ? K : kc + kChunk, std::true_type());
    }
  } else if constexpr (F == WeightFormat::Fp4) {
    Fp4Chunk ch[NR];
    uint32_t bad = 0;
    for (int64_t kc = 0; kc < K; kc += kChunk) {
      const int64_t kend = K - kc < kChunk ? K : kc + kChunk;
      const bool fast = fp4_chunks<NR>(rs, kc, kend, ch, bad);
      prefetch_scales(kc);
      if (fast) {
        units(kc, kend, std::true_type());
      } else {
        Accumulators<MR, NR> t;
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) t.v[i][j] = acc[i][j];
        slow_fp4_chunk<MR, NR>(ap, rq, ch, kc, kend, t);
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) acc[i][j] = t.v[i][j];
      }
    }
    bad_out |= bad;
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) emit_output(out, i0 + i, n + j, _mm512_reduce_add_ps(acc[i][j]));
}

// dot_block for fp8 weights, blocks in increasing k, units in increasing k within a block. Fold path (Pow2
// false): per 128-k block, bf16 dot products into block accumulators, then the block's float32 scale once:
// acc = fma(block, s, acc). Pow2 path (every scale of the NR rows a power of two in range, see fp8_row_pow2): each
// block decodes with its scale's tables into scaled bf16 weights, and every product adds straight into acc.
template <int MR, int NR, bool Pow2>
void dot_block_fp8(const uint16_t* const* a, int64_t i0, const ExpertWeight& w, int64_t n, const OutRows& out,
                   bool prefetch) {
  constexpr int64_t KL = 64;  // k per 64-byte line of an fp8 weight row
  static_assert(kFp8WeightBlock % KL == 0 && KL % kUnit == 0, "a block holds whole lines, a line whole units");
  static_assert(KL == 2 * kUnit, "a line decodes into two units");
  const Fp8Decoder plain;
  const uint16_t* ap[MR];
  for (int i = 0; i < MR; ++i) ap[i] = a[i0 + i];
  const WeightRows<float, NR> rows(w, n);
  const auto& rq = rows.q;
  const auto& rs = rows.s;
  const uint8_t* const next = rows.next;
  const float* const next_s = rows.next_s;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t K = w.k;
  for (int64_t kb = 0; kb < K; kb += kFp8WeightBlock) {
    if (prefetch && kb % (16 * kFp8WeightBlock) == 0) {  // the next rows' scales: one line holds 16 blocks
      for (int j = 0; j < NR; ++j) __builtin_prefetch(next_s + j * w.scale_row_stride + kb / kFp8WeightBlock, 0, 3);
    }
    // The pow2 path sums into acc itself, with each row's tables for this block; the fold path into blk.
    __m512 blk[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) blk[i][j] = Pow2 ? acc[i][j] : _mm512_setzero_ps();
    const Fp8Bytes* scaled[NR];
    for (int j = 0; j < NR; ++j) scaled[j] = Pow2 ? &fp8_scaled_bytes(rs[j], kb) : nullptr;
    for (int64_t kl = kb; kl < kb + kFp8WeightBlock; kl += KL) {
      if (prefetch) {
        for (int j = 0; j < NR; ++j) __builtin_prefetch(next + j * w.row_stride + kl, 0, kStreamHint);
      }
      if constexpr (Pow2) {
        // The line's activation units held in registers, since each weight row's tables take four loads per line.
        __m512i av0[MR], av1[MR];
        load_units<MR>(ap, kl, av0);
        load_units<MR>(ap, kl + kUnit, av1);
        for (int j = 0; j < NR; ++j) {
          __m512i w0, w1;
          const Fp8Decoder decode8(*scaled[j]);
          decode8(rq[j] + kl, w0, w1);
          for (int i = 0; i < MR; ++i) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)av0[i], (__m512bh)w0);
          for (int i = 0; i < MR; ++i) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)av1[i], (__m512bh)w1);
        }
      } else {
        // The NR weight rows' line decoded first, then each row's two activation units loaded once for all NR
        // products. Decoded row by row inside the products, with 2 · MR · NR accumulators live GCC had no
        // registers left for the units and loaded each again for every weight row (2 · MR loads per weight row per
        // line, on a core that issues one zmm load per cycle). Every accumulator sees the same products in the
        // same order either way.
        __m512i w0[NR], w1[NR];
        for (int j = 0; j < NR; ++j) plain(rq[j] + kl, w0[j], w1[j]);
        for (int i = 0; i < MR; ++i) {
          const __m512i x0 = _mm512_loadu_si512(ap[i] + kl);
          const __m512i x1 = _mm512_loadu_si512(ap[i] + kl + kUnit);
          for (int j = 0; j < NR; ++j) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)x0, (__m512bh)w0[j]);
          for (int j = 0; j < NR; ++j) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)x1, (__m512bh)w1[j]);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      if constexpr (Pow2) {
        for (int i = 0; i < MR; ++i) acc[i][j] = blk[i][j];
      } else {
        const __m512 sv = _mm512_set1_ps(rs[j][kb / kFp8WeightBlock]);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(blk[i][j], sv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) emit_output(out, i0 + i, n + j, _mm512_reduce_add_ps(acc[i][j]));
}

// One block of MR rows × NR weight rows in the format's dot-product kernel (Pow2: fp8's pow2 path).
template <WeightFormat F, int MR, int NR, bool Pow2>
inline void dot_any_block(const uint16_t* const* a, int64_t i0, const ExpertWeight& w, int64_t n, const OutRows& out,
                          bool prefetch, uint32_t& bad) {
  static_assert(F == WeightFormat::Fp8 || !Pow2, "the pow2 path is fp8's");
  if constexpr (F == WeightFormat::Fp8) {
    dot_block_fp8<MR, NR, Pow2>(a, i0, w, n, out, prefetch);
  } else {
    dot_block<F, MR, NR>(a, i0, w, n, out, prefetch, bad);
  }
}

// Blocks of MR rows, then one block of the m % MR rows left. Every block asks for the lines of the weight rows
// WeightRows::next points at, not only the first (docs/backends/cpu.md has the times): a request for a line
// already on its way costs little, and a line whose first request the core dropped (a software prefetch is only a
// hint) is asked for again before those rows' first block needs it.
template <WeightFormat F, int NR, int MR, bool Pow2>
void dot_row_blocks(const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t n, const OutRows& out,
                    bool prefetch, uint32_t& bad) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) dot_any_block<F, MR, NR, Pow2>(a, i, w, n, out, prefetch, bad);
  with_rows<MR - 1>(static_cast<int>(m - i), [&](auto rows_c) {
    dot_any_block<F, decltype(rows_c)::value, NR, Pow2>(a, i, w, n, out, prefetch, bad);
  });
}

// fp4 weights, more rows than one block: dot_block would decode every unit of the NR weight rows once per block of
// MR rows (3 times at 16 rows, 11 at 64). Here each 512-k chunk of the NR rows is decoded once into a bf16 panel
// (NR × 512 bf16: 6 KiB at NR = 6, in L1) and every row block reads it from there; the blocks' accumulators wait
// in memory between chunks (fp32 stores and loads are exact). Every accumulator sees exactly dot_block's sequence of
// vdpbf16ps (units in increasing k, the same operands; slow chunks through the same slow_fp4_chunk), so the bits
// are dot_block's: which path a row takes depends on the row count, and the result must not (batch invariance).
// The panel (bf16, [unit][weight row][32]) serves fp8 weights the same way (dot_panel_fp8).
struct alignas(64) Acc {  // an accumulator parked in memory (a struct: std::vector keeps its alignment)
  __m512 v;
};

template <int NR>
struct WeightPanel {
  alignas(64) uint16_t w[kChunk / kUnit][NR][kUnit];
};

template <int MR, int NR>
inline void panel_rows(const uint16_t* const* ap, const WeightPanel<NR>& p, int64_t kc, int nu, Acc* accm) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = accm[i * NR + j].v;
  for (int u = 0; u < nu; ++u) {
    __m512i av[MR];
    load_units<MR>(ap, kc + u * kUnit, av);
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = (__m512bh)(_mm512_load_si512(p.w[u][j]));
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)av[i], wv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) accm[i * NR + j].v = acc[i][j];
}

// A chunk with a scale byte outside [2, 252] for one block of MR rows: dot_block's own slow path.
template <int MR, int NR>
inline void panel_rows_slow(const uint16_t* const* ap, const uint8_t* const* rq, const Fp4Chunk* ch, int64_t kc,
                            int64_t kend, Acc* accm) {
  Accumulators<MR, NR> t;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) t.v[i][j] = accm[i * NR + j].v;
  slow_fp4_chunk<MR, NR>(ap, rq, ch, kc, kend, t);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) accm[i * NR + j].v = t.v[i][j];
}

// One block of R rows (R = the runtime r, 1 <= r <= MR) of a chunk, fast or slow. Written out rather than through
// with_rows: GCC compiles the lambda form of this loop to slower code.
template <int NR, int MR>
inline void panel_block(int r, bool fast, const uint16_t* const* ap, const WeightPanel<NR>& p, const uint8_t* const* rq,
                        const Fp4Chunk* ch, int64_t kc, int64_t kend, Acc* accm) {
  if constexpr (MR > 0) {
    if (r != MR) return panel_block<NR, MR - 1>(r, fast, ap, p, rq, ch, kc, kend, accm);
    if (fast) {
      panel_rows<MR, NR>(ap, p, kc, static_cast<int>((kend - kc) / kUnit), accm);
    } else {
      panel_rows_slow<MR, NR>(ap, rq, ch, kc, kend, accm);
    }
  }
}

// A panel's prefetch of a later NR weight rows' chunk [kc, kend) (WeightRows::next): their scale lines when the
// chunk starts, then their weight lines spread over the chunk's row blocks (prefetch_next_rows: block b of nb asks
// for rows [b·NR/nb, (b+1)·NR/nb)), so that the chunk's requests do not all leave at once while its first block
// runs.
template <WeightFormat F, typename S, int NR>
inline void prefetch_next_scales(const ExpertWeight& w, const WeightRows<S, NR>& rows, int64_t kc) {
  constexpr int64_t block = F == WeightFormat::Fp4 ? kFp4WeightBlock : kFp8WeightBlock;  // k per scale
  for (int j = 0; j < NR; ++j) __builtin_prefetch(rows.next_s + j * w.scale_row_stride + kc / block, 0, 3);
}

template <WeightFormat F, typename S, int NR>
inline void prefetch_next_rows(const ExpertWeight& w, const WeightRows<S, NR>& rows, int64_t kc, int64_t kend,
                               int64_t b, int64_t nb) {
  constexpr int64_t KL = F == WeightFormat::Fp4 ? 128 : 64;  // k per 64-byte line of a weight row
  for (int64_t j = b * NR / nb; j < (b + 1) * NR / nb; ++j)
    for (int64_t kl = kc; kl < kend; kl += KL)
      __builtin_prefetch(rows.next + j * w.row_stride + kl * 64 / KL, 0, kStreamHint);
}

// The m × NR results of a panel's accumulators, parked in accm row by row.
template <int NR>
inline void emit_panel(const OutRows& out, int64_t m, int64_t n, const Acc* accm) {
  for (int64_t i = 0; i < m; ++i)
    for (int j = 0; j < NR; ++j) emit_output(out, i, n + j, _mm512_reduce_add_ps(accm[i * NR + j].v));
}

// All m rows × the NR weight rows from n. accm: room for m · NR accumulators.
template <int NR>
void dot_panel_fp4(const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t n, const OutRows& out,
                   bool prefetch, uint32_t& bad_out, Acc* accm) {
  const WeightRows<uint8_t, NR> rows(w, n);
  const auto& rq = rows.q;
  const auto& rs = rows.s;
  for (int64_t i = 0; i < m * NR; ++i) accm[i].v = _mm512_setzero_ps();
  Fp4Chunk ch[NR];
  WeightPanel<NR> panel;
  uint32_t bad = 0;
  const int64_t K = w.k;
  const int64_t nb = (m + kMRPanel - 1) / kMRPanel;  // row blocks: each asks for its share of the next rows' lines
  for (int64_t kc = 0; kc < K; kc += kChunk) {
    const int64_t kend = K - kc < kChunk ? K : kc + kChunk;
    const bool fast = fp4_chunks<NR>(rs, kc, kend, ch, bad);
    if (prefetch) prefetch_next_scales<WeightFormat::Fp4>(w, rows, kc);
    if (fast) {
      for (int64_t k0 = kc; k0 < kend; k0 += kUnit) {
        const int u = static_cast<int>((k0 - kc) / kUnit);
        for (int j = 0; j < NR; ++j) _mm512_store_si512(panel.w[u][j], fp4_panel_unit(rq[j], k0, fp4_table(rs[j], k0)));
      }
    }
    for (int64_t i = 0; i < m; i += kMRPanel) {
      if (prefetch) prefetch_next_rows<WeightFormat::Fp4>(w, rows, kc, kend, i / kMRPanel, nb);
      const int r = static_cast<int>(m - i < kMRPanel ? m - i : kMRPanel);
      panel_block<NR, kMRPanel>(r, fast, a + i, panel, rq, ch, kc, kend, accm + i * NR);
    }
  }
  bad_out |= bad;
  emit_panel<NR>(out, m, n, accm);
}

// fp8 weights, more rows than one block: as dot_panel_fp4, each 512-k chunk of the NR weight rows is decoded once
// into a bf16 panel that every block of MR rows reads; per 128-k block a row block sums into its block
// accumulators and folds them in with the block's scale, exactly dot_block_fp8's sequence (same bits).
template <int MR, int NR>
inline void panel_rows_fp8(const uint16_t* const* ap, const WeightPanel<NR>& p, const float* const* rs, int64_t kc,
                           int64_t kend, Acc* accm) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = accm[i * NR + j].v;
  for (int64_t kb = kc; kb < kend; kb += kFp8WeightBlock) {
    __m512 blk[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) blk[i][j] = _mm512_setzero_ps();
    for (int64_t k0 = kb; k0 < kb + kFp8WeightBlock; k0 += kUnit) {
      const int u = static_cast<int>((k0 - kc) / kUnit);
      __m512i av[MR];
      load_units<MR>(ap, k0, av);
      for (int j = 0; j < NR; ++j) {
        const __m512bh wv = (__m512bh)(_mm512_load_si512(p.w[u][j]));
        for (int i = 0; i < MR; ++i) blk[i][j] = _mm512_dpbf16_ps(blk[i][j], (__m512bh)av[i], wv);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 sv = _mm512_set1_ps(rs[j][kb / kFp8WeightBlock]);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(blk[i][j], sv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) accm[i * NR + j].v = acc[i][j];
}

// One block of R rows (R = the runtime r, 1 <= r <= MR) of a chunk: fold or pow2 path.
template <int NR, int MR, bool Pow2>
inline void panel_block_fp8(int r, const uint16_t* const* ap, const WeightPanel<NR>& p, const float* const* rs,
                            int64_t kc, int64_t kend, Acc* accm) {
  if constexpr (MR > 0) {
    if (r != MR) return panel_block_fp8<NR, MR - 1, Pow2>(r, ap, p, rs, kc, kend, accm);
    if constexpr (Pow2) {
      panel_rows<MR, NR>(ap, p, kc, static_cast<int>((kend - kc) / kUnit), accm);
    } else {
      panel_rows_fp8<MR, NR>(ap, p, rs, kc, kend, accm);
    }
  }
}

// All m rows × the NR weight rows from n, the fold path or (Pow2) the pow2 path: each 1×128 block decoded with its
// scale's tables, so that the panel holds scaled bf16 weights that the rows read as fp4's (panel_rows), with the
// same sequence as dot_block_fp8<MR, NR, true>. accm: room for m · NR accumulators.
template <int NR, bool Pow2>
void dot_panel_fp8(const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t n, const OutRows& out,
                   bool prefetch, Acc* accm) {
  static_assert(kChunk % kFp8WeightBlock == 0, "a chunk holds whole fp8 blocks");
  const Fp8Decoder plain;
  const WeightRows<float, NR> rows(w, n);
  const auto& rq = rows.q;
  const auto& rs = rows.s;
  for (int64_t i = 0; i < m * NR; ++i) accm[i].v = _mm512_setzero_ps();
  WeightPanel<NR> panel;
  const int64_t K = w.k;
  const int64_t nb = (m + kMRFp8 - 1) / kMRFp8;  // row blocks: each asks for its share of the next rows' lines
  for (int64_t kc = 0; kc < K; kc += kChunk) {
    const int64_t kend = K - kc < kChunk ? K : kc + kChunk;
    if (prefetch) prefetch_next_scales<WeightFormat::Fp8>(w, rows, kc);
    for (int64_t kb = kc; kb < kend; kb += kFp8WeightBlock) {
      for (int j = 0; j < NR; ++j) {
        const Fp8Decoder decode8 = Pow2 ? Fp8Decoder(fp8_scaled_bytes(rs[j], kb)) : plain;
        for (int64_t kl = kb; kl < kb + kFp8WeightBlock; kl += 2 * kUnit) {  // a line: two units
          const int u = static_cast<int>((kl - kc) / kUnit);
          __m512i w0, w1;
          decode8(rq[j] + kl, w0, w1);
          _mm512_store_si512(panel.w[u][j], w0);
          _mm512_store_si512(panel.w[u + 1][j], w1);
        }
      }
    }
    for (int64_t i = 0; i < m; i += kMRFp8) {
      if (prefetch) prefetch_next_rows<WeightFormat::Fp8>(w, rows, kc, kend, i / kMRFp8, nb);
      const int r = static_cast<int>(m - i < kMRFp8 ? m - i : kMRFp8);
      panel_block_fp8<NR, kMRFp8, Pow2>(r, a + i, panel, rs, kc, kend, accm + i * NR);
    }
  }
  emit_panel<NR>(out, m, n, accm);
}

// The NR weight rows from n for all m rows on path P: the one-row kernel, the decoded panel (accm: room for m · NR
// accumulators) or blocks of MR rows. All three give a row the same bits.
template <WeightFormat F, int NR, int MR, RowPath P, bool Pow2>
inline void dot_columns(const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t n, const OutRows& out,
                        bool prefetch, uint32_t& bad, Acc* accm) {
  if constexpr (P == RowPath::OneRow) {
    dot_any_block<F, 1, NR, Pow2>(a, 0, w, n, out, prefetch, bad);
  } else if constexpr (P == RowPath::Panel) {
    static_assert(F != WeightFormat::Bf16, "bf16 weights need no decode, so no panel");
    if constexpr (F == WeightFormat::Fp8) {
      dot_panel_fp8<NR, Pow2>(a, m, w, n, out, prefetch, accm);
    } else {
      dot_panel_fp4<NR>(a, m, w, n, out, prefetch, bad, accm);
    }
  } else {
    dot_row_blocks<F, NR, MR, Pow2>(a, m, w, n, out, prefetch, bad);
  }
}

// The NR fp8 weight rows from n. Each weight row's own scales choose its path, so that a row's bits never depend on
// how rows are blocked: all powers of two, the pow2 path for the NR rows; a panel's rows otherwise as two fold-sized
// halves, each by its own rows' kinds (the fold keeps two sums per accumulator, so its panel has half the rows);
// rows of both kinds (rare: a checkpoint's scales are all powers of two or mostly not) one by one, without a panel.
template <int NR, int MR, RowPath P>
void dot_fp8_rows(const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t n, const OutRows& out,
                  bool prefetch, uint32_t& bad, Acc* park) {
  constexpr auto F = WeightFormat::Fp8;
  constexpr RowPath one = P == RowPath::Panel ? RowPath::Blocks : P;  // the path of a single weight row
  const unsigned pow2 = fp8_pow2_rows<NR>(w, n);
  if (pow2 == (1u << NR) - 1) {
    dot_columns<F, NR, MR, P, true>(a, m, w, n, out, prefetch, bad, park);
  } else if constexpr (NR == kNRPanel) {
    static_assert(kNRPanel == 2 * kNRFp8, "a panel's weight rows are two fold panels'");
    dot_fp8_rows<kNRFp8, MR, P>(a, m, w, n, out, true, bad, park);
    dot_fp8_rows<kNRFp8, MR, P>(a, m, w, n + kNRFp8, out, prefetch, bad, park);
  } else if (pow2 == 0) {
    dot_columns<F, NR, MR, P, false>(a, m, w, n, out, prefetch, bad, park);
  } else {
    for (int j = 0; j < NR; ++j) {
      if (pow2 >> j & 1u) {
        dot_columns<F, 1, MR, one, true>(a, m, w, n + j, out, false, bad, nullptr);
      } else {
        dot_columns<F, 1, MR, one, false>(a, m, w, n + j, out, false, bad, nullptr);
      }
    }
  }
}

// Groups of NR weight rows from n while whole groups fit below n1 (n ends after the last), on path P with blocks
// of MR rows.
template <WeightFormat F, int NR, int MR, RowPath P>
void dot_column_blocks(const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t& n, int64_t n1,
                       const OutRows& out, uint32_t& bad) {
  std::vector<Acc> accm(P == RowPath::Panel && n + NR <= n1 ? m * NR : 0);
  Acc* const park = accm.empty() ? nullptr : accm.data();
  const int64_t ahead = prefetch_ahead_rows<NR>(w);
  for (; n + NR <= n1; n += NR) {
    const bool prefetch = n + ahead + NR <= n1;  // the rows it would ask for are in this range
    if constexpr (F == WeightFormat::Fp8) {
      dot_fp8_rows<NR, MR, P>(a, m, w, n, out, prefetch, bad, park);
    } else {
      dot_columns<F, NR, MR, P, false>(a, m, w, n, out, prefetch, bad, park);
    }
  }
}

// Weight rows [n0, n1) for the m rows on path P: the widest blocks first (OneRow: kNR1 weight rows; Panel: the
// panels, kNRPanel weight rows, and for fp8 the fold path's kNRFp8), then narrower blocks for the tail (blocks of 4
// rows), so that few weight rows never run as a single latency-bound chain.
template <WeightFormat F, RowPath P>
bool dot_path(const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1, const OutRows& out) {
  static_assert(kChunk % 128 == 0, "a chunk holds whole cache lines of fp4 rows");
  constexpr RowPath tail = P == RowPath::OneRow ? RowPath::OneRow : RowPath::Blocks;
  uint32_t bad = 0;
  int64_t n = n0;
  if constexpr (P == RowPath::OneRow) dot_column_blocks<F, kNR1, 4, P>(a, m, w, n, n1, out, bad);
  if constexpr (F == WeightFormat::Fp8) {
    if constexpr (P == RowPath::Panel) dot_column_blocks<F, kNRPanel, kMRFp8, P>(a, m, w, n, n1, out, bad);
    dot_column_blocks<F, P == RowPath::Blocks ? kNRFp8Direct : kNRFp8, kMRFp8, P>(a, m, w, n, n1, out, bad);
  } else {
    if constexpr (P == RowPath::Panel) dot_column_blocks<F, kNRPanel, kMR, P>(a, m, w, n, n1, out, bad);
    dot_column_blocks<F, kNR, kMR, tail>(a, m, w, n, n1, out, bad);
  }
  dot_column_blocks<F, 2, 4, tail>(a, m, w, n, n1, out, bad);
  dot_column_blocks<F, 1, 4, tail>(a, m, w, n, n1, out, bad);
  return bad == 0;
}

template <WeightFormat F>
bool dot_format(RowPath path, const uint16_t* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
                const OutRows& out) {
  if (path == RowPath::OneRow) return dot_path<F, RowPath::OneRow>(a, m, w, n0, n1, out);
  if constexpr (F != WeightFormat::Bf16) {
    if (path == RowPath::Panel) return dot_path<F, RowPath::Panel>(a, m, w, n0, n1, out);
  }
  return dot_path<F, RowPath::Blocks>(a, m, w, n0, n1, out);
}

// 16 e4m3fn codes -> their float32 values, exactly as e4m3fn_to_float (NaN codes 0x7F / 0xFF -> a NaN with the
// code's sign): normal codes by moving the exponent and mantissa bits into place and rebiasing (7 -> 127),
// subnormal ones (exponent field 0) as m · 2^-9, an exact product.
inline __m512 e4m3fn_to_ps(__m128i codes) {
  const __m512i c = _mm512_cvtepu8_epi32(codes);
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f));
  __m512i v =
      _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, _mm512_castps_si512(sub));
  v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(_mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24)));
}

// The 32 fp8 activations at x (scale s, an exact_bf16_scale) as bf16 words in column order: the top 16 bits of
// e4m3fn_to_float(x[c]) · s, exactly the scalar value() of prepare_activation (the product is a bf16 number).
inline __m512i fp8_acts_bf16(const uint8_t* x, float s) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m512 sv = _mm512_set1_ps(s);
  auto half = [&](__m128i c) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(e4m3fn_to_ps(c), sv)), 16));
  };
  return _mm512_inserti64x4(_mm512_castsi256_si512(half(_mm256_castsi256_si128(codes))),
                            half(_mm256_extracti128_si256(codes, 1)), 1);
}

// vpermw / vpermt2w indices that put a unit's (fp4) or a line's (fp8) columns in the lane order of its decode.
struct ActPermutes {
  alignas(64) uint16_t fp4[32];
  alignas(64) uint16_t fp8[2][32];
  constexpr ActPermutes() : fp4(), fp8() {
    for (int w = 0; w < kUnit; ++w) {
      fp4[w] = static_cast<uint16_t>(fp4_column(w));
      for (int v = 0; v < 2; ++v) fp8[v][w] = static_cast<uint16_t>(fp8_column(v, w));
    }
  }
};
constexpr ActPermutes kActPermutes;

// One activation row as bf16 words in the lane order of weight format wf: the scalar loop of prepare_activation, 32
// columns at a time. unit(c): the 32 words of columns c .. c + 31 in column order; value(c): one column's word.
// k: a multiple of 32 (fp4), 64 (fp8); any for bf16 weights (a scalar tail). Intel SDM (AVX512BW): word i of
// VPERMW's result is the table's word at index word i (low 5 bits), VPERMT2W's the same over two tables (bit 5
// picks the second); fp8_acts_bf16's VPMOVDW (_mm512_cvtepi32_epi16) keeps the low word of each dword, unsaturated.
template <typename Unit, typename Value>
void row_bf16(WeightFormat wf, int64_t k, uint16_t* o, Unit unit, Value value) {
  int64_t c = 0;
  if (wf == WeightFormat::Fp8) {
    const __m512i i0 = _mm512_load_si512(kActPermutes.fp8[0]), i1 = _mm512_load_si512(kActPermutes.fp8[1]);
    for (; c + 2 * kUnit <= k; c += 2 * kUnit) {
      const __m512i a = unit(c), b = unit(c + kUnit);
      _mm512_storeu_si512(o + c, _mm512_permutex2var_epi16(a, i0, b));
      _mm512_storeu_si512(o + c + kUnit, _mm512_permutex2var_epi16(a, i1, b));
    }
  } else {
    const __m512i idx = _mm512_load_si512(kActPermutes.fp4);
    for (; c + kUnit <= k; c += kUnit) {
      const __m512i a = unit(c);
      _mm512_storeu_si512(o + c, wf == WeightFormat::Fp4 ? _mm512_permutexvar_epi16(idx, a) : a);
    }
  }
  for (; c < k; ++c) o[c] = value(c);
}

}  // namespace

namespace avx512bf16 {

bool prepare_activation(WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group, int64_t c0,
                        int64_t k, float* row) {
  bool exact = true;
  if (af == ActFormat::Fp8) {
    for (int64_t g = 0; g < (k + group - 1) / group; ++g) exact = exact && exact_bf16_scale(x_scale[g]);
  }
  if (!exact) {
    avx512::prepare_activation(wf, af, x, x_scale, group, k, row + c0);
    return false;
  }
  uint16_t* o = reinterpret_cast<uint16_t*>(row) + c0;
  if (af == ActFormat::Bf16) {
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    row_bf16(wf, k, o, [&](int64_t c) { return _mm512_loadu_si512(xb + c); }, [&](int64_t c) { return xb[c]; });
  } else {  // fp8: each 32 columns in one scale group (groups of 32 or 128, csrc/checks/common.h)
    const uint8_t* xq = static_cast<const uint8_t*>(x);
    auto value = [&](int64_t c) {  // an exact bf16 number: its top 16 bits
      return static_cast<uint16_t>(float_bits(e4m3fn_to_float(xq[c]) * x_scale[c / group]) >> 16);
    };
    row_bf16(wf, k, o, [&](int64_t c) { return fp8_acts_bf16(xq + c, x_scale[c / group]); }, value);
  }
  return true;
}

bool run(RowPath path, const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
         const OutRows& out) {
  const uint16_t* const* ab = reinterpret_cast<const uint16_t* const*>(a);  // rows hold bf16 (see prepare)
  switch (w.format) {
    case WeightFormat::Fp4:
      return dot_format<WeightFormat::Fp4>(path, ab, m, w, n0, n1, out);
    case WeightFormat::Fp8:
      return dot_format<WeightFormat::Fp8>(path, ab, m, w, n0, n1, out);
    case WeightFormat::Bf16:
      break;
  }
  return dot_format<WeightFormat::Bf16>(path, ab, m, w, n0, n1, out);
}

}  // namespace avx512bf16
}  // namespace cpu
}  // namespace static_moe

#pragma GCC pop_options
