// A/B of two builds of the CPU expert-GEMM kernels in one process: this tree's (namespace static_moe) and another
// revision's, compiled with -Dstatic_moe=static_moe_b and reached through kernel_ab_entry.cpp. The two are timed
// alternately, round after round, on the same weights and rows, so that a shared host's load, which comes and goes
// by ±10-30 % between separate runs, falls on both alike (bench/bench_kernel_ab.py builds and runs it).
//
// Output: one line per (format, rows): "fmt rows GFLOP/s(a) GFLOP/s(b) time(a)/time(b)", each time the best of its
// rounds; time(a)/time(b) < 1: this tree is faster. Avx512Bf16 path, bf16 activation rows.
// Usage: kernel_ab N K threads cold(0|1) rounds
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/kernels/moe_gemm.h"

using namespace static_moe::cpu;

// The other build's expert_gemm_rows (kernel_ab_entry.cpp); ExpertWeight and OutRows have the same layout in both.
extern "C" bool kernel_ab_other(int isa, const float* const* a, const uint8_t* a_bf16, int64_t m, const void* w,
                                int64_t n0, int64_t n1, const void* out);

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::vector<uint8_t> g_flush(128u << 20);  // 4× a 32 MiB last-level cache
void flush() {
  for (size_t i = 0; i < g_flush.size(); i += 64) g_flush[i] += 1;
}

// One expert's weights in format f with typical scales: fp4 UE8M0 bytes 2^-9..2^-2; fp8 float32 scales that are not
// powers of two (a DeepSeek-V3 checkpoint's kind); bf16 values around 1.
struct Weights {
  std::vector<uint8_t> q, s;
  ExpertWeight w;
  Weights(WeightFormat f, int64_t n, int64_t k, std::mt19937& g) {
    w.format = f;
    w.n = n;
    w.k = k;
    if (f == WeightFormat::Fp4) {
      q.resize(n * k / 2);
      s.resize(n * k / 32);
      for (auto& b : q) b = static_cast<uint8_t>(g());
      for (auto& b : s) b = static_cast<uint8_t>(118 + g() % 8);
      w.row_stride = k / 2;
      w.scale_row_stride = k / 32;
    } else if (f == WeightFormat::Fp8) {
      q.resize(n * k);
      s.resize(n * k / 128 * 4);
      for (auto& b : q) b = static_cast<uint8_t>(g() % 0x7F) | (g() & 0x80);  // no NaN codes
      float* sf = reinterpret_cast<float*>(s.data());
      for (int64_t i = 0; i < n * k / 128; ++i) sf[i] = 0.001f * (1 + g() % 100);
      w.row_stride = k;
      w.scale_row_stride = k / 128;
    } else {
      q.resize(n * k * 2);
      uint16_t* p = reinterpret_cast<uint16_t*>(q.data());
      for (int64_t i = 0; i < n * k; ++i) p[i] = static_cast<uint16_t>(0x3C00 + g() % 0x800) | (g() & 0x8000);
      w.row_stride = 2 * k;
    }
    w.data = q.data();
    w.scale = s.empty() ? nullptr : s.data();
  }
};

// m bf16 activation rows prepared for format f, and their outputs.
struct Rows {
  PreparedRows buf;
  std::vector<const float*> ptr;
  std::vector<uint8_t> is_bf16;
  std::vector<std::vector<uint16_t>> out;
  std::vector<void*> optr;
  Rows(WeightFormat f, int64_t m, int64_t k, int64_t n, std::mt19937& g)
      : buf(m, k), ptr(m), is_bf16(m), out(m, std::vector<uint16_t>(n)), optr(m) {
    std::vector<uint16_t> x(k);
    for (int64_t i = 0; i < m; ++i) {
      for (auto& v : x) v = static_cast<uint16_t>(0x3E00 + g() % 0x300) | (g() & 0x8000);
      is_bf16[i] = prepare_activation(Isa::Avx512Bf16, f, ActFormat::Bf16, x.data(), nullptr, 32, 0, k, buf.row(i));
      ptr[i] = buf.row(i);
      optr[i] = out[i].data();
    }
  }
};

// All N columns in 512-column chunks over t threads (as csrc/cpu/expert_gemm.cpp), with build a (this tree) or b.
double run(bool b, const Weights& e, Rows& r, int64_t m, int t) {
  OutRows o;
  o.rows = r.optr.data();
  const int64_t n = e.w.n, chunks = (n + 511) / 512;
  const double t0 = now();
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * 512, n1 = std::min(n, n0 + 512);
    if (b) {
      kernel_ab_other(static_cast<int>(Isa::Avx512Bf16), r.ptr.data(), r.is_bf16.data(), m, &e.w, n0, n1, &o);
    } else {
      expert_gemm_rows(Isa::Avx512Bf16, r.ptr.data(), r.is_bf16.data(), m, e.w, n0, n1, o);
    }
  }
  return now() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t K = argc > 2 ? std::atoll(argv[2]) : 4096;
  const int t = argc > 3 ? std::atoi(argv[3]) : 1;
  const bool cold = argc > 4 && std::atoi(argv[4]) != 0;
  const int rounds = argc > 5 ? std::atoi(argv[5]) : 10;
  std::mt19937 g(1);
  const WeightFormat formats[3] = {WeightFormat::Fp4, WeightFormat::Fp8, WeightFormat::Bf16};
  const char* names[3] = {"fp4", "fp8", "bf16"};
  for (int f = 0; f < 3; ++f) {
    const Weights e(formats[f], N, K, g);
    for (int64_t m : {1, 4, 16, 64}) {
      Rows r(formats[f], m, K, N, g);
      const int inner = cold ? 1 : static_cast<int>(std::max<int64_t>(1, 4096 / N));
      double best[2] = {1e30, 1e30};
      for (int rr = 0; rr < rounds; ++rr) {
        for (int b = 0; b < 2; ++b) {
          if (cold) flush();
          double s = 0;
          for (int i = 0; i < inner; ++i) s += run(b != 0, e, r, m, t);
          best[b] = std::min(best[b], s / inner);
        }
      }
      const double gf = 2.0 * m * N * K / 1e9;
      std::printf("%s %lld %.1f %.1f %.3f\n", names[f], static_cast<long long>(m), gf / best[0], gf / best[1],
                  best[0] / best[1]);
      std::fflush(stdout);
    }
  }
  return 0;
}
