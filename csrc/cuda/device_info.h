// Per-device facts the launchers size their grids with, read once per device and cached (no CUDA API call per
// launch after the first, which keeps launches cheap and legal inside CUDA-graph capture). Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace static_moe {
namespace cuda {

constexpr int kMaxCachedDevices = 64;

// Multiprocessor count of the current device (0 on error, with the error in *err).
inline int current_sm_count(cudaError_t* err) {
  static std::atomic<int> cache[kMaxCachedDevices];
  int device = 0;
  *err = cudaGetDevice(&device);
  if (*err != cudaSuccess) return 0;
  if (device < kMaxCachedDevices) {
    const int n = cache[device].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int sms = 0;
  *err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (*err != cudaSuccess) return 0;
  if (device < kMaxCachedDevices) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Resident blocks per SM of `kernel` with `threads` threads and `smem` bytes of dynamic shared memory, after
// raising the kernel's dynamic shared-memory limit to `smem`. Cached per (call site's Tag, device): the Tag type
// makes one cache per kernel instantiation.
template <typename Tag, typename Kernel>
inline int blocks_per_sm(Kernel kernel, int threads, int smem, cudaError_t* err) {
  static std::atomic<int> cache[kMaxCachedDevices];
  int device = 0;
  *err = cudaGetDevice(&device);
  if (*err != cudaSuccess) return 0;
  if (device < kMaxCachedDevices) {
    const int n = cache[device].load(std::memory_order_acquire);
    if (n > 0) return n;
  }
  *err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (*err != cudaSuccess) return 0;
  int n = 0;
  *err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  if (*err != cudaSuccess) return 0;
  n = n > 0 ? n : 1;
  if (device < kMaxCachedDevices) cache[device].store(n, std::memory_order_release);
  return n;
}

}  // namespace cuda
}  // namespace static_moe
