// How expert_gemm splits a GEMM's N weight rows (its output columns) into chunks for its threads; header-only and
// torch-free, so that the micro-benchmarks (bench/micro) split them the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace static_moe {
namespace cpu {

// Columns are handed out in chunks, first come first served, so a thread that streams faster does more of them.
// Chunks start at 512 columns (fewer chunk starts, each a prefetch run-in) and shrink towards 128 as the columns
// left run out, so that the threads finish close together: with chunks of one size, the thread that finished first
// would wait up to a whole chunk at the loop's end.
constexpr int64_t kColumnChunk = 512;
constexpr int64_t kMinColumnChunk = 128;

// Chunk boundaries [0, b1, …, n] for `threads` threads: each chunk half of one thread's share of the columns left,
// rounded down to a multiple of 128 and held to [128, 512]. A column's bits do not depend on where its chunk starts
// (tests/ops/test_expert_gemm.py::test_invariance_across_column_chunkings).
inline std::vector<int64_t> column_chunk_bounds(int64_t n, int threads) {
  std::vector<int64_t> bounds{0};
  while (bounds.back() < n) {
    const int64_t share = (n - bounds.back()) / (2 * threads) / kMinColumnChunk * kMinColumnChunk;
    bounds.push_back(std::min(n, bounds.back() + std::clamp(share, kMinColumnChunk, kColumnChunk)));
  }
  return bounds;
}

}  // namespace cpu
}  // namespace static_moe
