// pack_rows / unpack_rows kernels (csrc/cpu/kernels/pack_rows.h) under AddressSanitizer, torch-free: `make asan`
// builds this driver with -fsanitize=address and runs it (also part of `make test`).
//
// Every buffer is its own heap allocation of exactly the bytes it needs, so a copy one byte too long (or a row
// written past the end) is a heap-buffer-overflow that ASan reports, even where the bytes it clobbers would be
// rewritten later and no value comparison could see it. Cases: random part widths (gaps and no gaps), T < C and
// T = C, parts whose widths are multiples of 16 (no alignment gap at all, the last part's last byte is the
// buffer's last byte), and sizes above the OpenMP threshold (threaded path, run with 2 threads). Each output is
// also compared with a plain byte loop (SPEC §1.8 layout).
#include <omp.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "cpu/kernels/pack_rows.h"

namespace {

using static_moe::cpu::PackSpan;

int failures = 0;

void expect(bool ok, const char* what, int64_t a, int64_t b) {
  if (!ok) {
    std::fprintf(stderr, "FAIL %s (%lld, %lld)\n", what, static_cast<long long>(a), static_cast<long long>(b));
    ++failures;
  }
}

// One case: parts of `widths` bytes per row, `rows` of `capacity` filled.
void run_case(const std::vector<int64_t>& widths, int64_t rows, int64_t capacity, std::mt19937& rng) {
  const size_t n = widths.size();
  std::vector<std::unique_ptr<uint8_t[]>> src(n);
  std::vector<PackSpan> spans(n);
  int64_t width = 0;
  for (size_t i = 0; i < n; ++i) {
    src[i].reset(new uint8_t[static_cast<size_t>(rows * widths[i] + 0)]);  // exact size: no slack for ASan
    for (int64_t j = 0; j < rows * widths[i]; ++j) src[i][j] = static_cast<uint8_t>(rng());
    spans[i] = PackSpan{src[i].get(), widths[i], width, widths[i]};
    width += (widths[i] + 15) / 16 * 16;
  }
  std::unique_ptr<uint8_t[]> out(new uint8_t[static_cast<size_t>(capacity * width)]);
  static_moe::cpu::pack_rows(spans.data(), static_cast<int64_t>(n), rows, capacity, width, out.get());
  for (int64_t r = 0; r < capacity; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      uint8_t want = 0xFF;
      for (size_t i = 0; i < n && r < rows; ++i)
        if (c >= spans[i].offset && c < spans[i].offset + widths[i]) want = src[i][r * widths[i] + c - spans[i].offset];
      expect(out[r * width + c] == want, "pack byte (row, col)", r, c);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    std::unique_ptr<uint8_t[]> back(new uint8_t[static_cast<size_t>(capacity * widths[i]) + 0]);
    static_moe::cpu::unpack_rows(out.get(), capacity, width, spans[i].offset, widths[i], back.get());
    for (int64_t j = 0; j < rows * widths[i]; ++j) expect(back[j] == src[i][j], "unpack byte (part, index)", i, j);
  }
}

}  // namespace

int main() {
  omp_set_num_threads(2);
  std::mt19937 rng(1234);
  // No gaps anywhere, T = C, threaded (C·W = 40 · 2112 >= 64 KiB): the forward's bf16 layout.
  run_case({2048, 64}, 40, 40, rng);
  run_case({1024, 32, 16, 16}, 64, 64, rng);
  // The same with padding rows, and the fp8 layout (scales, ids, weights) with gaps.
  run_case({2048, 64}, 30, 40, rng);
  run_case({4096, 128, 24, 24}, 32, 32, rng);
  // Random small cases: widths 0..40 (gaps of every size), T <= C, serial path.
  for (int t = 0; t < 300; ++t) {
    std::vector<int64_t> widths(1 + rng() % 4);
    for (auto& w : widths) w = rng() % 41;
    const int64_t capacity = rng() % 13;
    run_case(widths, capacity ? rng() % (capacity + 1) : 0, capacity, rng);
  }
  if (failures) {
    std::fprintf(stderr, "pack_rows_asan: %d failures\n", failures);
    return 1;
  }
  std::printf("pack_rows_asan: all cases passed under AddressSanitizer\n");
  return 0;
}
