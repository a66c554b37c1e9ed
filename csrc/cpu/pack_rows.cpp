// CPU binding of pack_rows / unpack_rows (SPEC §1.8): checks (csrc/checks/pack_rows.h), then the raw-pointer
// kernels of csrc/cpu/kernels/pack_rows.h. Torch types stay in this file.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "checks/pack_rows.h"
#include "cpu/kernels/pack_rows.h"

namespace {

using namespace static_moe;

at::Tensor pack_rows_cpu(at::TensorList parts, int64_t capacity) {
  const checks::PackLayout layout = checks::check_pack_rows(parts, capacity);
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string name = "parts[" + std::to_string(i) + "]";
    checks::check_device_type(parts[i], "pack_rows", name.c_str(), c10::DeviceType::CPU);
  }
  // Row-major byte rows: a part whose rows are not contiguous is copied once (views of bigger tensors are rare).
  std::vector<at::Tensor> keep;
  std::vector<cpu::PackSpan> spans;
  keep.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    keep.push_back(parts[i].contiguous());
    const at::Tensor& p = keep.back();
    const uint8_t* src = layout.rows && layout.nbytes[i] ? static_cast<const uint8_t*>(p.const_data_ptr()) : nullptr;
    spans.push_back({src, layout.nbytes[i], layout.offsets[i], layout.nbytes[i]});
  }
  at::Tensor out = at::empty({capacity, layout.width}, parts[0].options().dtype(at::kByte));
  cpu::pack_rows(spans.data(), static_cast<int64_t>(spans.size()), layout.rows, capacity, layout.width,
                 out.mutable_data_ptr<uint8_t>());
  return out;
}

at::Tensor unpack_rows_cpu(const at::Tensor& packed, int64_t offset, int64_t nbytes, at::ScalarType dtype,
                           at::IntArrayRef row_shape) {
  checks::check_unpack_rows(packed, offset, nbytes, dtype, row_shape);
  checks::check_device_type(packed, "unpack_rows", "packed", c10::DeviceType::CPU);
  std::vector<int64_t> shape{packed.size(0)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  // A fresh tensor, never a view of `packed` (custom ops may not alias their inputs in outputs).
  at::Tensor out = at::empty(shape, packed.options().dtype(dtype));
  if (packed.size(0) == 0 || nbytes == 0) return out;
  // Bytes within a row must be contiguous; rows may be strided (e.g. a slice of the gathered buffer).
  const at::Tensor src = packed.stride(1) == 1 ? packed : packed.contiguous();
  cpu::unpack_rows(static_cast<const uint8_t*>(src.const_data_ptr()), src.size(0), src.stride(0), offset, nbytes,
                   static_cast<uint8_t*>(out.mutable_data_ptr()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(static_moe, CPU, m) {
  m.impl("pack_rows", &pack_rows_cpu);
  m.impl("unpack_rows", &unpack_rows_cpu);
}
