// One-row bf16 GEMV with the weights in vLLM's CPU panel layout against static_moe's kernel on its [N, K] rows
// (bench/bench_panel_gemv.py builds and runs it). The question (docs/vllm.md): does the layout vLLM's "vec" kernel
// streams (cpu_prepack_moe_weight: [N/16, K, 16] panels, one contiguous run of 32·K bytes per 16 output columns)
// read the weights faster at one activation row than static_moe's blocks of 4 weight rows (4 streams of 2·K bytes)?
//
//   read      a read-only stream of the same bytes (vector loads, 4 fp32 sums): the bandwidth roof
//   kernel    static_moe's expert_gemm_rows, Isa::Avx512Bf16, one row, bf16 weights [N, K]
//   panelP    the panel layout [N/16, K/2, 16, 2] (k pairs adjacent, what vdpbf16ps multiplies), P panels (16·P output
//             columns, P streams) at a time, each with two accumulators (even and odd k pairs), no software prefetch
//             (vLLM's micro-kernel has none): panel1, panel2 (vLLM's 32-column tile at one row), panel4
//   rows4     static_moe's own one-row arithmetic with its weights stored in blocks of 4 rows interleaved by 32-k unit
//             ([N/4, K/32, 4, 32]: the block's reads one contiguous stream), checked bitwise against the kernel
// Every measurement is cold (twice the last-level cache rewritten before each run), one thread, the best of `reps`
// rounds in which the contenders alternate. The panel kernels' outputs are checked against the kernel's (relative
// 1e-2: they sum in another order). Output: "name N K value unit" lines. Usage: panel_gemv N K [reps=9]
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/kernels/cast.h"
#include "cpu/kernels/expert_gemm.h"
#include "micro_inputs.h"

namespace {

// [N, K] bf16 → [N/16, K/2, 16, 2]: P[p][j][c][t] = W[16p + c][2j + t].
std::vector<uint16_t> to_panels(const uint16_t* w, int64_t n, int64_t k) {
  std::vector<uint16_t> p(n * k);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k / 2; ++j)
      for (int t = 0; t < 2; ++t) p[((r / 16) * (k / 2) + j) * 32 + (r % 16) * 2 + t] = w[r * k + 2 * j + t];
  return p;
}

// [N, K] bf16 → [N/4, K/32, 4, 32]: the 4 weight rows of a block of static_moe's one-row kernel, unit (32 k) by
// unit, so the block's reads are one contiguous stream: Q[b][u][j][l] = W[4b + j][32u + l].
std::vector<uint16_t> to_row_blocks(const uint16_t* w, int64_t n, int64_t k) {
  std::vector<uint16_t> q(n * k);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) q[(((r / 4) * (k / 32) + c / 32) * 4 + r % 4) * 32 + c % 32] = w[r * k + c];
  return q;
}

// static_moe's one-row bf16 arithmetic (one 16-lane accumulator per output through K in order, vdpbf16ps per 32-k
// unit, _mm512_reduce_add_ps, round to bf16) over the row-block layout: the kernel's bits, one stream.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void row_block_gemv(const uint16_t* q, const uint16_t* a,
                                                                           int64_t n, int64_t k, float* out) {
  for (int64_t b = 0; b < n / 4; ++b) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const uint16_t* blk = q + b * k * 4;
    for (int64_t u = 0; u < k / 32; ++u) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a + 32 * u);
      for (int j = 0; j < 4; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)_mm512_loadu_si512(blk + (u * 4 + j) * 32));
    }
    for (int j = 0; j < 4; ++j) out[4 * b + j] = _mm512_reduce_add_ps(acc[j]);
  }
}

__attribute__((target("avx512f"))) float read_stream(const uint8_t* q, size_t bytes) {
  __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (size_t i = 0; i + 256 <= bytes; i += 256)
    for (int j = 0; j < 4; ++j)
      s[j] = _mm512_add_ps(s[j], _mm512_loadu_ps(reinterpret_cast<const float*>(q + i) + 16 * j));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])));
}

// x: K bf16 values; out: N floats.
template <int P>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void panel_gemv(const uint16_t* panels, const uint16_t* x,
                                                                       int64_t n, int64_t k, float* out) {
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // k pairs
  for (int64_t p0 = 0; p0 < n / 16; p0 += P) {
    __m512 acc[P][2];
    const uint16_t* base[P];
    for (int j = 0; j < P; ++j) {
      acc[j][0] = acc[j][1] = _mm512_setzero_ps();
      base[j] = panels + (p0 + j) * k * 16;
    }
    for (int64_t j2 = 0; j2 < k / 2; j2 += 2) {
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(xp[j2]);
      const __m512bh x1 = (__m512bh)_mm512_set1_epi32(xp[j2 + 1]);
      for (int j = 0; j < P; ++j) {
        acc[j][0] = _mm512_dpbf16_ps(acc[j][0], x0, (__m512bh)_mm512_loadu_si512(base[j] + j2 * 32));
        acc[j][1] = _mm512_dpbf16_ps(acc[j][1], x1, (__m512bh)_mm512_loadu_si512(base[j] + j2 * 32 + 32));
      }
    }
    for (int j = 0; j < P; ++j) _mm512_storeu_ps(out + (p0 + j) * 16, _mm512_add_ps(acc[j][0], acc[j][1]));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int64_t K = argc > 2 ? std::atoll(argv[2]) : 768;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 9;
  if (N % 64 || K % 128) {
    std::fprintf(stderr, "panel_gemv: N must be a multiple of 64 and K of 128\n");
    return 2;
  }
  std::mt19937 g(1);
  const Expert e = make_bf16(N, K, g);
  const ExpertWeight w = e.view(WeightFormat::Bf16);
  const std::vector<uint16_t> panels = to_panels(reinterpret_cast<const uint16_t*>(e.q.data()), N, K);
  const std::vector<uint16_t> blocks = to_row_blocks(reinterpret_cast<const uint16_t*>(e.q.data()), N, K);
  Rows r(Isa::Avx512Bf16, WeightFormat::Bf16, 1, K, N, g);
  // bf16 weights take the activation row as bf16 values packed in the prepared row (is_bf16): the panels read it
  // too.
  if (!r.is_bf16[0]) {
    std::fprintf(stderr, "panel_gemv: expected the bf16-packed activation row of bf16 weights\n");
    return 2;
  }
  const uint16_t* x = reinterpret_cast<const uint16_t*>(r.ptr[0]);
  OutRows o;
  o.rows = r.optr.data();
  std::vector<float> out1(N), out2(N), out4(N), outb(N);
  const size_t bytes = e.q.size();
  volatile float sink = 0;
  const char* names[] = {"read", "kernel", "panel1", "panel2", "panel4", "rows4"};
  double best[6] = {1e30, 1e30, 1e30, 1e30, 1e30, 1e30};
  for (int round = 0; round < reps; ++round) {
    for (int c = 0; c < 6; ++c) {
      flush();
      const double t0 = now();
      switch (c) {
        case 0:
          sink = sink + read_stream(e.q.data(), bytes);
          break;
        case 1:
          expert_gemm_rows(Isa::Avx512Bf16, r.ptr.data(), r.is_bf16.data(), 1, w, 0, N, o);
          break;
        case 2:
          panel_gemv<1>(panels.data(), x, N, K, out1.data());
          break;
        case 3:
          panel_gemv<2>(panels.data(), x, N, K, out2.data());
          break;
        case 4:
          panel_gemv<4>(panels.data(), x, N, K, out4.data());
          break;
        case 5:
          row_block_gemv(blocks.data(), x, N, K, outb.data());
          break;
      }
      best[c] = std::min(best[c], now() - t0);
    }
  }
  // The panels compute the kernel's products in another order: equal to bf16 rounding.
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < N; ++i) scale = std::max(scale, std::fabs(double(bf16_to_float(r.out[0][i]))));
  for (const auto* v : {&out1, &out2, &out4})
    for (int64_t i = 0; i < N; ++i)
      worst = std::max(worst, std::fabs(double((*v)[i]) - bf16_to_float(r.out[0][i])) / scale);
  if (!(worst < 1e-2)) {
    std::fprintf(stderr, "panel_gemv: the panel results differ from the kernel's by %.3g (relative)\n", worst);
    return 1;
  }
  // The row blocks run the kernel's arithmetic: its bits (rounded to bf16 by the kernel's own float_to_bf16).
  for (int64_t i = 0; i < N; ++i) {
    if (float_to_bf16(outb[i]) != r.out[0][i]) {
      std::fprintf(stderr, "panel_gemv: the row-block GEMV differs from the kernel at output %lld\n", (long long)i);
      return 1;
    }
  }
  for (int c = 0; c < 6; ++c)
    std::printf("%s %lld %lld %.2f GB/s\n", names[c], (long long)N, (long long)K, bytes / best[c] / 1e9);
  return 0;
}
