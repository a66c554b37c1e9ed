// Tensor-core and async-copy primitives for the CUDA GEMMs (sm_80+; the e4m3 MMA needs sm_89+), torch-free.
//
// Fragment layouts (PTX ISA, warp-level mma.sync, row.col; g = lane / 4, t = lane % 4):
//   m16n8k16 bf16: A regs {(g, 2t..2t+1), (g+8, 2t..2t+1), (g, 2t+8..2t+9), (g+8, 2t+8..2t+9)} as (row, k);
//                  B regs {(k 2t..2t+1, n g), (k 2t+8..2t+9, n g)}; lower half = lower k.
//   m16n8k32 e4m3: A regs {(g, 4t..4t+3), (g+8, 4t..4t+3), (g, 4t+16..4t+19), (g+8, 4t+16..4t+19)};
//                  B regs {(k 4t..4t+3, n g), (k 4t+16..4t+19, n g)}; byte 0 = lowest k.
//   C/D (both):    {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)} as (row, col), fp32.
// tests/cuda/host/ emulates exactly these layouts on the CPU.
#pragma once

#include <cstdint>
#include <cstring>

namespace static_moe {
namespace cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define STATIC_MOE_HAS_FP8_MMA 1
#else
#define STATIC_MOE_HAS_FP8_MMA 0
#endif

// ---------------------------------------------------------------------------------------------------------------
// cp.async (global -> shared, asynchronous; sm_80+). On the host (the CPU emulation in tests/cuda/host/) the same
// calls are plain copies, so the stage loaders are shared code.
// ---------------------------------------------------------------------------------------------------------------

// 16 bytes, L2 only (streamed operands). valid = false writes 16 zero bytes and reads nothing; src must still be
// a mapped address (callers pass the tensor's base pointer).
__host__ __device__ inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
#ifdef __CUDA_ARCH__
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes) : "memory");
#else
  if (valid)
    std::memcpy(smem_dst, gmem_src, 16);
  else
    std::memset(smem_dst, 0, 16);
#endif
}

// 4 bytes (scales). valid = false writes zeros.
__host__ __device__ inline void cp_async_4(void* smem_dst, const void* gmem_src, bool valid) {
#ifdef __CUDA_ARCH__
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes) : "memory");
#else
  if (valid)
    std::memcpy(smem_dst, gmem_src, 4);
  else
    std::memset(smem_dst, 0, 4);
#endif
}

__device__ inline void cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ inline void cp_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// mma.sync
// ---------------------------------------------------------------------------------------------------------------

// d += a * b, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef __CUDA_ARCH__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// d += a * b, m16n8k32, e4m3 inputs, fp32 accumulators (sm_89+; elsewhere this is never called: the kernels
// choose the bf16 path at compile time, and a call would trap).
__device__ inline void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if STATIC_MOE_HAS_FP8_MMA
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
  (void)d;
  (void)a;
  (void)b;
  __trap();
#endif
}

}  // namespace cuda
}  // namespace static_moe
