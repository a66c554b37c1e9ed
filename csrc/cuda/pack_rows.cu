// CUDA pack_rows / unpack_rows (SPEC §1.8): byte copies. pack_rows gives each thread one 16-byte piece of the
// output, so every output byte is written exactly once with 16-byte stores; a piece inside one part's data with a
// 16-byte aligned source is one 16-byte load, the rest (part tails, unaligned sources) are assembled byte by byte.
// The part spans tile [0, W) in 16-byte aligned steps, so a piece never straddles two parts.
#include "cuda/device_info.h"
#include "cuda/pack_rows.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace static_moe {
namespace cuda {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) pack_rows_kernel(const PackArgs a) {
  const int64_t pieces_per_row = a.width / 16;
  const int64_t total = a.capacity * pieces_per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = idx / pieces_per_row;
    const int64_t col = (idx % pieces_per_row) * 16;
    uint4 v = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu);
    if (row < a.rows) {
      int i = 0;
      while (i + 1 < a.num_parts && a.parts[i + 1].offset <= col) ++i;  // last part starting at or before col
      const PackPart& p = a.parts[i];
      const int64_t rel = col - p.offset;
      const int64_t avail = p.nbytes - rel;  // data bytes of this part from col on (<= 0: padding only)
      const uint8_t* src = p.src + row * p.row_stride + rel;
      if (avail >= 16 && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
        v = *reinterpret_cast<const uint4*>(src);
      } else if (avail > 0) {
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t word = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int64_t k = 4 * q + b;
            const uint32_t byte = k < avail ? src[k] : 0xFFu;
            word |= byte << (8 * b);
          }
          w[q] = word;
        }
        v = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    *reinterpret_cast<uint4*>(a.out + row * a.width + col) = v;
  }
}

// V bytes per thread (16, 4 or 1), all addresses V-aligned.
template <int V>
__global__ void __launch_bounds__(kThreads) unpack_rows_kernel(const uint8_t* packed, int64_t rows, int64_t row_stride,
                                                               int64_t offset, int64_t nbytes, uint8_t* out) {
  using T = typename std::conditional<V == 16, uint4, typename std::conditional<V == 4, uint32_t, uint8_t>::type>::type;
  const int64_t per_row = nbytes / V;
  const int64_t total = rows * per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = idx / per_row, c = idx % per_row;
    reinterpret_cast<T*>(out + r * nbytes)[c] = reinterpret_cast<const T*>(packed + r * row_stride + offset)[c];
  }
}

int64_t grid_for(int64_t items) {
  cudaError_t err = cudaSuccess;
  int sms = current_sm_count(&err);
  if (err != cudaSuccess || sms <= 0) sms = 16;
  return std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t{8} * sms);
}

bool aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

}  // namespace

cudaError_t launch_pack_rows(const PackArgs& a, cudaStream_t stream) {
  if (a.num_parts < 1 || a.num_parts > kMaxPackParts || a.width % 16 != 0 || !aligned(a.out, 16))
    return cudaErrorInvalidValue;
  const int64_t blocks = grid_for(a.capacity * (a.width / 16));
  if (blocks <= 0) return cudaSuccess;
  pack_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_unpack_rows(const uint8_t* packed, int64_t rows, int64_t row_stride, int64_t offset, int64_t nbytes,
                               uint8_t* out, cudaStream_t stream) {
  if (rows == 0 || nbytes == 0) return cudaSuccess;
  const auto fits = [&](int v) {
    return aligned(packed + offset, v) && row_stride % v == 0 && nbytes % v == 0 && aligned(out, v);
  };
  if (fits(16)) {
    const int64_t blocks = grid_for(rows * nbytes / 16);
    unpack_rows_kernel<16>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(packed, rows, row_stride, offset, nbytes, out);
  } else if (fits(4)) {
    const int64_t blocks = grid_for(rows * nbytes / 4);
    unpack_rows_kernel<4>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(packed, rows, row_stride, offset, nbytes, out);
  } else {
    const int64_t blocks = grid_for(rows * nbytes);
    unpack_rows_kernel<1>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(packed, rows, row_stride, offset, nbytes, out);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace static_moe
