// Host launcher of the CUDA expert GEMM (expert_gemm.h): picks the instantiation for the format pair, sizes a
// persistent grid from the device's SM count and the kernel's occupancy, and enqueues it. No sync, no allocation.
#include "cuda/device_info.h"
#include "cuda/expert_gemm.h"
#include "cuda/expert_gemm.cuh"

#include <algorithm>
#include <cstdint>

namespace static_moe {
namespace cuda {

namespace {

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

template <WeightFmt W, int G>
cudaError_t launch_cfg(const ExpertGemmArgs& p, cudaStream_t stream) {
  using C = gemm::Cfg<W, G>;
  const auto kernel = gemm::expert_gemm_kernel<W, G>;
  cudaError_t err = cudaSuccess;
  const int sms = current_sm_count(&err);
  if (err != cudaSuccess) return err;
  const int per_sm = blocks_per_sm<C>(kernel, gemm::kThreads, C::kSmemBytes, &err);
  if (err != cudaSuccess) return err;

  const int64_t n_tiles = (p.n + gemm::kBN - 1) / gemm::kBN;
  int64_t upper;  // most tiles the call can have: the grid never needs more blocks than that
  if (p.row_mask != nullptr) {
    upper = (p.rows + gemm::kBM - 1) / gemm::kBM * n_tiles;
    upper = std::max<int64_t>(upper, 1);  // masked rows are zeroed even when no row is active
    if (p.rows == 0) return cudaSuccess;
  } else {
    upper = p.max_tiles * n_tiles;
  }
  const int64_t grid = std::min<int64_t>(upper, static_cast<int64_t>(sms) * per_sm);
  if (grid <= 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(grid), gemm::kThreads, C::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

const char* expert_gemm_unsupported(const ExpertGemmArgs& p) {
  if (p.k % gemm::kBK != 0) return "K must be a multiple of 128";
  if (p.n % 8 != 0) return "N must be a multiple of 8 (16-byte output rows)";
  if (p.a_group != 0 && p.a_group != 32 && p.a_group != 128) return "the activation group must be 32 or 128";
  const int64_t a_elem = p.a_group != 0 ? 1 : 2;
  if (!aligned(p.a, 16) || (p.a_row_stride * a_elem) % 16 != 0)
    return "a must start on a 16-byte boundary with rows a multiple of 16 bytes apart";
  if (p.a_group != 0 && !aligned(p.a_scale, 4)) return "a_scale must be 4-byte aligned";
  if (!aligned(p.b, 16) || p.b_expert_stride % 16 != 0 || p.b_row_stride % 16 != 0)
    return "b must start on a 16-byte boundary with experts and rows a multiple of 16 bytes apart";
  if (p.b_fmt == WeightFmt::kFp8 && !aligned(p.b_scale, 4)) return "b_scale must be 4-byte aligned";
  if (p.b_fmt == WeightFmt::kFp4 &&
      (!aligned(p.b_scale, 4) || p.b_scale_expert_stride % 4 != 0 || p.b_scale_row_stride % 4 != 0))
    return "fp4 b_scale must start on a 4-byte boundary with experts and rows a multiple of 4 bytes apart";
  if (!aligned(p.d, 16) || (p.d_row_stride * 2) % 16 != 0)
    return "the output must start on a 16-byte boundary with rows a multiple of 16 bytes apart";
  if (p.row_mask != nullptr && p.rows >= (int64_t{1} << 31)) return "at most 2^31 - 1 rows";
  if (p.b_fmt == WeightFmt::kBf16 && p.a_group != 0) return "fp8 activations need fp8 or fp4 weights";
  return nullptr;
}

cudaError_t launch_expert_gemm(const ExpertGemmArgs& p, cudaStream_t stream) {
  if (expert_gemm_unsupported(p) != nullptr) return cudaErrorInvalidValue;
  switch (p.b_fmt) {
    case WeightFmt::kBf16:
      return launch_cfg<WeightFmt::kBf16, 0>(p, stream);
    case WeightFmt::kFp8:
      if (p.a_group == 32) return launch_cfg<WeightFmt::kFp8, 32>(p, stream);
      if (p.a_group == 128) return launch_cfg<WeightFmt::kFp8, 128>(p, stream);
      return launch_cfg<WeightFmt::kFp8, 0>(p, stream);
    case WeightFmt::kFp4:
      if (p.a_group == 32) return launch_cfg<WeightFmt::kFp4, 32>(p, stream);
      if (p.a_group == 128) return launch_cfg<WeightFmt::kFp4, 128>(p, stream);
      return launch_cfg<WeightFmt::kFp4, 0>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace static_moe
