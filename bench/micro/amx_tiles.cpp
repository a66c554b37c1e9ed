// What the AMX tile product does to the bits, and what it costs, on this CPU: the facts behind the amx kernel's
// layout and behind keeping it opt-in (docs/backends/cpu.md, "The AMX kernel (opt-in)"). Torch-free; needs
// AMX-TILE / AMX-BF16 and AVX-512 BF16, and Linux's permission for the tile state (asked as the kernels ask it,
// csrc/cpu/simd.h's amx_permitted).
//
//   g++ -O2 -march=sapphirerapids -Icsrc -o build/micro/amx_tiles bench/micro/amx_tiles.cpp && build/micro/amx_tiles
//
// 1. Bits. One TDPBF16PS (C 16×16 fp32 += A 16×32 bf16 · B in pairs) on random operands whose exponents spread
//    over ±spread, against four readings of "C[m][n] += the unit's 32 products": a chain of VDPBF16PS over the
//    unit's 16 pairs in k order (what a kernel with one lane per output would compute), one fp32 add per product
//    in k order, each pair summed exactly and added with one rounding, and the whole unit summed exactly and
//    added with one rounding. An output that matches none of them means no vdpbf16ps kernel can hand a row over
//    to the tiles by row count with the same bits. ("Exact" sums are double (pairs) and long double (the unit):
//    exact while the terms' exponents lie within about 37 and 43 binades, nearly always at spreads 0 and 5; at
//    20 they may lose terms far below the result's last fp32 bit.)
// 2. Operand order. The same products with the operands swapped (activation rows as A, weight rows as B in
//    pairs, C transposed): whether an output's bits depend on which operand holds the weights.
// 3. Cost. TDPBF16PS by rows of A (the instruction walks them), into one C tile back to back and into six in
//    turn; a 1 KiB tile load from L1. Nanoseconds of the wall clock, best of 5.
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include "cpu/simd.h"

namespace {

struct alignas(64) TileConfig {  // LDTILECFG's operand (Intel SDM): palette 1, bytes per row, rows per tile
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

uint16_t to_bf16(float f) {  // truncation: the operands only need to be bf16 numbers, not rounded ones
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
float of_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

alignas(64) uint16_t g_a[16][32], g_b[16][32], g_x[16][32], g_bt[16][32];
alignas(64) float g_c0[16][16], g_c[16][16], g_ct[16][16];
alignas(64) uint8_t g_buf[32][1024];

void dp(float (*c)[16], const uint16_t (*a)[32], const uint16_t (*b)[32]) {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  _tile_loadd(0, c, 64);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
}

void bits(int spread) {
  std::mt19937 g(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-spread, spread);
  auto value = [&] { return std::ldexp(u(g), e(g)); };
  long total = 0, chain = 0, each = 0, pair = 0, unit = 0, swapped = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    for (int m = 0; m < 16; ++m)
      for (int k = 0; k < 32; ++k) g_a[m][k] = to_bf16(value()), g_x[m][k] = to_bf16(value());
    // B in pairs: row j holds pair j (k = 2j, 2j + 1) of each of its 16 columns
    for (int j = 0; j < 16; ++j)
      for (int n = 0; n < 16; ++n)
        for (int h = 0; h < 2; ++h) g_b[j][2 * n + h] = g_x[n][2 * j + h], g_bt[j][2 * n + h] = g_a[n][2 * j + h];
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) g_c0[m][n] = value(), g_ct[n][m] = g_c0[m][n];
    std::memcpy(g_c, g_c0, sizeof(g_c));
    dp(g_c, g_a, g_b);    // C[m][n]: weight row m (A) · activation row n (B)
    dp(g_ct, g_x, g_bt);  // the same products, activation row n as A and weight row m as B: C^T
    for (int m = 0; m < 16; ++m) {
      __m512 acc = _mm512_loadu_ps(g_c0[m]);
      for (int j = 0; j < 16; ++j) {
        uint32_t p;
        std::memcpy(&p, &g_a[m][2 * j], 4);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(p)),
                               (__m512bh)_mm512_load_si512(g_b[j]));
      }
      float lanes[16];
      _mm512_storeu_ps(lanes, acc);
      for (int n = 0; n < 16; ++n) {
        const float c = g_c[m][n];
        float s = g_c0[m][n], q = g_c0[m][n];
        long double all = g_c0[m][n];
        for (int k = 0; k < 32; ++k) {
          const float prod = of_bf16(g_a[m][k]) * of_bf16(g_x[n][k]);  // exact in fp32
          s += prod;
          all += prod;
          if (k % 2 == 1) {
            const double two = static_cast<double>(of_bf16(g_a[m][k - 1]) * of_bf16(g_x[n][k - 1])) + prod;
            q = static_cast<float>(static_cast<double>(q) + two);
          }
        }
        ++total;
        chain += !same_bits(c, lanes[n]);
        each += !same_bits(c, s);
        pair += !same_bits(c, q);
        unit += !same_bits(c, static_cast<float>(all));
        swapped += !same_bits(c, g_ct[n][m]);
      }
    }
  }
  std::printf(
      "exponents within +-%-2d  %ld outputs differ from: vdpbf16ps chain %.1f %%, one add per product %.1f %%, "
      "exact pairs %.1f %%, exact unit %.1f %%; operands swapped %ld\n",
      spread, total, 100.0 * chain / total, 100.0 * each / total, 100.0 * pair / total, 100.0 * unit / total, swapped);
}

template <class F>
double best_ns(F&& f, long iters) {
  double best = 1e300;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f(iters);
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / iters;
}

void cost() {
  for (int rows : {1, 2, 4, 8, 16}) {
    TileConfig cfg;
    for (int t = 0; t < 6; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;  // C tiles
    cfg.rows[6] = static_cast<uint8_t>(rows), cfg.colsb[6] = 64;                              // A
    cfg.rows[7] = 16, cfg.colsb[7] = 64;                                                      // B
    _tile_loadconfig(&cfg);
    _tile_loadd(6, g_a, 64);
    _tile_loadd(7, g_b, 64);
    _tile_zero(0);  // GCC's tile intrinsics are asm statements: one per statement
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    const double one = best_ns(
        [](long n) {
          for (long i = 0; i < n; ++i) _tile_dpbf16ps(0, 6, 7);
        },
        200000);
    const double six = best_ns(
                           [](long n) {
                             for (long i = 0; i < n; ++i) {
                               _tile_dpbf16ps(0, 6, 7);
                               _tile_dpbf16ps(1, 6, 7);
                               _tile_dpbf16ps(2, 6, 7);
                               _tile_dpbf16ps(3, 6, 7);
                               _tile_dpbf16ps(4, 6, 7);
                               _tile_dpbf16ps(5, 6, 7);
                             }
                           },
                           50000) /
                       6;
    std::printf(
        "TDPBF16PS, %2d rows of A: %.2f ns into one C tile back to back, %.2f ns into six in turn "
        "(%.0f GFLOP/s)\n",
        rows, one, six, 2.0 * rows * 16 * 32 / six);
    _tile_release();
  }
  TileConfig cfg;
  cfg.rows[7] = 16, cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
  const double load = best_ns(
      [](long n) {
        for (long i = 0; i < n; ++i) _tile_loadd(7, g_buf[i & 31], 64);
      },
      200000);
  std::printf("TILELOADD of 16 rows x 64 bytes from L1: %.2f ns\n", load);
  _tile_release();
}

}  // namespace

int main() {
  if (!static_moe::cpu::amx_permitted()) {
    std::fprintf(stderr, "amx_tiles: the OS does not grant the AMX tile state here\n");
    return 2;
  }
  for (int spread : {0, 5, 20}) bits(spread);
  cost();
  return 0;
}
