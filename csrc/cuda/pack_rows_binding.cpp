// CUDA binding of pack_rows / unpack_rows (SPEC §1.8): shared checks (csrc/checks/pack_rows.h), then the torch-free
// launchers of pack_rows.cu on the current stream. No host sync; the only allocation is the output.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks/pack_rows.h"
#include "cuda/pack_rows.h"

namespace {

using namespace static_moe;

at::Tensor pack_rows_cuda(at::TensorList parts, int64_t capacity) {
  const char* op = "pack_rows";
  const checks::PackLayout layout = checks::check_pack_rows(parts, capacity);
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string name = "parts[" + std::to_string(i) + "]";
    checks::check_device_type(parts[i], op, name.c_str(), c10::DeviceType::CUDA);
  }
  TORCH_CHECK_VALUE(static_cast<int>(parts.size()) <= cuda::kMaxPackParts, op, ": the CUDA kernel packs at most ",
                    cuda::kMaxPackParts, " parts, got ", parts.size());
  const c10::cuda::CUDAGuard guard(parts[0].device());
  at::Tensor out = at::empty({capacity, layout.width}, parts[0].options().dtype(at::kByte));
  if (capacity == 0 || layout.width == 0) return out;
  // Byte rows must be contiguous inside a row; a part that is not is copied once (rare: views of bigger tensors).
  std::vector<at::Tensor> keep;
  keep.reserve(parts.size());
  cuda::PackArgs args;
  args.num_parts = static_cast<int>(parts.size());
  args.rows = layout.rows;
  args.capacity = capacity;
  args.width = layout.width;
  args.out = out.mutable_data_ptr<uint8_t>();
  for (size_t i = 0; i < parts.size(); ++i) {
    keep.push_back(parts[i].contiguous());
    const at::Tensor& p = keep.back();
    args.parts[i].src = p.numel() ? static_cast<const uint8_t*>(p.const_data_ptr()) : nullptr;
    args.parts[i].row_stride = layout.nbytes[i];
    args.parts[i].offset = layout.offsets[i];
    args.parts[i].nbytes = layout.nbytes[i];
  }
  const cudaError_t err = cuda::launch_pack_rows(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor unpack_rows_cuda(const at::Tensor& packed, int64_t offset, int64_t nbytes, at::ScalarType dtype,
                            at::IntArrayRef row_shape) {
  const char* op = "unpack_rows";
  checks::check_unpack_rows(packed, offset, nbytes, dtype, row_shape);
  checks::check_device_type(packed, op, "packed", c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(packed.device());
  std::vector<int64_t> shape{packed.size(0)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  at::Tensor out = at::empty(shape, packed.options().dtype(dtype));  // never a view of `packed`
  if (packed.size(0) == 0 || nbytes == 0) return out;
  const at::Tensor src = packed.stride(1) == 1 ? packed : packed.contiguous();
  const cudaError_t err = cuda::launch_unpack_rows(
      static_cast<const uint8_t*>(src.const_data_ptr()), src.size(0), src.stride(0), offset, nbytes,
      static_cast<uint8_t*>(out.mutable_data_ptr()), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CUDA, m) {
  m.impl("pack_rows", &pack_rows_cuda);
  m.impl("unpack_rows", &unpack_rows_cuda);
}
