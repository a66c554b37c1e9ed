// Micro-benchmark of the fp4 expert GEMM's parts on this CPU (bench/bench_cpu_micro.py builds and runs it):
// which resource binds the one-row (GEMV), 4-row and 16-row cases of csrc/cpu/kernels/expert_gemm_avx512bf16.cpp.
//
//   read      a read-only stream of the expert's weight bytes (vector loads, one sum per 64-byte line), cold:
//             the bandwidth roof for weights on t threads
//   kernel    static_moe's expert_gemm_rows (the real kernel, Isa::Avx512Bf16 and Isa::Avx512), cold and hot, for
//             fp4, fp8 and bf16 weights
//   decode    the kernel's fp4 decode sequence alone (load + vpsrlvw + vpermw from the scale byte's table per
//             32 weights, results xor-folded so nothing is optimised away), hot (weights in L2); decode_v2 / v3: two
//             candidate decodes of 64 weights per step (see decode_only_v2 / v3), kept for comparison: v2 was 1.39×
//             the kernel's earlier decode (which added the scale per unit) alone, slower inside the kernel, and the
//             same speed as its decode since that decode reads precomputed tables (see docs/backends/cpu.md)
//   dot       vdpbf16ps over already-decoded bf16 weights alone (the kernel with bf16 weights), hot
// Every timing is the best of `reps` runs (3 × reps cold, 50 × reps short ones for the peak: other processes can only
// slow a run down, and the best run is the one that had the core alone). "cold" rewrites a buffer of 4× the
// last-level cache before each run; "hot" uses an N small enough that the weights stay in L2.
// Output: one line per measurement, "name threads rows value unit", parsed by the driver.
// Usage: fp4_gemv [N=4096] [K=4096] [reps=7] [decode|thp]   ("decode": stop after the decode timings; "thp": only the
// cold kernel at 1, 4 and 16 rows with the expert in 4 KiB pages and in 2 MiB pages (a 2 MiB-aligned buffer advised
// MADV_HUGEPAGE before its first touch; "huge pages granted" says whether the kernel gave them), alternately)
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <sys/mman.h>

#include "cpu/kernels/expert_gemm.h"
#include "micro_inputs.h"

using namespace static_moe::cpu;

namespace {

template <class F>
double best_of(int reps, bool cold, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    if (cold) flush();
    const double t0 = now();
    f();
    best = std::min(best, now() - t0);
  }
  return best;
}

// The real kernel over all N weight rows on t threads (column_chunks).
double kernel(Isa isa, const Expert& e, WeightFormat wf, Rows& r, int64_t m, int t, int reps, bool cold) {
  const ExpertWeight w = e.view(wf);
  OutRows o;
  o.rows = r.optr.data();
  return best_of(reps, cold, [&] {
    column_chunks(e.n, t, [&](int64_t n0, int64_t n1) {
      expert_gemm_rows(isa, r.ptr.data(), r.is_bf16.data(), m, w, n0, n1, o);
    });
  });
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")

// Read-only stream over `bytes` bytes on t threads (static split), one 512-bit load per line.
__attribute__((noinline)) double read_stream(const uint8_t* p, size_t bytes, int t, int reps) {
  static volatile int sink;  // keeps the loads alive
  (void)sink;
  return best_of(reps, true, [&] {
    int acc_all = 0;
#pragma omp parallel num_threads(t) reduction(^ : acc_all)
    {
      const int id = omp_get_thread_num();
      const size_t per = bytes / t / 256 * 256;
      const uint8_t* q = p + id * per;
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t i = 0; i < per; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(q + i));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(q + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(q + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(q + i + 192));
      }
      acc_all ^= _mm_cvtsi128_si32(
          _mm512_castsi512_si128(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3))));
    }
    sink = acc_all;
  });
}

alignas(64) const uint16_t kTable[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                         0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
                                         0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                         0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
alignas(64) uint16_t kShifts[32];  // the kernel's vpsrlvw counts: 4L for the words of 128-bit lane L

// The kernel's fast-path tables: kTable with (b - 127) << 7 added to the exponent of its non-zero entries, per byte.
alignas(64) uint16_t kTables[256][32];
void init_tables() {
  for (int b = 0; b < 256; ++b)
    for (int w = 0; w < 32; ++w)
      kTables[b][w] = w % 8 == 0 ? kTable[w] : static_cast<uint16_t>(kTable[w] + (b - 127) * 128);
}

// The fast fp4 decode of the kernel on 4 weight rows at a time, results xor-folded: decode throughput alone.
__attribute__((noinline)) uint32_t decode_only(const Expert& e, int64_t rows) {
  const __m512i shifts = _mm512_load_si512(kShifts);
  __m512i f0 = _mm512_setzero_si512(), f1 = f0, f2 = f0, f3 = f0;
  const int64_t rb = e.k / 2, sb = e.k / 32;
  for (int64_t n = 0; n < rows; n += 4) {
    for (int64_t u = 0; u < e.k / 32; ++u) {
      auto one = [&](int j, __m512i& f) {
        const uint8_t* q = e.q.data() + (n + j) * rb + u * 16;
        const __m512i d = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        const __m512i idx = _mm512_srlv_epi16(d, shifts);
        const __m512i lut = _mm512_load_si512(kTables[e.s[(n + j) * sb + u]]);
        f = _mm512_xor_si512(f, _mm512_permutexvar_epi16(idx, lut));
      };
      one(0, f0);
      one(1, f1);
      one(2, f2);
      one(3, f3);
    }
  }
  const __m512i f = _mm512_xor_si512(_mm512_xor_si512(f0, f1), _mm512_xor_si512(f2, f3));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_castsi512_si128(f)));
}

// The 16 UE8M0 bytes of 512-k chunk c of weight rows n … n+3 as bf16 exponent deltas ((b − 127) << 7), one word
// each in the low half of dl[j]: what the two candidate decodes add to the table's exponents.
inline void chunk_scale_deltas(const Expert& e, int64_t n, int64_t c, __m512i dl[4]) {
  const int64_t sb = e.k / 32;
  for (int j = 0; j < 4; ++j) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e.s.data() + (n + j) * sb + c * 16));
    dl[j] =
        _mm512_castsi256_si512(_mm256_slli_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(b), _mm256_set1_epi16(127)), 7));
  }
}

// The loop both two-unit candidate decodes share: per 32 packed bytes (64 weights, units A and B) of each of 4 weight
// rows, `indices(q)` gives the two vpermw index vectors (word indices with bit 4 telling unit A, words 0-15, from
// unit B, words 16-31), and one 32-entry table holds both units' scaled e2m1 values (the two units' deltas, picked
// from the chunk's by vpermw); the results are xor-folded.
template <class Indices>
__attribute__((always_inline)) inline uint32_t decode_two_units(const Expert& e, int64_t rows, Indices indices) {
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i idx0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // [0]*16 + [1]*16
  __m512i f[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  const int64_t rb = e.k / 2;
  for (int64_t n = 0; n < rows; n += 4) {
    for (int64_t c = 0; c < e.k / 512; ++c) {
      __m512i dl[4];
      chunk_scale_deltas(e, n, c, dl);
      __m512i idx = idx0;
      for (int p = 0; p < 8; ++p) {
        for (int j = 0; j < 4; ++j) {
          __m512i i1, i2;
          indices(e.q.data() + (n + j) * rb + c * 256 + p * 32, i1, i2);
          const __m512i lut = _mm512_mask_add_epi16(table, 0xFEFEFEFEu, table, _mm512_permutexvar_epi16(idx, dl[j]));
          f[j] = _mm512_xor_si512(f[j], _mm512_permutexvar_epi16(i1, lut));
          f[j] = _mm512_xor_si512(f[j], _mm512_permutexvar_epi16(i2, lut));
        }
        idx = _mm512_add_epi16(idx, _mm512_set1_epi16(2));
      }
    }
  }
  const __m512i x = _mm512_xor_si512(_mm512_xor_si512(f[0], f[1]), _mm512_xor_si512(f[2], f[3]));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_castsi512_si128(x)));
}

// A candidate decode, two units (64 weights) per step: the 32 bytes zero-extended to words (vpmovzxbw), low and high
// nibbles as word indices; two vpermw give the even and the odd columns.
__attribute__((noinline)) uint32_t decode_only_v2(const Expert& e, int64_t rows) {
  const __m512i c0f = _mm512_set1_epi16(0x000F);
  const __m512i hib = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(0x0010), 1);
  return decode_two_units(e, rows, [&](const uint8_t* q, __m512i& lo, __m512i& hi) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    lo = _mm512_ternarylogic_epi32(x, c0f, hib, 0xEA);  // (x & 0xF) | hib
    hi = _mm512_or_si512(_mm512_srli_epi16(x, 4), hib);
  });
}

// Candidate 3: the 32 bytes broadcast to both 256-bit halves (a plain load), each word's four nibbles picked by
// per-half variable shifts (vpsrlvw), no cross-lane shuffle before the two table lookups.
__attribute__((noinline)) uint32_t decode_only_v3(const Expert& e, int64_t rows) {
  // words 8-15 of each half come from bytes 16-31 (unit B): index bit 4 set there
  const __m512i sel = _mm512_set_epi16(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16,
                                       16, 16, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i c0f = _mm512_set1_epi16(0x000F);
  const __m512i sh1 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i sh2 = _mm512_inserti64x4(_mm512_set1_epi16(8), _mm256_set1_epi16(12), 1);
  return decode_two_units(e, rows, [&](const uint8_t* q, __m512i& i1, __m512i& i2) {
    const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    i1 = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(x, sh1), c0f, sel, 0xEA);
    i2 = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(x, sh2), c0f, sel, 0xEA);
  });
}

// Peak of vdpbf16ps from registers: 12 independent chains (what one core can issue at best).
__attribute__((noinline)) float dpbf16_peak(int64_t iters) {
  __m512 c[12];
  for (auto& v : c) v = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3F80);
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : c) v = _mm512_dpbf16_ps(v, a, b);
  __m512 s = c[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, c[i]);
  return _mm512_reduce_add_ps(s);
}

#pragma GCC pop_options

void line(const char* name, int t, int64_t m, double v, const char* unit) {
  std::printf("%s %d %lld %.4g %s\n", name, t, static_cast<long long>(m), v, unit);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 4096, K = argc > 2 ? std::atoll(argv[2]) : 4096;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 7;
  const int tmax = omp_get_max_threads();
  for (int w = 0; w < 32; ++w) kShifts[w] = static_cast<uint16_t>(4 * (w / 8));
  init_tables();
  std::mt19937 g(1);
  const Expert big = make_fp4(N, K, g);
  const Expert big16 = make_bf16(N, K, g);
  const int64_t NH = 64;  // hot: 64 fp4 rows = 128 KiB at K 4096 (in L2); bf16: 512 KiB
  const Expert hot = make_fp4(NH, K, g);
  const Expert hot16 = make_bf16(NH, K, g);
  const Expert hot8 = make_fp8(NH, K, g);
  const Expert big8 = make_fp8(N, K, g);
  const double wbytes = static_cast<double>(big.q.size() + big.s.size());
  std::vector<uint8_t> stream(big.q.size() + 64);
  uint8_t* sp = stream.data() + (64 - reinterpret_cast<uintptr_t>(stream.data()) % 64) % 64;
  std::memcpy(sp, big.q.data(), big.q.size());

  // Single-core vdpbf16ps peak (GFLOP/s: 64 FLOPs per instruction).
  {
    const int64_t it = 1000000;  // ~3 ms a sample: short, many, so that the best of them saw the core alone
    float sink = 0;
    const double t = best_of(50 * reps, false, [&] { sink += dpbf16_peak(it); });
    line("dpbf16_peak", 1, 0, 12.0 * it * 64 / t / 1e9, "GFLOP/s");
    if (sink == 1.2345f) std::printf("#\n");
  }
  for (int t = 1; t <= tmax; ++t) {
    line("read_cold", t, 0, big.q.size() / read_stream(sp, big.q.size(), t, 3 * reps) / 1e9, "GB/s");
  }
  // Decode alone, hot: ns per 32-weight unit (and the GB/s of fp4 bytes that rate could consume).
  {
    const int64_t rounds = 200;
    volatile uint32_t sink = 0;  // keeps the decodes alive
    const double t = best_of(reps, false, [&] {
      for (int64_t r = 0; r < rounds; ++r) sink = sink + decode_only(hot, NH);
    });
    const double units = static_cast<double>(rounds) * NH * K / 32;
    line("decode_hot_ns_per_unit", 1, 0, t / units * 1e9, "ns");
    line("decode_hot", 1, 0, units * 16 / t / 1e9, "GB/s");
    const double t2 = best_of(reps, false, [&] {
      for (int64_t r = 0; r < rounds; ++r) sink = sink + decode_only_v2(hot, NH);
    });
    line("decode_v2_hot_ns_per_unit", 1, 0, t2 / units * 1e9, "ns");
    const double t3 = best_of(reps, false, [&] {
      for (int64_t r = 0; r < rounds; ++r) sink = sink + decode_only_v3(hot, NH);
    });
    line("decode_v3_hot_ns_per_unit", 1, 0, t3 / units * 1e9, "ns");
  }
  if (argc > 4 && std::strcmp(argv[4], "decode") == 0) return 0;
  if (argc > 4 && std::strcmp(argv[4], "thp") == 0) {
    const size_t qb = big.q.size(), sb = big.s.size(), page = 2u << 20;
    const size_t total = (qb + sb + page - 1) / page * page;
    uint8_t* buf[2];
    for (int h = 0; h < 2; ++h) {
      buf[h] = static_cast<uint8_t*>(std::aligned_alloc(page, total));
      if (buf[h] == nullptr) {
        std::fprintf(stderr, "fp4_gemv: no %zu bytes for the page test\n", total);
        return 1;
      }
      madvise(buf[h], total, h == 1 ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);  // 4 KiB even where THP is "always"
      std::memcpy(buf[h], big.q.data(), qb);                             // the first touch: after the advice
      std::memcpy(buf[h] + qb, big.s.data(), sb);
    }
    std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
    long anon_huge_kb = -1;
    char text[256];
    while (f && std::fgets(text, sizeof text, f)) std::sscanf(text, "AnonHugePages: %ld kB", &anon_huge_kb);
    if (f) std::fclose(f);
    std::printf("# huge pages granted: %ld kB of %zu\n", anon_huge_kb, total / 1024);
    for (int64_t m : {1, 4, 16}) {
      Rows r(Isa::Avx512Bf16, WeightFormat::Fp4, m, K, N, g);
      OutRows o;
      o.rows = r.optr.data();
      for (int t = 1; t <= tmax; ++t) {
        for (int h = 0; h < 2; ++h) {
          ExpertWeight w = big.view(WeightFormat::Fp4);
          w.data = buf[h];
          w.scale = buf[h] + qb;
          const double tc = best_of(3 * reps, true, [&] {
            column_chunks(N, t, [&](int64_t n0, int64_t n1) {
              expert_gemm_rows(Isa::Avx512Bf16, r.ptr.data(), r.is_bf16.data(), m, w, n0, n1, o);
            });
          });
          line(h ? "kernel_fp4_cold_2MiB_pages" : "kernel_fp4_cold_4KiB_pages", t, m, wbytes / tc / 1e9, "GB/s");
        }
      }
    }
    for (uint8_t* b : buf) std::free(b);
    return 0;
  }
  for (int64_t m : {1, 4, 16, 64}) {
    Rows r4(Isa::Avx512Bf16, WeightFormat::Fp4, m, K, N, g);
    Rows r16(Isa::Avx512Bf16, WeightFormat::Bf16, m, K, N, g);
    Rows r32(Isa::Avx512, WeightFormat::Fp4, m, K, N, g);
    Rows r8(Isa::Avx512Bf16, WeightFormat::Fp8, m, K, N, g);
    const int hot_reps = m == 1 ? 200 : (m == 4 ? 60 : (m == 16 ? 20 : 5));
    auto hot_rate = [&](const Expert& e, WeightFormat wf, Rows& r, Isa isa) {
      double best = 1e30;
      for (int rr = 0; rr < reps; ++rr) {
        const double t0 = now();
        for (int i = 0; i < hot_reps; ++i) kernel(isa, e, wf, r, m, 1, 1, false);
        best = std::min(best, (now() - t0) / hot_reps);
      }
      return best;
    };
    // hot, one thread: ns per 32-k unit per weight row (for all m rows) and FLOP/s
    const double units = static_cast<double>(NH) * K / 32;
    const double t_fp4 = hot_rate(hot, WeightFormat::Fp4, r4, Isa::Avx512Bf16);
    const double t_bf16 = hot_rate(hot16, WeightFormat::Bf16, r16, Isa::Avx512Bf16);
    const double t_f32 = hot_rate(hot, WeightFormat::Fp4, r32, Isa::Avx512);
    const double t_fp8 = hot_rate(hot8, WeightFormat::Fp8, r8, Isa::Avx512Bf16);
    line("kernel_fp4_hot_ns_per_unit", 1, m, t_fp4 / units * 1e9, "ns");
    line("kernel_bf16w_hot_ns_per_unit", 1, m, t_bf16 / units * 1e9, "ns");
    line("kernel_fp4_fp32path_hot_ns_per_unit", 1, m, t_f32 / units * 1e9, "ns");
    line("kernel_fp4_hot", 1, m, 2.0 * m * NH * K / t_fp4 / 1e9, "GFLOP/s");
    line("kernel_bf16w_hot", 1, m, 2.0 * m * NH * K / t_bf16 / 1e9, "GFLOP/s");
    line("kernel_fp8_hot", 1, m, 2.0 * m * NH * K / t_fp8 / 1e9, "GFLOP/s");
    for (int t = 1; t <= tmax; ++t) {
      const double tc = kernel(Isa::Avx512Bf16, big, WeightFormat::Fp4, r4, m, t, 3 * reps, true);
      line("kernel_fp4_cold", t, m, wbytes / tc / 1e9, "GB/s");
      line("kernel_fp4_cold_flops", t, m, 2.0 * m * N * K / tc / 1e9, "GFLOP/s");
      const double tb = kernel(Isa::Avx512Bf16, big16, WeightFormat::Bf16, r16, m, t, reps, true);
      line("kernel_bf16w_cold", t, m, big16.q.size() / tb / 1e9, "GB/s");
      if (m == 1) {
        const double t8 = kernel(Isa::Avx512Bf16, big8, WeightFormat::Fp8, r8, m, t, 3 * reps, true);
        line("kernel_fp8_cold", t, m, (big8.q.size() + big8.s.size()) / t8 / 1e9, "GB/s");
      }
    }
  }
  return 0;
}
