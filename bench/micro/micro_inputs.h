// Inputs shared by the CPU GEMM micro-benchmarks (fp4_gemv.cpp, kernel_ab.cpp): one expert's weights in each
// format with typical scales, prepared bf16 activation rows with their outputs, a clock and a cache flush.
// Header-only and torch-free; each driver gets its own copy (an anonymous namespace).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <unistd.h>

#include "cpu/column_chunks.h"
#include "cpu/kernels/expert_gemm.h"

namespace {

using namespace static_moe::cpu;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Twice the last-level cache, at least 128 MiB (hosts here have had 32 to 480 MiB of L3).
size_t flush_bytes() {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return std::max<size_t>(size_t{128} << 20, llc > 0 ? 2 * static_cast<size_t>(llc) : 0);
}
std::vector<uint8_t> g_flush(flush_bytes());
void flush() {
  for (size_t i = 0; i < g_flush.size(); i += 64) g_flush[i] += 1;
}

// f(n0, n1) for every column chunk of N weight rows (cpu::column_chunk_bounds, as csrc/cpu/expert_gemm.cpp splits
// them), the chunks taken by t OpenMP threads as they go.
template <typename F>
void column_chunks(int64_t n, int t, F&& f) {
  const std::vector<int64_t> b = column_chunk_bounds(n, t);
  const int64_t chunks = static_cast<int64_t>(b.size()) - 1;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) f(b[c], b[c + 1]);
}

struct Expert {
  int64_t n, k;
  std::vector<uint8_t> q;  // fp4 [n, k/2], fp8 [n, k] or bf16 [n, 2k] bytes
  std::vector<uint8_t> s;  // fp4 UE8M0 bytes [n, k/32], fp8 float32 [n, k/128] (bf16: unused)
  ExpertWeight view(WeightFormat f) const {
    ExpertWeight w;
    w.format = f;
    w.n = n;
    w.k = k;
    w.data = q.data();
    w.row_stride = f == WeightFormat::Fp4 ? k / 2 : (f == WeightFormat::Fp8 ? k : 2 * k);
    w.scale = s.data();
    w.scale_row_stride = f == WeightFormat::Fp8 ? k / 128 : k / 32;
    return w;
  }
};

Expert make_fp4(int64_t n, int64_t k, std::mt19937& g) {
  Expert e{n, k, std::vector<uint8_t>(n * k / 2), std::vector<uint8_t>(n * k / 32)};
  for (auto& b : e.q) b = static_cast<uint8_t>(g());
  for (auto& b : e.s) b = static_cast<uint8_t>(118 + g() % 8);  // typical block scales 2^-9..2^-2
  return e;
}

// pow2: power-of-two block scales (2^-13..2^-10, as quantize_weight_fp8 and UE8M0 checkpoints give: the kernels'
// pow2 path); otherwise float32 scales that are not powers of two (the fold path).
Expert make_fp8(int64_t n, int64_t k, std::mt19937& g, bool pow2 = false) {
  Expert e{n, k, std::vector<uint8_t>(n * k), std::vector<uint8_t>(n * k / 128 * 4)};
  for (auto& b : e.q) b = static_cast<uint8_t>(g() % 0x7F) | (g() & 0x80);  // no NaN codes
  float* s = reinterpret_cast<float*>(e.s.data());
  for (int64_t i = 0; i < n * k / 128; ++i)
    s[i] = pow2 ? std::ldexp(1.0f, -10 - static_cast<int>(g() % 4)) : 0.001f * (1 + g() % 100);
  return e;
}

Expert make_bf16(int64_t n, int64_t k, std::mt19937& g) {
  Expert e{n, k, std::vector<uint8_t>(n * k * 2), std::vector<uint8_t>(1)};
  uint16_t* p = reinterpret_cast<uint16_t*>(e.q.data());
  for (int64_t i = 0; i < n * k; ++i) p[i] = static_cast<uint16_t>(0x3C00 + g() % 0x800) | (g() & 0x8000);
  return e;
}

// m activation rows prepared for (isa, fp4 or bf16 weights) from random bf16 values.
struct Rows {
  PreparedRows buf;
  std::vector<const float*> ptr;
  std::vector<uint8_t> is_bf16;
  std::vector<std::vector<uint16_t>> out;
  std::vector<void*> optr;
  Rows(Isa isa, WeightFormat wf, int64_t m, int64_t k, int64_t n, std::mt19937& g)
      : buf(m, k), ptr(m), is_bf16(m), out(m, std::vector<uint16_t>(n)), optr(m) {
    std::vector<uint16_t> x(k);
    for (int64_t i = 0; i < m; ++i) {
      for (auto& v : x) v = static_cast<uint16_t>(0x3E00 + g() % 0x300) | (g() & 0x8000);
      is_bf16[i] = prepare_activation(isa, wf, ActFormat::Bf16, x.data(), nullptr, 32, 0, k, buf.row(i));
      ptr[i] = buf.row(i);
      optr[i] = out[i].data();
    }
  }
};

}  // namespace
