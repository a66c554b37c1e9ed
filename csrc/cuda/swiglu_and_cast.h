// Host entry of the CUDA swiglu_and_cast (SPEC §1.4-1.5), torch-free. Also the middle stage of local_experts, which
// passes a device row count (rows_dev) so that only the routed pairs are processed, without a host sync.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace static_moe {
namespace cuda {

struct SwigluArgs {
  const void* gate_up = nullptr;  // [rows, 2I] bf16 or float32, unit column stride
  bool gate_up_bf16 = true;
  int64_t gate_up_row_stride = 0;  // elements
  int64_t rows = 0;
  int64_t inter = 0;                 // I
  const int* rows_dev = nullptr;     // optional device scalar: process rows [0, min(*rows_dev, rows)) only
  const void* row_weight = nullptr;  // [rows] float32 or bf16, or nullptr (weight 1)
  bool row_weight_bf16 = false;
  bool has_limit = false;
  float limit = 0.0f;
  int act = 0;           // SPEC §1.9 activation (Act in swiglu_and_cast.cuh)
  float alpha = 1.702f;  // swiglu_oai
  bool out_fp8 = true;
  int group = 128;  // 32 or 128 (fp8 out)
  float fp8_max = 448.0f;
  bool pow2_scale = true;
  void* out = nullptr;           // [rows, I] e4m3fn or bf16
  int64_t out_row_stride = 0;    // elements
  float* scale = nullptr;        // [rows, I/group] (fp8 out)
  int64_t scale_row_stride = 0;  // elements
};

// Enqueues the kernel on `stream`; no host synchronization, no allocation.
cudaError_t launch_swiglu_and_cast(const SwigluArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace static_moe
