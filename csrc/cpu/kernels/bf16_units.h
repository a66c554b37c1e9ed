// The exact bf16 decodes of weight units shared by the dot-product GEMMs of expert_gemm_avx512bf16.cpp (vdpbf16ps)
// and expert_gemm_amx.cpp (AMX tiles): fp4 e2m1 units through 32-entry bf16 tables with the block's UE8M0 scale in
// the exponent field, fp8 e4m3fn lines through byte tables (plain, or with a power-of-two block scale added), and
// the lane order each decode produces, which prepare_activation gives the activations too. Both files include
// this header AFTER their `#pragma GCC target` (it needs AVX-512 BW / VBMI); everything here has internal linkage
// (anonymous namespace), so one translation unit's copy is never called from the other.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels/cast.h"
#include "cpu/kernels/expert_gemm.h"

namespace static_moe {
namespace cpu {
namespace {

constexpr int64_t kUnit = 32;  // k per unit: one zmm of 32 bf16

// Power-of-two scale whose products with any e4m3fn value are normal bf16 numbers (or inf, as in fp32).
inline bool exact_bf16_scale(float s) {
  const uint32_t u = float_bits(s);
  return (u & 0x007FFFFFu) == 0 && ((u >> 23) & 0xFFu) >= 10u;  // 2^-117 · 2^-9 = 2^-126
}

// Whether every scale byte of NR weight rows (nb bytes each) is in [2, 252], the fast path's range (byte 255, the
// NaN byte, is not: its chunk takes the per-chunk path, which reports it).
template <int NR>
inline bool rows_fast(const uint8_t* const* s, int64_t nb) {
  __mmask64 off = 0;
  for (int j = 0; j < NR; ++j) {
    for (int64_t b = 0; b < nb; b += 64) {
      const __mmask64 live = nb - b >= 64 ? ~0ull : (1ull << (nb - b)) - 1;
      const __m512i v = _mm512_maskz_loadu_epi8(live, s[j] + b);
      off |= _mm512_mask_cmplt_epu8_mask(live, v, _mm512_set1_epi8(2)) |
             _mm512_mask_cmpgt_epu8_mask(live, v, _mm512_set1_epi8(static_cast<char>(252)));
    }
  }
  return off == 0;
}

alignas(64) constexpr uint16_t kE2m1Bf16[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
                                                0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// Column (within its 32-k unit) that position w of a decoded fp4 unit holds. The 16 packed bytes are broadcast to
// the four 128-bit lanes; word v of a lane holds packed bytes 2v and 2v + 1, the nibbles of columns 4v … 4v + 3,
// and lane L = w / 8 shifts its words right by 4L, so that position w = 8L + v keeps column 4v + L in its low bits.
constexpr int fp4_column(int w) { return 4 * (w % 8) + w / 8; }

// Two ways to the same 32 vpermw indices from the broadcast bytes (the low 5 bits of each word: the column's nibble
// and, as bit 4, the next nibble's low bit, which the doubled table ignores), so both decodes give the same words:
//   vpsrlvw by 4L for the words of lane L, where the weights go straight into vdpbf16ps: vpmultishiftqb does not
//     issue alongside vdpbf16ps, vpsrlvw does (bench/micro/issue_rates.cpp measures both).
//   vpmultishiftqb (AVX512_VBMI: each index byte takes the 8 bits at its own offset within its qword), where a
//     chunk is decoded into the panel, apart from the products.
// Intel SDM, VPSRLVW (AVX512BW): each word of the first source shifted right, zeros in, by the count in the same
// word of the second; VPMULTISHIFTQB: control byte j of a qword selects the 8 bits from bit offset (ctrl & 63) of
// the same qword. The blocking tests (tests/ops/test_expert_gemm_blocking.py) hold the two decodes to the same bits.
struct Fp4Shifts {
  alignas(64) uint16_t c[32];
  constexpr Fp4Shifts() : c() {
    for (int w = 0; w < 32; ++w) c[w] = static_cast<uint16_t>(4 * (w / 8));
  }
};
constexpr Fp4Shifts kFp4Shifts;

struct Fp4Control {  // vpmultishiftqb control: both bytes of word w start at its column's nibble within the qword
  alignas(64) uint8_t b[64];
  constexpr Fp4Control() : b() {
    for (int w = 0; w < 32; ++w) b[2 * w] = b[2 * w + 1] = static_cast<uint8_t>(4 * (fp4_column(w) % 16));
  }
};
constexpr Fp4Control kFp4Control;

inline __m512i fp4_packed(const uint8_t* row, int64_t k0) {  // the unit's 16 bytes, in every 128-bit lane
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (k0 >> 1))));
}

// The 32 weights of the fp4 unit at k0 of a row (fp4_column order) from a 32-entry bf16 table, for vdpbf16ps.
inline __m512i fp4_unit(const uint8_t* row, int64_t k0, __m512i lut) {
  return _mm512_permutexvar_epi16(_mm512_srlv_epi16(fp4_packed(row, k0), _mm512_load_si512(kFp4Shifts.c)), lut);
}

// The same words, for the panel.
inline __m512i fp4_panel_unit(const uint8_t* row, int64_t k0, __m512i lut) {
  return _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(_mm512_load_si512(kFp4Control.b), fp4_packed(row, k0)),
                                  lut);
}

// The fast path's 32-entry tables for every scale byte b in [2, 252]: kE2m1Bf16 with (b - 127) << 7 added to the
// exponent field of its non-zero entries (16 KiB; the few bytes a checkpoint uses stay in L1). vpermw reads the
// block's table straight from memory, so a unit's decode is one load, one index instruction and one vpermw, with no
// per-unit scale broadcast and add.
struct Fp4Tables {
  alignas(64) uint16_t v[256][32];
  constexpr Fp4Tables() : v() {
    for (int b = 2; b <= 252; ++b)
      for (int w = 0; w < 32; ++w)
        v[b][w] = (w % 8 == 0) ? kE2m1Bf16[w] : static_cast<uint16_t>(kE2m1Bf16[w] + (b - 127) * 128);
  }
};
constexpr Fp4Tables kFp4Tables;

// The fast-path table of the block holding column k0 of a weight row (scale_row: the row's UE8M0 bytes).
inline __m512i fp4_table(const uint8_t* scale_row, int64_t k0) {
  return _mm512_load_si512(kFp4Tables.v[scale_row[k0 / kFp4WeightBlock]]);
}

// bf16 bits of the e4m3fn magnitude c (7 bits: eeeemmm, bias 7), exactly; 0x7F (NaN) -> a bf16 NaN.
constexpr uint16_t e4m3fn_magnitude_bf16(int c) {
  const int e = c >> 3, m = c & 7;
  if (e == 15 && m == 7) return 0x7FC0;
  if (e != 0) return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));
  if (m == 0) return 0;
  const int p = m >= 4 ? 2 : (m >= 2 ? 1 : 0);  // m·2^-9 = 2^(p-9) · (m / 2^p), 1 <= m / 2^p < 2
  return static_cast<uint16_t>(((118 + p) << 7) | ((m - (1 << p)) << (7 - p)));
}

// The low and the high bytes of the bf16 bits of the 128 magnitudes times one power of two: two 128-entry byte
// tables for vpermi2b, 256 bytes (four zmm).
struct Fp8Bytes {
  alignas(64) uint8_t lo[128] = {};
  alignas(64) uint8_t hi[128] = {};
};

// Power-of-two fp8 weight scales 2^(E-127) whose products with every e4m3fn value are normal, finite bf16 numbers:
// exponent fields E in [10, 246] (2^-9 · 2^-117 = 2^-126, the bf16 normal floor; 448 · 2^119 < the bf16 maximum).
constexpr uint32_t kFp8Pow2Low = 10;
constexpr uint32_t kFp8Pow2High = 246;

// Fp8Bytes for every exponent field E of a scale 2^(E-127) in [kFp8Pow2Low, kFp8Pow2High]: the bf16 bits of each
// non-zero, non-NaN magnitude with E - 127 added to the exponent field (exact: the result is normal), ±0 and NaN
// as they are. t[127] (scale 1) is the plain decode. 64 KiB; the few scales a checkpoint uses stay in L1.
struct Fp8ScaledBytes {
  Fp8Bytes t[256];
  constexpr Fp8ScaledBytes() : t() {
    for (uint32_t e = kFp8Pow2Low; e <= kFp8Pow2High; ++e) {
      for (int c = 0; c < 128; ++c) {
        const uint16_t v = e4m3fn_magnitude_bf16(c);
        const bool keep = v == 0 || c == 0x7F;
        const uint16_t b = keep ? v : static_cast<uint16_t>(v + (static_cast<int>(e) - 127) * 128);
        t[e].lo[c] = static_cast<uint8_t>(b & 0xFF);
        t[e].hi[c] = static_cast<uint8_t>(b >> 8);
      }
    }
  }
};
constexpr Fp8ScaledBytes kFp8Scaled;
constexpr const Fp8Bytes& kFp8Bytes = kFp8Scaled.t[127];

// Whether every 1×128 scale of an fp8 weight row (nb float32) is such a power of two (positive, mantissa 0,
// exponent field in range). Such a row takes the pow2 path: its scales go into the decoded weights' exponents and
// all of K sums into one accumulator, as fp4 does. Any other row takes the fold path.
inline bool fp8_row_pow2(const float* s, int64_t nb) {
  __mmask16 off = 0;
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 live = static_cast<__mmask16>(nb - b >= 16 ? 0xFFFFu : (1u << (nb - b)) - 1u);
    const __m512i u = _mm512_maskz_loadu_epi32(live, s + b);
    const __m512i e = _mm512_srli_epi32(u, 23);  // the sign bit lands above the exponent field: out of range
    off |= _mm512_mask_test_epi32_mask(live, u, _mm512_set1_epi32(0x007FFFFF)) |
           _mm512_mask_cmplt_epu32_mask(live, e, _mm512_set1_epi32(kFp8Pow2Low)) |
           _mm512_mask_cmpgt_epu32_mask(live, e, _mm512_set1_epi32(kFp8Pow2High));
  }
  return off == 0;
}

// The set of the NR weight rows from n (bit j: row n + j) that take the pow2 path.
template <int NR>
inline unsigned fp8_pow2_rows(const ExpertWeight& w, int64_t n) {
  const float* s = static_cast<const float*>(w.scale);
  unsigned p = 0;
  for (int j = 0; j < NR; ++j)
    p |= static_cast<unsigned>(fp8_row_pow2(s + (n + j) * w.scale_row_stride, w.k / kFp8WeightBlock)) << j;
  return p;
}

// The byte tables of the 1×128 block holding column k0 of a pow2 weight row (scale_row: its float32 scales).
inline const Fp8Bytes& fp8_scaled_bytes(const float* scale_row, int64_t k0) {
  return kFp8Scaled.t[float_bits(scale_row[k0 / kFp8WeightBlock]) >> 23];
}

// Column (within its 64-k line) that position w of unit v (0: the line's first, 1: its second) of a decoded fp8
// line holds. vpunpcklbw / vpunpckhbw interleave within each 128-bit lane L = w / 8: the first unit takes bytes
// 0-7 of every lane of 16 codes, the second bytes 8-15.
constexpr int fp8_column(int v, int w) { return 16 * (w / 8) + 8 * v + w % 8; }

// The four halves of one Fp8Bytes, in registers: on the fold path loaded once per block of weight rows, on the
// pow2 path once per 1×128 block of a row.
struct Fp8Decoder {
  __m512i lo0, lo1, hi0, hi1;
  explicit Fp8Decoder(const Fp8Bytes& t = kFp8Bytes)
      : lo0(_mm512_load_si512(t.lo)),
        lo1(_mm512_load_si512(t.lo + 64)),
        hi0(_mm512_load_si512(t.hi)),
        hi1(_mm512_load_si512(t.hi + 64)) {}

  // The 64 e4m3fn codes of the line at p -> its two units of 32 bf16 numbers of the same values (fp8_column order).
  inline void operator()(const uint8_t* p, __m512i& u0, __m512i& u1) const {
    const __m512i c = _mm512_loadu_si512(p);
    // Intel SDM, VPERMI2B (zmm): in each index byte bit 6 picks the table and bits 5:0 the byte; bit 7, the sign,
    // is ignored. The lane order (fp8_column) and every code's value are checked against torch's float8_e4m3fn
    // cast by tests/ops/test_expert_gemm_codes.py.
    const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
    // | c & 0x80: the sign bit (e4m3fn and bf16 are both sign-magnitude)
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
    u0 = _mm512_unpacklo_epi8(lo, hi);
    u1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

}  // namespace
}  // namespace cpu
}  // namespace static_moe
