// Issue rates and latencies of the AVX-512 instructions the avx512bf16 expert GEMM is made of, on this CPU, and of
// its inner blocks run from L1: what bounds the one-row and few-row fp4 GEMMs once DRAM is out of the way
// (docs/backends/cpu.md, "What binds the avx512bf16 fp4 GEMM"). Torch-free; needs AVX512 F/BW/VBMI/BF16.
//
//   g++ -O3 -march=native -o build/micro/issue_rates bench/micro/issue_rates.cpp && build/micro/issue_rates
// (-O3: the blocks' accumulator arrays must be unrolled into registers, as in the kernel)
//
// Cycles are core cycles: the time-stamp counter's ticks times the core clock over the TSC rate, which the first
// line measures with a chain of dependent scalar adds (one cycle each). Every figure is the best of 7 runs (other
// processes only slow a run down). "rate" rows: 8 or 12 independent instructions per iteration, cycles per
// instruction; "latency" rows: one dependent chain; "block" rows: cycles per 32-k unit of the kernel's blocks.
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

namespace {

constexpr long kIters = 2000000;
alignas(64) uint8_t g_buf[16384];
double g_tsc_per_cycle = 1.0;

template <class F>
double best_ticks(F&& f) {
  double best = 1e300;
  for (int r = 0; r < 7; ++r) {
    const uint64_t t0 = __rdtsc();
    f();
    best = std::min(best, static_cast<double>(__rdtsc() - t0));
  }
  return best;
}

// Cycles per instruction of an asm body holding `per` instructions, run kIters times.
#define RATE(name, per, body, ...)                                                        \
  {                                                                                       \
    const double t = best_ticks([&] {                                                     \
      for (long n = 0; n < kIters; ++n) __asm__ volatile(body::"r"(g_buf) : __VA_ARGS__); \
    });                                                                                   \
    std::printf("%-52s %6.2f cycles\n", name, t / kIters / (per) / g_tsc_per_cycle);      \
  }

#define X8(op) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9)
#define CLOBBER8 "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9"

alignas(64) uint16_t g_act[6][512];
alignas(64) uint16_t g_wb[4][512];
alignas(64) uint8_t g_wq[4][256];
alignas(64) uint16_t g_tab[8][32];
alignas(64) uint8_t g_ctl[64];
alignas(64) uint16_t g_shifts[32];
volatile float g_sink;

// How a block's weight units are made: bf16 loaded as they are; fp4 decoded per unit by the kernel's broadcast,
// vpsrlvw and vpermw from the scale byte's table, or by its earlier broadcast, vpmultishiftqb and vpermw.
enum class Weights { Bf16, Fp4, Fp4Multishift };

// The kernel's MR × NR block over 16 units (512 k) from L1, repeated.
template <int MR, int NR, Weights W>
double block_cycles_per_unit() {
  const double t = best_ticks([&] {
    __m512 acc[MR][NR];
    for (auto& r : acc)
      for (auto& v : r) v = _mm512_setzero_ps();
    const __m512i ctl = _mm512_load_si512(g_ctl);
    const __m512i shifts = _mm512_load_si512(g_shifts);
    for (long n = 0; n < kIters / 16; ++n) {
      for (int u = 0; u < 16; ++u) {
        __m512bh wv[NR];
        for (int j = 0; j < NR; ++j) {
          if constexpr (W != Weights::Bf16) {
            const __m512i d =
                _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(g_wq[j] + u * 16)));
            const __m512i idx = W == Weights::Fp4 ? _mm512_srlv_epi16(d, shifts) : _mm512_multishift_epi64_epi8(ctl, d);
            wv[j] = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_load_si512(g_tab[(u + j) & 7]));
          } else {
            wv[j] = (__m512bh)_mm512_load_si512(g_wb[j] + u * 32);
          }
        }
        for (int i = 0; i < MR; ++i) {
          const __m512bh a = (__m512bh)_mm512_load_si512(g_act[i] + u * 32);
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, wv[j]);
        }
      }
      __asm__ volatile("" ::: "memory");
    }
    float s = 0;
    for (auto& r : acc)
      for (auto& v : r) s += _mm512_reduce_add_ps(v);
    g_sink = s;
  });
  return t / (kIters / 16 * 16) / g_tsc_per_cycle;
}

}  // namespace

int main() {
  {
    uint64_t x = 1;
    const double t = best_ticks([&] {
      for (long n = 0; n < kIters; ++n)
        __asm__ volatile(
            "add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\t"
            "add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0"
            : "+r"(x));
    });
    g_tsc_per_cycle = t / kIters / 8;
    std::printf("%-52s %6.3f (core clock = TSC rate / this)\n", "TSC ticks per core cycle", g_tsc_per_cycle);
  }
#define OP_PANDD(r) "vpandd %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vpandd zmm", 8, X8(OP_PANDD), CLOBBER8)
#define OP_PERMW(r) "vpermw %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vpermw zmm", 8, X8(OP_PERMW), CLOBBER8)
#define OP_MSHIFT(r) "vpmultishiftqb %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vpmultishiftqb zmm", 8, X8(OP_MSHIFT), CLOBBER8)
#define OP_PSHUFB(r) "vpshufb %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vpshufb zmm", 8, X8(OP_PSHUFB), CLOBBER8)
#define OP_DP(r) "vdpbf16ps %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vdpbf16ps zmm (8 chains)", 8, X8(OP_DP), CLOBBER8)
#define OP_LDZ(r) "vmovdqu64 " #r "*64(%0),%%zmm" #r "\n\t"
  RATE("rate   zmm load (vmovdqu64)", 8, X8(OP_LDZ), CLOBBER8)
#define OP_LDX(r) "vmovdqu " #r "*16(%0),%%xmm" #r "\n\t"
  RATE("rate   xmm load (vmovdqu)", 8, X8(OP_LDX), CLOBBER8)
#define OP_BC(r) "vbroadcasti32x4 " #r "*16(%0),%%zmm" #r "\n\t"
  RATE("rate   vbroadcasti32x4 zmm, m128", 8, X8(OP_BC), CLOBBER8)
#define OP_PERMW_M(r) "vpermw " #r "*64(%0),%%zmm1,%%zmm" #r "\n\t"
  RATE("rate   vpermw zmm, m512 table", 8, X8(OP_PERMW_M), CLOBBER8)
// Two instructions interleaved, eight chains each: the second writes zmm1r (zmm12-19) so the two never share one.
#define CLOBBER16 CLOBBER8, "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19"
#define BESIDE_DP(r) "vdpbf16ps %%zmm1,%%zmm0,%%zmm1" #r "\n\t"
#define OP_MIX(r) OP_PERMW(r) "vpmultishiftqb %%zmm1,%%zmm0,%%zmm1" #r "\n\t"
  RATE("rate   vpermw + vpmultishiftqb, interleaved", 16, X8(OP_MIX), CLOBBER16)
#define OP_MIX2(r) OP_PERMW(r) BESIDE_DP(r)
  RATE("rate   vpermw + vdpbf16ps, interleaved", 16, X8(OP_MIX2), CLOBBER16)
#define OP_MIX3(r) OP_MSHIFT(r) BESIDE_DP(r)
  RATE("rate   vpmultishiftqb + vdpbf16ps, interleaved", 16, X8(OP_MIX3), CLOBBER16)
// fp8's decode: vpermi2b (its index register is overwritten: eight chains) and the byte unpacks; the fold's FMA.
#define OP_PERMI2B(r) "vpermi2b %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vpermi2b zmm", 8, X8(OP_PERMI2B), CLOBBER8)
#define OP_MIX5(r) OP_PERMI2B(r) BESIDE_DP(r)
  RATE("rate   vpermi2b + vdpbf16ps, interleaved", 16, X8(OP_MIX5), CLOBBER16)
#define OP_UNPCK(r) "vpunpcklbw %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vpunpcklbw zmm", 8, X8(OP_UNPCK), CLOBBER8)
#define OP_MIX6(r) OP_UNPCK(r) BESIDE_DP(r)
  RATE("rate   vpunpcklbw + vdpbf16ps, interleaved", 16, X8(OP_MIX6), CLOBBER16)
#define OP_MIX7(r) "vfmadd231ps %%zmm1,%%zmm0,%%zmm" #r "\n\t" BESIDE_DP(r)
  RATE("rate   vfmadd231ps + vdpbf16ps, interleaved", 16, X8(OP_MIX7), CLOBBER16)
#define OP_SRLV(r) "vpsrlvw %%zmm1,%%zmm0,%%zmm" #r "\n\t"
  RATE("rate   vpsrlvw zmm", 8, X8(OP_SRLV), CLOBBER8)
#define OP_MIX4(r) OP_SRLV(r) BESIDE_DP(r)
  RATE("rate   vpsrlvw + vdpbf16ps, interleaved", 16, X8(OP_MIX4), CLOBBER16)
  RATE("latency vdpbf16ps", 4,
       "vdpbf16ps %%zmm1,%%zmm0,%%zmm2\n\tvdpbf16ps %%zmm1,%%zmm0,%%zmm2\n\t"
       "vdpbf16ps %%zmm1,%%zmm0,%%zmm2\n\tvdpbf16ps %%zmm1,%%zmm0,%%zmm2",
       "xmm2")
  RATE("latency vpermw", 4,
       "vpermw %%zmm1,%%zmm2,%%zmm2\n\tvpermw %%zmm1,%%zmm2,%%zmm2\n\t"
       "vpermw %%zmm1,%%zmm2,%%zmm2\n\tvpermw %%zmm1,%%zmm2,%%zmm2",
       "xmm2")
  RATE("latency vpmultishiftqb", 4,
       "vpmultishiftqb %%zmm2,%%zmm1,%%zmm2\n\tvpmultishiftqb %%zmm2,%%zmm1,%%zmm2\n\t"
       "vpmultishiftqb %%zmm2,%%zmm1,%%zmm2\n\tvpmultishiftqb %%zmm2,%%zmm1,%%zmm2",
       "xmm2")
// One one-row fp4 unit (broadcast load, index instruction idx: zmm3 -> zmm2, vpermw, dot) into accumulator acc.
#define UNIT(idx, acc, off)                       \
  "vbroadcasti32x4 " #off "/4(%0),%%zmm3\n\t" idx \
  "\n\t"                                          \
  "vpermw " #off "(%0),%%zmm2,%%zmm2\n\tvdpbf16ps %%zmm30,%%zmm2,%%zmm" #acc "\n\t"
#define UNITS8(idx) \
  UNIT(idx, 8, 0)   \
  UNIT(idx, 9, 64)  \
  UNIT(idx, 10, 128) UNIT(idx, 11, 192) UNIT(idx, 12, 256) UNIT(idx, 13, 320) UNIT(idx, 14, 384) UNIT(idx, 15, 448)
  RATE("unit   one-row fp4 unit (load, vpsrlvw, vpermw, dot), 8 rows", 8, UNITS8("vpsrlvw %%zmm1,%%zmm3,%%zmm2"),
       "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15")
  RATE("unit   the same with vpmultishiftqb, 8 rows", 8, UNITS8("vpmultishiftqb %%zmm3,%%zmm1,%%zmm2"), "xmm2", "xmm3",
       "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15")
  // The fp8 panel's 4 × 3 unit (4 activation rows × 3 decoded weight rows, 12 vdpbf16ps) from L1, per unit: as GCC
  // compiled it with 24 accumulators live (each product reloads its activation: 3 + 12 loads), and with the 4
  // activation units loaded once into registers (3 + 4 loads).
#define DPM(a, acc) "vdpbf16ps " #a "(%0),%%zmm24,%%zmm" #acc "\n\t"
#define DPR(a, acc) "vdpbf16ps %%zmm" #a ",%%zmm24,%%zmm" #acc "\n\t"
  RATE("unit   fp8 panel 4 x 3, activations reloaded (15 loads)", 1,
       "vmovdqu64 0(%0),%%zmm24\n\t" DPM(1024, 0) DPM(2048, 1) DPM(3072, 2)
           DPM(4096, 3) "vmovdqu64 64(%0),%%zmm24\n\t" DPM(1024, 4) DPM(2048, 5) DPM(3072, 6)
               DPM(4096, 7) "vmovdqu64 128(%0),%%zmm24\n\t" DPM(1024, 8) DPM(2048, 9) DPM(3072, 10) DPM(4096, 11),
       "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm24")
  RATE("unit   fp8 panel 4 x 3, activations in registers (7 loads)", 1,
       "vmovdqu64 1024(%0),%%zmm26\n\tvmovdqu64 2048(%0),%%zmm27\n\t"
       "vmovdqu64 3072(%0),%%zmm28\n\tvmovdqu64 4096(%0),%%zmm29\n\t"
       "vmovdqu64 0(%0),%%zmm24\n\t" DPR(26, 0) DPR(27, 1) DPR(28, 2)
           DPR(29, 3) "vmovdqu64 64(%0),%%zmm24\n\t" DPR(26, 4) DPR(27, 5) DPR(28, 6)
               DPR(29, 7) "vmovdqu64 128(%0),%%zmm24\n\t" DPR(26, 8) DPR(27, 9) DPR(28, 10) DPR(29, 11),
       "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm24",
       "xmm26", "xmm27", "xmm28", "xmm29")
  for (int w = 0; w < 32; ++w) g_shifts[w] = static_cast<uint16_t>(4 * (w / 8));
  std::printf("%-52s %6.2f cycles / unit (%d vdpbf16ps)\n", "block  4 x 4, fp4 decoded (vpsrlvw), L1",
              block_cycles_per_unit<4, 4, Weights::Fp4>(), 16);
  std::printf("%-52s %6.2f cycles / unit (%d vdpbf16ps)\n", "block  4 x 4, fp4 decoded (vpmultishiftqb), L1",
              block_cycles_per_unit<4, 4, Weights::Fp4Multishift>(), 16);
  std::printf("%-52s %6.2f cycles / unit (%d vdpbf16ps)\n", "block  4 x 4, bf16 weights, L1",
              block_cycles_per_unit<4, 4, Weights::Bf16>(), 16);
  std::printf("%-52s %6.2f cycles / unit (%d vdpbf16ps)\n", "block  6 x 4, bf16 weights, L1",
              block_cycles_per_unit<6, 4, Weights::Bf16>(), 24);
  return 0;
}
