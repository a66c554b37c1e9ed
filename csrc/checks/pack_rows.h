// Argument checks of pack_rows / unpack_rows (SPEC §1.8, §4, §5), over tensor metadata only: shared by the CPU and
// CUDA bindings and by the Python fake kernels (through static_moe._C.check_pack_rows / check_unpack_rows).
#pragma once

#include "checks/common.h"

#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace static_moe {
namespace checks {

constexpr int64_t kPackAlign = 16;  // every part starts at a 16-byte aligned column

// Where each part sits in a packed row, and the row width W.
struct PackLayout {
  int64_t rows = 0;              // T, the rows every part has
  int64_t width = 0;             // W = sum of the 16-byte aligned part widths
  std::vector<int64_t> offsets;  // first column of part i
  std::vector<int64_t> nbytes;   // bytes of one row of part i = prod(shape[1:]) * itemsize
};

inline int64_t pack_aligned(int64_t n) { return (n + kPackAlign - 1) / kPackAlign * kPackAlign; }

// pack_rows(Tensor[] parts, int capacity): parts [T, ...] of any dtype, all with the same T and on one device,
// T <= capacity. Returns the layout of the uint8 [capacity, W] result.
inline PackLayout check_pack_rows(at::TensorList parts, int64_t capacity) {
  const char* op = "pack_rows";
  TORCH_CHECK_VALUE(!parts.empty(), op, ": parts must hold at least one tensor [T, ...], got an empty list");
  TORCH_CHECK_VALUE(capacity >= 0, op, ": capacity must be >= 0, got ", capacity);
  PackLayout layout;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    const std::string name = "parts[" + std::to_string(i) + "]";
    check_defined(p, op, name.c_str());
    TORCH_CHECK_VALUE(p.dim() >= 1, op, ": ", name, " must be at least 1-D [T, ...], got a 0-D tensor");
    if (i == 0) {
      layout.rows = p.size(0);
    } else {
      TORCH_CHECK_VALUE(p.size(0) == layout.rows, op, ": every part must have the same number of rows T; ", name,
                        ".size(0) must be T = parts[0].size(0) = ", layout.rows, ", got ", p.size(0), " (shape ",
                        shape_str(p.sizes()), ")");
      check_same_device(p, op, name.c_str(), parts[0], "parts[0]");
    }
    // Sizes come from real tensors, but a view's sizes can still multiply past int64: check every step.
    int64_t n = static_cast<int64_t>(p.element_size());
    for (int64_t d = 1; d < p.dim(); ++d) n = checked_mul(n, p.size(d), op, (name + " row bytes").c_str());
    layout.offsets.push_back(layout.width);
    layout.nbytes.push_back(n);
    layout.width = checked_add(
        layout.width, checked_add(n, kPackAlign - 1, op, "row width W") / kPackAlign * kPackAlign, op, "row width W");
  }
  checked_mul(capacity, layout.width, op, "capacity * W (bytes of the packed buffer)");
  TORCH_CHECK_VALUE(layout.rows <= capacity, op, ": T = ", layout.rows,
                    " rows (parts[0].size(0)) exceed capacity = ", capacity, "; T must be <= capacity");
  return layout;
}

// unpack_rows(Tensor packed, int offset, int nbytes, ScalarType dtype, int[] row_shape): packed uint8 [R, W]; the
// span [offset, offset + nbytes) lies inside W; nbytes = prod(row_shape) * itemsize(dtype).
inline void check_unpack_rows(const at::Tensor& packed, int64_t offset, int64_t nbytes, c10::ScalarType dtype,
                              c10::IntArrayRef row_shape) {
  const char* op = "unpack_rows";
  check_defined(packed, op, "packed");
  check_dtype(packed, op, "packed", c10::ScalarType::Byte);
  check_dim(packed, op, "packed", 2, "[R, W]");
  const int64_t width = packed.size(1);
  // Written so that nothing can overflow: offset + nbytes is never formed (offset = 2^63 - 8, nbytes = 16 would
  // wrap to a negative end and pass a naive `offset + nbytes <= width`).
  if (!(offset >= 0 && nbytes >= 0 && offset <= width && nbytes <= width - offset)) {
    int64_t end = 0;
    const bool wraps = __builtin_add_overflow(offset, nbytes, &end);
    TORCH_CHECK_VALUE(false, op, ": the span [offset, offset + nbytes) = [", offset, ", ",
                      (wraps ? std::string("(overflows int64)") : std::to_string(end)),
                      ") must lie inside the packed row width W = packed.size(1) = ", width, " (offset = ", offset,
                      ", nbytes = ", nbytes, ")");
  }
  // Raw bytes cannot hold these: a packed 0xFF byte is no bool, and a quantized tensor's scale is not in its bytes.
  TORCH_CHECK_TYPE(dtype != c10::ScalarType::Bool && !c10::isQIntType(dtype), op, ": dtype ", dtype_name(dtype),
                   " cannot be unpacked from raw bytes (bool and quantized dtypes are refused): unpack uint8 and "
                   "convert");
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t elems = 1;
  bool overflow = false;
  for (size_t d = 0; d < row_shape.size(); ++d) {
    TORCH_CHECK_VALUE(row_shape[d] >= 0, op, ": row_shape must be non-negative, got ", shape_str(row_shape));
    overflow = overflow || __builtin_mul_overflow(elems, row_shape[d], &elems);
  }
  int64_t row_bytes = 0;
  overflow = overflow || __builtin_mul_overflow(elems, itemsize, &row_bytes);
  TORCH_CHECK_VALUE(!overflow && row_bytes == nbytes, op, ": nbytes must equal prod(row_shape) * itemsize = prod(",
                    shape_str(row_shape), ") * ", itemsize, " = ",
                    (overflow ? std::string("(overflows int64)") : std::to_string(row_bytes)), " for ",
                    dtype_name(dtype), ", got ", nbytes);
}

}  // namespace checks
}  // namespace static_moe
