// Host entry of the CUDA pack_rows / unpack_rows (SPEC §1.8), torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace static_moe {
namespace cuda {

constexpr int kMaxPackParts = 16;

// One part: T rows of `nbytes` bytes, row r at src + r * row_stride; packed at columns [offset, offset + nbytes)
// (offset a multiple of 16). Bytes of the 16-byte aligned span past nbytes are padding.
struct PackPart {
  const uint8_t* src = nullptr;
  int64_t row_stride = 0;  // bytes
  int64_t offset = 0;
  int64_t nbytes = 0;
};

struct PackArgs {
  PackPart parts[kMaxPackParts];
  int num_parts = 0;
  int64_t rows = 0;        // T
  int64_t capacity = 0;    // C >= T
  int64_t width = 0;       // W, a multiple of 16
  uint8_t* out = nullptr;  // [C, W], 16-byte aligned
};

// out[r, part span] = part row r for r < T; every other byte (alignment gaps, rows T .. C-1) is 0xFF.
cudaError_t launch_pack_rows(const PackArgs& args, cudaStream_t stream);

// out [rows, nbytes] (contiguous) = packed[r, offset : offset + nbytes], rows row_stride bytes apart.
cudaError_t launch_unpack_rows(const uint8_t* packed, int64_t rows, int64_t row_stride, int64_t offset, int64_t nbytes,
                               uint8_t* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace static_moe
