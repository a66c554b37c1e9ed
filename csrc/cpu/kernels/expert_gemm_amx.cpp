// AMX instance of the expert GEMM (Isa::Amx, GemmKernel::Tiles): the bf16 products of the avx512bf16 path (the same
// exact decodes, bf16_units.h, and the same prepared activation rows), multiplied by the tile unit instead of
// vdpbf16ps.
//
//   tiles   A: 16 weight rows × one 32-k unit, decoded to bf16 into a 1 KiB buffer (bf16 weights: loaded straight
//           from the weight rows, stride = row stride); B: the unit's 16 k pairs × up to 16 activation rows of one
//           group, from TileRows (packed once per operand); C: 16 weight rows × one group's rows in fp32. A pass
//           over K holds one weight block and up to 80 rows (five C tiles; tile_config has the layout).
//           TDPBF16PS C += A · B: "for each possible combination of (row of tmm2, column of tmm3)" the unit's 16
//           pairs are multiplied and accumulated into that row and column of C (Intel SDM; the Intrinsics Guide's
//           operation of _tile_dpbf16ps: FOR m … FOR k … tmp.fp32[n] += a·b, one product at a time; the two
//           write the pairing within a unit differently). Either way each output is one fp32 sum walked through K
//           unit by unit that depends on its own weight row and activation row only. Which rows share a tile,
//           how many groups a pass holds, where a column chunk starts: none of it changes a row's bits (batch
//           invariance). The bits differ from avx512bf16's (16 lane sums, then a horizontal sum), within the same
//           reference tolerance: every product is exact in fp32 on both.
//   weight  rows decoded by bf16_units.h, 128 k (4 units: an fp4 line, an fp8 block) per step into one of two A
//           buffers, a step ahead of the tile loads that read them. fp4: e2m1 times the block's scale, as on
//           avx512bf16; an fp4 row with a scale byte outside [2, 252] anywhere (bf16 subnormals, which TDPBF16PS
//           reads as zero like vdpbf16ps, or 255, NaN) is zero in the A tile and computed on its own by the
//           avx512bf16 kernel, which handles those bytes; the choice is the row's own. fp8: every row unscaled,
//           each 128-k block summed apart and folded in with its float32 scale (fold_block).
//   DAZ / FTZ, RNE: as vdpbf16ps (SDM: round to nearest even "when doing each accumulation of the FMA", output
//   denormals flushed to zero, input denormals treated as zero, MXCSR not consulted).
// Tile state: configured (LDTILECFG) per call and released (TILERELEASE) before returning, so a thread holds no
// tile data between calls. The OS grants the process the tile state first (simd.h, amx_permitted).
// GCC 12 flags the intrinsics headers' own `__m512i __Y = __Y;` placeholders wherever they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/kernels/cast.h"
#include "cpu/kernels/expert_gemm.h"
#include "cpu/kernels/expert_gemm_plan.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,avx2,fma,f16c,bmi,bmi2,amx-tile,amx-bf16")

#include "cpu/kernels/bf16_units.h"
#include "cpu/kernels/expert_gemm_impl.h"

namespace static_moe {
namespace cpu {
namespace {

constexpr int kTile = 16;       // weight rows per A tile; activation rows per group (B, C)
constexpr int kMaxGroups = 5;   // C tiles of a pass with one weight block: tmm3 … tmm7
constexpr int64_t kStep = 128;  // k decoded per step: 4 units
constexpr int kStepUnits = static_cast<int>(kStep / kUnit);
constexpr int kStreamHint = 2;  // prefetcht1, as the avx512bf16 kernels

// LDTILECFG's 64-byte operand (Intel SDM, "Tile configuration"): palette 1, then bytes per row and rows per tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// The tile layout of a pass: one weight block × NG (1 … 5) groups of activation rows. tmm0 A (nr weight rows);
// tmm1 / tmm2 B of a full group / of the last; tmm3 + g C(g). last: the last group's rows (its B and C tiles are
// 4·last bytes wide). One weight block at a time: TDPBF16PS into the C tile the previous one wrote issues as fast
// as into another (bench/micro/amx_tiles.cpp), so a second block in flight would only add weight streams and
// A buffers.
inline TileConfig tile_config(int ng, int nr, int last) {
  TileConfig c;
  auto set = [&](int t, int rows, int colsb) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = static_cast<uint16_t>(colsb);
  };
  set(0, nr, 64);
  set(1, kTile, 4 * kTile);
  set(2, kTile, 4 * last);
  for (int g = 0; g < ng; ++g) set(3 + g, nr, 4 * (g == ng - 1 ? last : kTile));
  return c;
}

// One unit's products of a pass: A from a (stride sa), B(g) from bg[g]. GCC's tile intrinsics paste the tile
// number into the instruction's text, so each group's tiles are written out.
#define SM_GROUP_PRODUCT(G, C)        \
  if constexpr (NG == G + 1) {        \
    _tile_loadd(2, bg[G], 4 * kTile); \
    _tile_dpbf16ps(C, 0, 2);          \
  } else if constexpr (NG > G + 1) {  \
    _tile_loadd(1, bg[G], 4 * kTile); \
    _tile_dpbf16ps(C, 0, 1);          \
  }
template <int NG>
__attribute__((always_inline)) inline void unit_products(const void* a, int64_t sa, const uint32_t* const* bg) {
  _tile_loadd(0, a, sa);
  SM_GROUP_PRODUCT(0, 3)
  SM_GROUP_PRODUCT(1, 4)
  SM_GROUP_PRODUCT(2, 5)
  SM_GROUP_PRODUCT(3, 6)
  SM_GROUP_PRODUCT(4, 7)
}
#undef SM_GROUP_PRODUCT

// Zero / store the pass's C tiles; c[g] receives C(g) (weight rows × the group's rows, fp32).
template <int NG>
__attribute__((always_inline)) inline void zero_c() {
  _tile_zero(3);
  if constexpr (NG > 1) _tile_zero(4);
  if constexpr (NG > 2) _tile_zero(5);
  if constexpr (NG > 3) _tile_zero(6);
  if constexpr (NG > 4) _tile_zero(7);
}

template <int NG>
__attribute__((always_inline)) inline void store_c(float (*c)[kTile][kTile]) {
  _tile_stored(3, c[0], 4 * kTile);
  if constexpr (NG > 1) _tile_stored(4, c[1], 4 * kTile);
  if constexpr (NG > 2) _tile_stored(5, c[2], 4 * kTile);
  if constexpr (NG > 3) _tile_stored(6, c[3], 4 * kTile);
  if constexpr (NG > 4) _tile_stored(7, c[4], 4 * kTile);
}

// Which of the nr weight rows from n the tiles take (bit j: row n + j): all but fp4 rows with a scale byte outside
// [2, 252], which go to the avx512bf16 kernel.
inline unsigned tile_rows(const ExpertWeight& w, int64_t n, int nr) {
  if (w.format != WeightFormat::Fp4) return (1u << nr) - 1u;
  unsigned take = 0;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* s = static_cast<const uint8_t*>(w.scale) + (n + j) * w.scale_row_stride;
    take |= static_cast<unsigned>(rows_fast<1>(&s, w.k / kFp4WeightBlock)) << j;
  }
  return take;
}

// The units of step [kc, kc + nu·32) of the nr weight rows from n into a (a[u][j]: unit u of row j, bf16,
// zero for rows not in `take`).
template <WeightFormat F>
inline void decode_step(const ExpertWeight& w, int64_t n, int nr, unsigned take, int64_t kc, int nu,
                        uint16_t (*a)[kTile][kUnit]) {
  for (int j = 0; j < nr; ++j) {
    const uint8_t* q = w.data + (n + j) * w.row_stride;
    if (!(take >> j & 1u)) {
      for (int u = 0; u < nu; ++u) _mm512_store_si512(a[u][j], _mm512_setzero_si512());
      continue;
    }
    if constexpr (F == WeightFormat::Fp4) {
      const uint8_t* s = static_cast<const uint8_t*>(w.scale) + (n + j) * w.scale_row_stride;
      for (int u = 0; u < nu; ++u) {
        const int64_t k0 = kc + u * kUnit;
        _mm512_store_si512(a[u][j], fp4_panel_unit(q, k0, fp4_table(s, k0)));
      }
    } else {  // fp8: one 128-k block, two 64-k lines of two units each, unscaled (the scale comes in the fold)
      const Fp8Decoder decode8(kFp8Bytes);
      for (int u = 0; u < nu; u += 2) {
        __m512i w0, w1;
        decode8(q + kc + u * kUnit, w0, w1);
        _mm512_store_si512(a[u][j], w0);
        _mm512_store_si512(a[u + 1][j], w1);
      }
    }
  }
}

// The bytes of step kc of the nr weight rows from n (and, at kc = 0, their scales): prefetch hints only.
template <WeightFormat F>
inline void prefetch_step(const ExpertWeight& w, int64_t n, int nr, int64_t kc) {
  constexpr int64_t bytes_per_2k = F == WeightFormat::Fp4 ? 1 : (F == WeightFormat::Fp8 ? 2 : 4);
  const int64_t b0 = kc * bytes_per_2k / 2, b1 = std::min(w.k, kc + kStep) * bytes_per_2k / 2;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* q = w.data + (n + j) * w.row_stride;
    for (int64_t b = b0; b < b1; b += 64) __builtin_prefetch(q + b, 0, kStreamHint);
    if (F != WeightFormat::Bf16 && kc == 0) {
      const int64_t es = F == WeightFormat::Fp4 ? 1 : 4;
      __builtin_prefetch(static_cast<const uint8_t*>(w.scale) + (n + j) * w.scale_row_stride * es, 0, 3);
    }
  }
}

// A weight block of the tiles: nr (<= 16) rows from n, `take` the rows they compute.
struct Block {
  int64_t n;
  int nr;
  unsigned take;
};

// fp8 weights (Fold): per 128-k block the C tiles sum the block alone, and each (weight row, row) folds it in with
// the row's scale, acc = fma(block, s, acc), as the avx512bf16 fold path and the reference's per-block sum do: the
// scale is applied once per block, not per weight. Every fp8 row, power-of-two scales too: one path for all rows
// (no block split by kind of scales); decoding with the scale's own byte tables (avx512bf16's pow2 path) gains
// nothing measurable on the tiles.
template <int NG>
inline void fold_block(const ExpertWeight& w, const Block& blk, int64_t kb, const float (*c)[kTile][kTile],
                       float (*acc)[kTile][kTile]) {
  const float* s = static_cast<const float*>(w.scale) + blk.n * w.scale_row_stride + kb / kFp8WeightBlock;
  for (int j = 0; j < blk.nr; ++j) {
    const __m512 sv = _mm512_set1_ps(s[j * w.scale_row_stride]);
    for (int g = 0; g < NG; ++g)
      _mm512_store_ps(acc[g][j], _mm512_fmadd_ps(_mm512_load_ps(c[g][j]), sv, _mm512_load_ps(acc[g][j])));
  }
}

// The weight block blk × the groups [g0, g0 + NG) of t, all of K, through the tiles configured for NG groups;
// nxt: the block after it (prefetched as this one is decoded), or null. c[g] gets C(g).
template <WeightFormat F, bool Fold, int NG>
void tile_pass(const TileRows& t, int64_t g0, const ExpertWeight& w, const Block& blk, const Block* nxt,
               float (*c)[kTile][kTile]) {
  alignas(64) uint16_t a[2][kStepUnits][kTile][kUnit];
  alignas(64) float acc[Fold ? NG : 1][kTile][kTile];
  if constexpr (Fold) {  // C tiles store only their configured rows and bytes: start every lane at zero
    std::memset(acc, 0, sizeof(acc));
    std::memset(c, 0, sizeof(float) * NG * kTile * kTile);
  }
  zero_c<NG>();
  const int64_t K = w.k;
  auto units_at = [&](int64_t kc) { return static_cast<int>(std::min<int64_t>(kStep, K - kc) / kUnit); };
  auto decode = [&](int64_t kc, int64_t step) {
    if (nxt != nullptr) prefetch_step<F>(w, nxt->n, nxt->nr, kc);
    if constexpr (F != WeightFormat::Bf16) decode_step<F>(w, blk.n, blk.nr, blk.take, kc, units_at(kc), a[step & 1]);
  };
  // Software-pipelined: step s + 1 is decoded before step s's tile loads are issued. A tile load does not take
  // data from the store buffer, so a buffer must be written well before it is loaded.
  decode(0, 0);
  for (int64_t kc = 0, step = 0; kc < K; kc += kStep, ++step) {
    if (kc + kStep < K) decode(kc + kStep, step + 1);
    const int nu = units_at(kc);
    for (int u = 0; u < nu; ++u) {
      const int64_t unit = kc / kUnit + u;
      const void* ap = a[step & 1][u];
      int64_t sa = 2 * kUnit;
      if constexpr (F == WeightFormat::Bf16) {
        ap = w.data + blk.n * w.row_stride + 2 * (kc + u * kUnit);
        sa = w.row_stride;
      }
      const uint32_t* bg[kMaxGroups];
      for (int g = 0; g < NG; ++g) bg[g] = t.unit(g0 + g, unit);
      unit_products<NG>(ap, sa, bg);
    }
    if constexpr (Fold) {  // a step is one fp8 block (kStep = 128)
      store_c<NG>(c);
      zero_c<NG>();
      fold_block<NG>(w, blk, kc, c, acc);
    }
  }
  if constexpr (Fold) {
    std::memcpy(c, acc, sizeof(acc));
  } else {
    store_c<NG>(c);
  }
}

template <WeightFormat F, bool Fold>
void tile_pass_groups(int ng, const TileRows& t, int64_t g0, const ExpertWeight& w, const Block& blk, const Block* nxt,
                      float (*c)[kTile][kTile]) {
  switch (ng) {
    case 1:
      return tile_pass<F, Fold, 1>(t, g0, w, blk, nxt, c);
    case 2:
      return tile_pass<F, Fold, 2>(t, g0, w, blk, nxt, c);
    case 3:
      return tile_pass<F, Fold, 3>(t, g0, w, blk, nxt, c);
    case 4:
      return tile_pass<F, Fold, 4>(t, g0, w, blk, nxt, c);
    default:
      return tile_pass<F, Fold, 5>(t, g0, w, blk, nxt, c);
  }
}

// The blocks `blocks` × the t.rows() bf16 rows, outputs through out (Fold: fp8 weights).
template <WeightFormat F, bool Fold>
void tile_blocks(const TileRows& t, const ExpertWeight& w, const std::vector<Block>& blocks, const OutRows& out) {
  const int64_t m = t.rows();
  const int64_t groups = (m + kTile - 1) / kTile;
  alignas(64) float c[kMaxGroups][kTile][kTile];
  const size_t nblk = blocks.size();
  for (int64_t g0 = 0; g0 < groups && nblk > 0; g0 += kMaxGroups) {  // passes of up to 80 rows
    const int ng = static_cast<int>(std::min<int64_t>(kMaxGroups, groups - g0));
    const int last = static_cast<int>(std::min(m, (g0 + ng) * kTile) - (g0 + ng - 1) * kTile);
    int configured_nr = 0;
    for (size_t i = 0; i < nblk; ++i) {
      const Block& bk = blocks[i];
      if (bk.nr != configured_nr) {
        const TileConfig cfg = tile_config(ng, bk.nr, last);
        _tile_loadconfig(&cfg);
        configured_nr = bk.nr;
      }
      tile_pass_groups<F, Fold>(ng, t, g0, w, bk, i + 1 < nblk ? &blocks[i + 1] : nullptr, c);
      for (int g = 0; g < ng; ++g) {  // c[g]: C of group g0 + g
        const int64_t r0 = (g0 + g) * kTile;
        const int rows = static_cast<int>(std::min<int64_t>(kTile, m - r0));
        for (int j = 0; j < bk.nr; ++j) {
          if (!(bk.take >> j & 1u)) continue;
          for (int r = 0; r < rows; ++r) emit_output(out, r0 + r, bk.n + j, c[g][j][r]);
        }
      }
    }
  }
}

// The t.rows() bf16 rows (prepared rows a, outputs through out) × weight rows [n0, n1); the weight rows the tiles
// leave go to `fallback` (the avx512bf16 kernel's plan for these rows).
template <WeightFormat F>
bool tile_gemm(const RowsPlan& fallback, const float* const* a, const TileRows& t, const ExpertWeight& w, int64_t n0,
               int64_t n1, const OutRows& out) {
  const int64_t m = t.rows();
  // The weight blocks with rows for the tiles; a block's other rows are left for the avx512bf16 kernel below.
  std::vector<Block> blocks;
  std::vector<unsigned> left;  // per block: the rows for the avx512bf16 kernel
  bool all = true;
  for (int64_t n = n0; n < n1; n += kTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kTile, n1 - n));
    const unsigned take = tile_rows(w, n, nr);
    if (take != 0) blocks.push_back({n, nr, take});
    left.push_back(((1u << nr) - 1u) & ~take);
    all = all && left.back() == 0;
  }
  tile_blocks<F, F == WeightFormat::Fp8>(t, w, blocks, out);
  _tile_release();
  if (all) return true;
  // Rows the tiles do not take, in runs of consecutive weight rows: the avx512bf16 kernel, for all rows (its
  // bits, whatever the neighbours).
  bool ok = true;
  int64_t run = -1;
  for (int64_t n = n0; n <= n1; ++n) {
    const bool taken = n < n1 && !(left[(n - n0) / kTile] >> ((n - n0) % kTile) & 1u);
    if (!taken && n < n1 && run < 0) run = n;
    if ((taken || n == n1) && run >= 0) {
      ok = avx512bf16::run(fallback.path, a, m, w, run, n, out) && ok;
      run = -1;
    }
  }
  return ok;
}

}  // namespace

namespace amx {

bool run(const RowsPlan& fallback, const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
         const OutRows& out, const TileRows* tiles) {
  TileRows own;
  if (tiles == nullptr) {
    own.pack(a, nullptr, m, w.k);
    tiles = &own;
  }
  switch (w.format) {
    case WeightFormat::Fp4:
      return tile_gemm<WeightFormat::Fp4>(fallback, a, *tiles, w, n0, n1, out);
    case WeightFormat::Fp8:
      return tile_gemm<WeightFormat::Fp8>(fallback, a, *tiles, w, n0, n1, out);
    case WeightFormat::Bf16:
      break;
  }
  return tile_gemm<WeightFormat::Bf16>(fallback, a, *tiles, w, n0, n1, out);
}

}  // namespace amx
}  // namespace cpu
}  // namespace static_moe

#pragma GCC pop_options
