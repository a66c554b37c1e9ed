// pack_rows / unpack_rows CPU kernels (SPEC §1.8): byte copies over raw pointers, torch-free.
// OpenMP over rows; each row is one contiguous destination run, so threads never share a cache line but at the
// row edges.
#pragma once

#include <cstdint>
#include <cstring>

namespace static_moe {
namespace cpu {

constexpr uint8_t kPadByte = 0xFF;               // padded rows and alignment gaps: ids read -1, fp32 reads NaN
constexpr int64_t kCopyParallelBytes = 1 << 16;  // below this, OpenMP start-up costs more than the copy

// One part of a packed row: `nbytes` bytes per row starting at `src + r * src_row_stride`, written to columns
// [offset, offset + nbytes) of the packed row. Parts are given in increasing offset order.
struct PackSpan {
  const uint8_t* src;
  int64_t src_row_stride;  // bytes
  int64_t offset;
  int64_t nbytes;
};

// out uint8 [capacity, width] (row stride `width`). Rows [0, rows) get the parts' bytes with 0xFF in the gaps;
// rows [rows, capacity) are 0xFF throughout.
inline void pack_rows(const PackSpan* spans, int64_t num_spans, int64_t rows, int64_t capacity, int64_t width,
                      uint8_t* out) {
#pragma omp parallel for schedule(static) if (capacity * width >= kCopyParallelBytes)
  for (int64_t r = 0; r < capacity; ++r) {
    uint8_t* dst = out + r * width;
    if (r >= rows) {
      std::memset(dst, kPadByte, static_cast<size_t>(width));
      continue;
    }
    int64_t col = 0;
    for (int64_t i = 0; i < num_spans; ++i) {
      const PackSpan& s = spans[i];
      if (s.offset > col) std::memset(dst + col, kPadByte, static_cast<size_t>(s.offset - col));
      if (s.nbytes) std::memcpy(dst + s.offset, s.src + r * s.src_row_stride, static_cast<size_t>(s.nbytes));
      col = s.offset + s.nbytes;
    }
    if (width > col) std::memset(dst + col, kPadByte, static_cast<size_t>(width - col));
  }
}

// out [rows, nbytes] (contiguous) = packed[:, offset : offset + nbytes], packed rows `packed_row_stride` bytes apart.
inline void unpack_rows(const uint8_t* packed, int64_t rows, int64_t packed_row_stride, int64_t offset, int64_t nbytes,
                        uint8_t* out) {
  if (nbytes == 0) return;
#pragma omp parallel for schedule(static) if (rows * nbytes >= kCopyParallelBytes)
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + r * nbytes, packed + r * packed_row_stride + offset, static_cast<size_t>(nbytes));
}

}  // namespace cpu
}  // namespace static_moe
