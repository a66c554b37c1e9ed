// A/B of two builds of the CPU expert-GEMM kernels in one process: this tree's (namespace static_moe) and another
// revision's, compiled with -Dstatic_moe=static_moe_b and reached through kernel_ab_entry.cpp. The two are timed
// alternately, round after round, on the same weights and rows, so that a shared host's load, which comes and goes
// by ±10-30 % between separate runs, falls on both alike (bench/bench_kernel_ab.py builds and runs it).
//
// Output: one line per (format, rows): "fmt rows GFLOP/s(a) GFLOP/s(b) time(a)/time(b)", each time the best of its
// rounds; time(a)/time(b) < 1: this tree is faster. Bf16 activation rows, on the avx512bf16 path unless isa names
// another (amx, avx512, avx2, scalar).
// Usage: kernel_ab N K threads cold(0|1|2) rounds [isa [weights, e.g. fp4,fp8p2]]
// cold 0: the weights stay in cache between calls; 1: twice the L3 rewritten before every call; 2: a layer's stream,
// the calls cycling through as many distinct experts as fill kStreamBytes, with no flush, so that each call finds
// its weights evicted by the others' reads (clean lines, as in a model's layer) rather than by a flush's dirty
// ones, whose write-backs share the DRAM bus with the call.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernels/expert_gemm.h"
#include "micro_inputs.h"

using namespace static_moe::cpu;

// The other build's expert_gemm_rows (kernel_ab_entry.cpp); ExpertWeight and OutRows have the same layout in both.
extern "C" bool kernel_ab_other(int isa, const float* const* a, const uint8_t* a_bf16, int64_t m, const void* w,
                                int64_t n0, int64_t n1, const void* out);

namespace {

constexpr int64_t kStreamBytes = int64_t{256} << 20;  // cold 2: the experts' bytes together, 8× a 32 MiB L3

// All N columns over t threads (column_chunks), with build a (this tree) or b.
double run(Isa isa, bool b, const ExpertWeight& w, Rows& r, int64_t m, int t) {
  OutRows o;
  o.rows = r.optr.data();
  const double t0 = now();
  column_chunks(w.n, t, [&](int64_t n0, int64_t n1) {
    if (b) {
      kernel_ab_other(static_cast<int>(isa), r.ptr.data(), r.is_bf16.data(), m, &w, n0, n1, &o);
    } else {
      expert_gemm_rows(isa, r.ptr.data(), r.is_bf16.data(), m, w, n0, n1, o);
    }
  });
  return now() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t K = argc > 2 ? std::atoll(argv[2]) : 4096;
  const int t = argc > 3 ? std::atoi(argv[3]) : 1;
  const int cold = argc > 4 ? std::atoi(argv[4]) : 0;  // 0 warm, 1 flushed, 2 streamed (see the usage above)
  const int rounds = argc > 5 ? std::atoi(argv[5]) : 10;
  const std::string name = argc > 6 ? argv[6] : "avx512bf16";
  const std::string only = argc > 7 ? argv[7] : "";  // comma-separated weight names; empty: all
  const Isa isa = name == "amx"      ? Isa::Amx
                  : name == "avx512" ? Isa::Avx512
                  : name == "avx2"   ? Isa::Avx2
                  : name == "scalar" ? Isa::Scalar
                                     : Isa::Avx512Bf16;
  if (static_cast<int>(isa) > static_cast<int>(detected_isa())) {
    std::fprintf(stderr, "kernel_ab: this CPU cannot run %s\n", name.c_str());
    return 2;
  }
  std::mt19937 g(1);
  // fp8: float32 block scales (the fold path); fp8p2: power-of-two ones (the pow2 path)
  const WeightFormat formats[4] = {WeightFormat::Fp4, WeightFormat::Fp8, WeightFormat::Fp8, WeightFormat::Bf16};
  const char* names[4] = {"fp4", "fp8", "fp8p2", "bf16"};
  for (int f = 0; f < 4; ++f) {
    if (!only.empty() && ("," + only + ",").find("," + std::string(names[f]) + ",") == std::string::npos) continue;
    auto make = [&] { return f == 0 ? make_fp4(N, K, g) : (f < 3 ? make_fp8(N, K, g, f == 2) : make_bf16(N, K, g)); };
    std::vector<Expert> experts;
    experts.push_back(make());
    const int64_t bytes = static_cast<int64_t>(experts[0].q.size() + experts[0].s.size());
    if (cold == 2) {
      while (static_cast<int64_t>(experts.size()) * bytes < kStreamBytes) experts.push_back(make());
    }
    std::vector<ExpertWeight> ws;
    for (const Expert& e : experts) ws.push_back(e.view(formats[f]));
    for (int64_t m : {1, 4, 16, 64}) {
      Rows r(isa, formats[f], m, K, N, g);
      const int inner = cold == 2   ? static_cast<int>(ws.size())
                        : cold == 1 ? 1
                                    : static_cast<int>(std::max<int64_t>(1, 4096 / N));
      double best[2] = {1e30, 1e30};
      for (int rr = 0; rr < rounds; ++rr) {
        for (int b = 0; b < 2; ++b) {
          if (cold == 1) flush();
          double s = 0;
          for (int i = 0; i < inner; ++i) s += run(isa, b != 0, ws[i % ws.size()], r, m, t);
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
