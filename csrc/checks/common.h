// Shared argument checks of the static_moe ops (SPEC §5): small helpers over tensor METADATA (dtype, dim, shape,
// device, divisibility) plus format detection from dtypes (SPEC §1, §4). Each op's `check_<op>(...)` in
// csrc/checks/<op>.h is built from these and included by the CPU and CUDA bindings (and exposed to the Python
// fake kernels), so every op's checks exist once.
//
// Conventions
//   * Every message names the argument, what was expected and what came, e.g.
//       "expert_gemm: b_scale must have shape [L, N, K/128] = [4, 256, 2], got [4, 256, 3]".
//   * Wrong dtype -> c10::TypeError (Python TypeError); everything else (shape, device, divisibility, format pair,
//     values) -> c10::ValueError (Python ValueError).
//   * Helpers here read metadata only, never data, so they work on meta / fake tensors and never sync a device.
//     The one exception is check_ue8m0_values(), which scans bytes of a CPU tensor; call it from eager CPU
//     bindings only (not from check_<op>, which the fake kernels call).
//   * `op` is the op name used as the message prefix ("pack_rows", "expert_gemm", ...).
//
// API stability: other headers build on these names. Add helpers; do not rename or change existing signatures.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace static_moe {
namespace checks {

// ---------------------------------------------------------------------------------------------------------------
// Formatting
// ---------------------------------------------------------------------------------------------------------------

// The Python spelling of a dtype ("torch.float8_e4m3fn"), so messages read like the user's code.
inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return "torch.float32";
    case c10::ScalarType::Double:
      return "torch.float64";
    case c10::ScalarType::Half:
      return "torch.float16";
    case c10::ScalarType::BFloat16:
      return "torch.bfloat16";
    case c10::ScalarType::Float8_e4m3fn:
      return "torch.float8_e4m3fn";
    case c10::ScalarType::Float8_e4m3fnuz:
      return "torch.float8_e4m3fnuz";
    case c10::ScalarType::Float8_e5m2:
      return "torch.float8_e5m2";
    case c10::ScalarType::Float8_e5m2fnuz:
      return "torch.float8_e5m2fnuz";
    case c10::ScalarType::Float8_e8m0fnu:
      return "torch.float8_e8m0fnu";
    case c10::ScalarType::Float4_e2m1fn_x2:
      return "torch.float4_e2m1fn_x2";
    case c10::ScalarType::Byte:
      return "torch.uint8";
    case c10::ScalarType::UInt16:
      return "torch.uint16";
    case c10::ScalarType::UInt32:
      return "torch.uint32";
    case c10::ScalarType::Char:
      return "torch.int8";
    case c10::ScalarType::Short:
      return "torch.int16";
    case c10::ScalarType::Int:
      return "torch.int32";
    case c10::ScalarType::Long:
      return "torch.int64";
    case c10::ScalarType::Bool:
      return "torch.bool";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

// "[4, 256, 2]"
inline std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

// "[4, 256, *]" for an expected shape where -1 means "any size".
inline std::string expected_shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) {
    os << (i ? ", " : "");
    if (s[i] < 0)
      os << '*';
    else
      os << s[i];
  }
  os << ']';
  return os.str();
}

inline std::string dtype_list_str(std::initializer_list<c10::ScalarType> allowed) {
  std::string out;
  size_t i = 0;
  for (auto t : allowed) {
    if (i) out += (i + 1 == allowed.size()) ? " or " : ", ";
    out += dtype_name(t);
    ++i;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Basic checks
// ---------------------------------------------------------------------------------------------------------------

inline void check_defined(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a tensor, got an undefined tensor");
}

inline void check_dtype(const at::Tensor& t, const char* op, const char* name, c10::ScalarType expected) {
  TORCH_CHECK_TYPE(t.scalar_type() == expected, op, ": ", name, " must have dtype ", dtype_name(expected), ", got ",
                   dtype_name(t.scalar_type()));
}

inline void check_dtype_in(const at::Tensor& t, const char* op, const char* name,
                           std::initializer_list<c10::ScalarType> allowed) {
  for (auto a : allowed)
    if (t.scalar_type() == a) return;
  TORCH_CHECK_TYPE(false, op, ": ", name, " must have dtype ", dtype_list_str(allowed), ", got ",
                   dtype_name(t.scalar_type()));
}

inline void check_dim(const at::Tensor& t, const char* op, const char* name, int64_t dim, const char* what = nullptr) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D", (what ? std::string(" ") + what : ""),
                    ", got ", t.dim(), "-D shape ", shape_str(t.sizes()));
}

// Size of one dimension. `what` names it symbolically ("R", "2I", "K/128"), so the message says what to change.
inline void check_size(const at::Tensor& t, const char* op, const char* name, int64_t d, int64_t expected,
                       const char* what) {
  TORCH_CHECK_VALUE(t.size(d) == expected, op, ": ", name, ".size(", d, ") must be ", what, " = ", expected, ", got ",
                    t.size(d), " (shape ", shape_str(t.sizes()), ")");
}

// Whole shape; -1 in `expected` matches any size. `what` is the symbolic shape, e.g. "[L, N, K/128]".
inline void check_shape(const at::Tensor& t, const char* op, const char* name, c10::IntArrayRef expected,
                        const char* what = nullptr) {
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  for (size_t i = 0; ok && i < expected.size(); ++i) ok = expected[i] < 0 || t.size(i) == expected[i];
  TORCH_CHECK_VALUE(ok, op, ": ", name, " must have shape ", (what ? std::string(what) + " = " : ""),
                    expected_shape_str(expected), ", got ", shape_str(t.sizes()));
}

// `value` (named `what`, e.g. "H = x.size(1)") must be a positive multiple of `divisor`... or zero when allowed.
inline void check_divisible(int64_t value, const char* op, const char* what, int64_t divisor, bool allow_zero = true) {
  TORCH_CHECK_VALUE((allow_zero || value != 0) && value % divisor == 0, op, ": ", what, " must be ",
                    (allow_zero ? "a multiple of " : "a positive multiple of "), divisor, ", got ", value);
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", shape_str(t.strides()),
                    " for shape ", shape_str(t.sizes()));
}

// Same device as a reference argument (usually the op's main input).
inline void check_same_device(const at::Tensor& t, const char* op, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on the same device as ", ref_name, " (",
                    ref.device(), "), got ", t.device());
}

// Device type the running backend serves (a CPU kernel gets CPU tensors, a CUDA kernel CUDA ones).
inline void check_device_type(const at::Tensor& t, const char* op, const char* name, c10::DeviceType expected) {
  TORCH_CHECK_VALUE(t.device().type() == expected, op, ": ", name, " must be a ", c10::DeviceTypeName(expected, true),
                    " tensor, got one on ", t.device());
}

// ---------------------------------------------------------------------------------------------------------------
// Scalar settings (SPEC §1.4, §1.5): one rule and one message each, shared by every op (the Python side
// formats.check_swiglu_limit / check_fp8_max spell the same rules and messages)
// ---------------------------------------------------------------------------------------------------------------

// swiglu_limit: None, or a positive number that stays finite and positive once rounded to float32 (the kernels
// clamp in float32: 1e39 would become inf and 1e-50 zero). NaN fails both comparisons.
inline void check_swiglu_limit(std::optional<double> limit, const char* op) {
  if (!limit.has_value()) return;
  const double v = *limit;
  const float f = static_cast<float>(v);  // rounds to nearest; out of range gives inf
  TORCH_CHECK_VALUE(std::isfinite(v) && v > 0 && std::isfinite(f) && f > 0.0f, op,
                    ": swiglu_limit must be None or a positive finite number, got ", v,
                    " (it must stay finite and positive in float32, the kernels' type: at most 3.4028235e+38)");
}

// fp8_max, the range of an fp8 re-quantization with power-of-two scales, in [kFp8MaxMin, 448]. The lower bound
// keeps every scale finite: a finite amax is below 2^128, and the scale amax / fp8_max, rounded UP to a power
// of two, stays <= 2^127 (finite) exactly when amax / fp8_max <= 2^127, i.e. for every finite amax when
// fp8_max >= (2 - 2^-23) (FLT_MAX / 2^127); 2 is that bound rounded to a number a user would write. Above it
// the floor scale 1e-4 / fp8_max stays a normal float for any fp8_max <= 448.
constexpr double kFp8MaxMin = 2.0;
constexpr double kFp8MaxMax = 448.0;

inline void check_fp8_max(double fp8_max, const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(fp8_max) && fp8_max >= kFp8MaxMin && fp8_max <= kFp8MaxMax, op,
                    ": fp8_max must be in [2, 448] (448 for OCP e4m3fn, 240 for trn2 float8_e4m3; below 2 the "
                    "power-of-two scale of a large amax overflows to inf), got ",
                    fp8_max);
}

// a * b and a + b for non-negative sizes, or an error naming `what` instead of a silent int64 wrap-around.
inline int64_t checked_mul(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t r = 0;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(a, b, &r), op, ": ", what, " overflows int64 (", a, " * ", b, ")");
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t r = 0;
  TORCH_CHECK_VALUE(!__builtin_add_overflow(a, b, &r), op, ": ", what, " overflows int64 (", a, " + ", b, ")");
  return r;
}

// ---------------------------------------------------------------------------------------------------------------
// Formats (SPEC §1, §4): named by dtypes
// ---------------------------------------------------------------------------------------------------------------

enum class Format { BF16, FP8, FP4 };

inline const char* format_name(Format f) {
  switch (f) {
    case Format::BF16:
      return "bf16";
    case Format::FP8:
      return "fp8";
    case Format::FP4:
      return "fp4";
  }
  return "?";
}

inline bool is_fp4_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Byte || t == c10::ScalarType::Float4_e2m1fn_x2;
}

// UE8M0 exponent bytes: uint8 or torch.float8_e8m0fnu (viewed as uint8 by the kernels).
inline bool is_ue8m0_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Byte || t == c10::ScalarType::Float8_e8m0fnu;
}

// Weight format from the dtype: bf16, float8_e4m3fn (fp8), uint8 / float4_e2m1fn_x2 (fp4).
inline Format weight_format(const at::Tensor& w, const char* op, const char* name) {
  auto t = w.scalar_type();
  if (t == c10::ScalarType::BFloat16) return Format::BF16;
  if (t == c10::ScalarType::Float8_e4m3fn) return Format::FP8;
  if (is_fp4_dtype(t)) return Format::FP4;
  // uint16 / uint32 are the packed fp4 / fp8 MX dtypes of the prepared layout: say so, since passing a prepared
  // weight without weight_layout='eio' is the likely mistake.
  const bool prepared = t == c10::ScalarType::UInt16 || t == c10::ScalarType::UInt32;
  TORCH_CHECK_TYPE(false, op, ": ", name,
                   " must have a weight dtype: torch.bfloat16 (bf16), torch.float8_e4m3fn (fp8), or torch.uint8 / "
                   "torch.float4_e2m1fn_x2 (fp4), got ",
                   dtype_name(t), prepared ? " (a prepared dtype: pass weight_layout='eio')" : "");
  return Format::BF16;  // unreachable
}

// Activation format from the dtype: bf16 or float8_e4m3fn (fp8).
inline Format activation_format(const at::Tensor& x, const char* op, const char* name) {
  auto t = x.scalar_type();
  if (t == c10::ScalarType::BFloat16) return Format::BF16;
  if (t == c10::ScalarType::Float8_e4m3fn) return Format::FP8;
  TORCH_CHECK_TYPE(false, op, ": ", name,
                   " must have an activation dtype: torch.bfloat16 (bf16) or torch.float8_e4m3fn (fp8), got ",
                   dtype_name(t));
  return Format::BF16;  // unreachable
}

// Supported pairs (SPEC §1.2): bf16 x {bf16, fp8, fp4} and fp8 x {fp8, fp4}.
inline bool format_pair_supported(Format act, Format weight) {
  if (act == Format::BF16) return true;
  return act == Format::FP8 && (weight == Format::FP8 || weight == Format::FP4);
}

inline void check_format_pair(Format act, Format weight, const char* op, const char* act_name,
                              const char* weight_name) {
  TORCH_CHECK_VALUE(format_pair_supported(act, weight), op, ": unsupported format pair: ", act_name, " is ",
                    format_name(act), " and ", weight_name, " is ", format_name(weight),
                    "; supported pairs (activation x weight) are bf16 x {bf16, fp8, fp4} and fp8 x {fp8, fp4}");
}

// Activation scales and group (SPEC §1.1). x is [R, K]; for fp8, x_scale must be float32 [R, K/g] with
// g = K / x_scale.size(1) in {32, 128}; for bf16, x_scale must be absent. Returns g (0 for bf16).
inline int64_t check_activation(const at::Tensor& x, const std::optional<at::Tensor>& x_scale, const char* op,
                                const char* x_name, const char* scale_name) {
  check_defined(x, op, x_name);
  Format f = activation_format(x, op, x_name);
  check_dim(x, op, x_name, 2, "[R, K]");
  if (f == Format::BF16) {
    TORCH_CHECK_VALUE(!x_scale.has_value() || !x_scale->defined(), op, ": ", scale_name, " must be None when ", x_name,
                      " is bf16, got a tensor of shape ", shape_str(x_scale->sizes()));
    return 0;
  }
  TORCH_CHECK_VALUE(x_scale.has_value() && x_scale->defined(), op, ": ", scale_name, " is required when ", x_name,
                    " is fp8 (float32 [R, K/g], g in {32, 128}), got None");
  const at::Tensor& s = *x_scale;
  check_dtype(s, op, scale_name, c10::ScalarType::Float);
  check_dim(s, op, scale_name, 2, "[R, K/g]");
  check_size(s, op, scale_name, 0, x.size(0), (std::string("R = ") + x_name + ".size(0)").c_str());
  const int64_t k = x.size(1), kg = s.size(1);
  TORCH_CHECK_VALUE(kg > 0 && k % kg == 0 && (k / kg == 32 || k / kg == 128), op, ": activation group ", x_name,
                    ".size(1) / ", scale_name, ".size(1) must be 32 or 128, got ", k, " / ", kg,
                    (kg > 0 && k % kg == 0 ? " = " + std::to_string(k / kg) : std::string(" (not an integer)")));
  check_same_device(s, op, scale_name, x, x_name);
  return k / kg;
}

// Expert weights of one format, SPEC §1.2. w is [L, N, K] (bf16, fp8) or [L, N, K/2] (fp4 bytes); K is the
// logical input dim. Scales: none for bf16, float32 [L, N, K/128] for fp8, UE8M0 (uint8 / float8_e8m0fnu)
// [L, N, K/32] for fp4. Pass L, N or K as -1 to accept any value (it is then taken from w). Returns the format.
// Value check for the NaN scale byte 255 is separate: check_ue8m0_values (it reads data).
inline Format check_weight(const at::Tensor& w, const std::optional<at::Tensor>& scale, const char* op,
                           const char* w_name, const char* scale_name, int64_t L, int64_t N, int64_t K) {
  check_defined(w, op, w_name);
  Format f = weight_format(w, op, w_name);
  check_dim(w, op, w_name, 3, f == Format::FP4 ? "[L, N, K/2]" : "[L, N, K]");
  if (L < 0) L = w.size(0);
  if (N < 0) N = w.size(1);
  if (K < 0) K = f == Format::FP4 ? checked_mul(2, w.size(2), op, "K = 2 * w.size(2)") : w.size(2);
  const bool has_scale = scale.has_value() && scale->defined();
  switch (f) {
    case Format::BF16: {
      check_shape(w, op, w_name, {L, N, K}, "[L, N, K]");
      TORCH_CHECK_VALUE(!has_scale, op, ": ", scale_name, " must be None for bf16 ", w_name, ", got a tensor of shape ",
                        shape_str(scale->sizes()));
      break;
    }
    case Format::FP8: {
      check_divisible(K, op, (std::string("K of fp8 ") + w_name).c_str(), 128);
      check_shape(w, op, w_name, {L, N, K}, "[L, N, K]");
      TORCH_CHECK_VALUE(has_scale, op, ": ", scale_name, " is required for fp8 ", w_name,
                        " (float32 [L, N, K/128]), got None");
      check_dtype(*scale, op, scale_name, c10::ScalarType::Float);
      check_shape(*scale, op, scale_name, {L, N, K / 128}, "[L, N, K/128]");
      break;
    }
    case Format::FP4: {
      check_divisible(K, op, (std::string("K of fp4 ") + w_name).c_str(), 32);
      check_shape(w, op, w_name, {L, N, K / 2}, "[L, N, K/2]");
      TORCH_CHECK_VALUE(has_scale, op, ": ", scale_name, " is required for fp4 ", w_name,
                        " (UE8M0 uint8 or float8_e8m0fnu [L, N, K/32]), got None");
      check_dtype_in(*scale, op, scale_name, {c10::ScalarType::Byte, c10::ScalarType::Float8_e8m0fnu});
      check_shape(*scale, op, scale_name, {L, N, K / 32}, "[L, N, K/32]");
      break;
    }
  }
  if (has_scale) check_same_device(*scale, op, scale_name, w, w_name);
  return f;
}

// Logical K of a weight tensor (undoes the two-per-byte packing of fp4).
inline int64_t weight_k(const at::Tensor& w, Format f) {
  return f == Format::FP4 ? checked_mul(2, w.size(2), "weight_k", "K = 2 * w.size(2)") : w.size(2);
}

// ---------------------------------------------------------------------------------------------------------------
// Weight layouts (SPEC §1.2, §4): the trailing `str weight_layout="eoi"` of expert_gemm, local_experts, forward.
// "eoi" is nn.Linear's [L, N, K] (check_weight above); "eio" the prepared K-major form of
// python/static_moe/layouts.py, whose format is read from the dtype:
//   bf16           bfloat16       [L, K, N]                      no scale
//   fp8            float8_e4m3fn  [L, K, N]     float32          [L, K/128, N]
//   fp8 MX         uint32         [L, K/4, N]   UE8M0 (uint8)    [L, K/32, N]   (Format::FP8: same numbers as fp8)
//   fp4            uint16         [L, K/4, N]   UE8M0 (uint8)    [L, K/32, N]
// ---------------------------------------------------------------------------------------------------------------

enum class WeightLayout { Eoi, Eio };

inline const char* layout_name(WeightLayout l) { return l == WeightLayout::Eio ? "eio" : "eoi"; }

inline WeightLayout parse_weight_layout(std::string_view s, const char* op) {
  if (s == "eoi") return WeightLayout::Eoi;
  if (s == "eio") return WeightLayout::Eio;
  TORCH_CHECK_VALUE(false, op,
                    ": weight_layout must be 'eoi' (nn.Linear [L, N, K]) or 'eio' (prepared, K-major; "
                    "static_moe.layouts), got '",
                    std::string(s), "'");
  return WeightLayout::Eoi;  // unreachable
}

// The CPU and CUDA kernels read nn.Linear rows: they take "eoi" only and refuse the prepared layout.
// `backend` is "CPU" or "CUDA"; the message names the three ways out (StaticMoE's prepare_for, converting the
// tensors back, or running the prepared bytes through the reference on CPU for tests).
inline void refuse_prepared_layout(WeightLayout l, const char* op, const char* backend) {
  const bool cuda = std::string(backend) == "CUDA";
  TORCH_CHECK_VALUE(l == WeightLayout::Eoi, op,
                    ": weight_layout='eio' (prepared, K-major weights) is not supported "
                    "by the ",
                    backend,
                    " kernels, which read nn.Linear [L, N, K] weights (weight_layout='eoi'); "
                    "build the layer with StaticMoE(prepare_for=\"",
                    cuda ? "cuda" : "cpu",
                    "\"), convert "
                    "prepared tensors back exactly with static_moe.layouts.to_eoi, or (tests, CPU) run the prepared "
                    "bytes through the reference with static_moe.testing.backends.cpu_kernels(\"reference\")");
}

// Weight format of an "eio" tensor from its dtype (fp8 MX counts as fp8: it holds the same e4m3fn codes).
inline Format weight_format_eio(const at::Tensor& w, const char* op, const char* name) {
  auto t = w.scalar_type();
  if (t == c10::ScalarType::BFloat16) return Format::BF16;
  if (t == c10::ScalarType::Float8_e4m3fn || t == c10::ScalarType::UInt32) return Format::FP8;
  if (t == c10::ScalarType::UInt16) return Format::FP4;
  TORCH_CHECK_TYPE(false, op, ": ", name,
                   " must have a weight dtype of weight_layout='eio': torch.bfloat16 (bf16), torch.float8_e4m3fn "
                   "(fp8, float32 scales), torch.uint32 (fp8 MX, UE8M0 scales) or torch.uint16 (fp4), got ",
                   dtype_name(t));
  return Format::BF16;  // unreachable
}

inline Format weight_format_in(const at::Tensor& w, WeightLayout l, const char* op, const char* name) {
  return l == WeightLayout::Eio ? weight_format_eio(w, op, name) : weight_format(w, op, name);
}

// Output dim N of a 3-D weight tensor in a layout.
inline int64_t weight_n(const at::Tensor& w, WeightLayout l) { return l == WeightLayout::Eio ? w.size(2) : w.size(1); }

// An "eio" weight and its scale (table above). L, N, K are the logical sizes (-1: any, taken from w). Returns the
// format. The UE8M0 NaN byte is a value check, separate as for "eoi".
inline Format check_weight_eio(const at::Tensor& w, const std::optional<at::Tensor>& scale, const char* op,
                               const char* w_name, const char* scale_name, int64_t L, int64_t N, int64_t K) {
  check_defined(w, op, w_name);
  const Format f = weight_format_eio(w, op, w_name);
  const auto t = w.scalar_type();
  const bool packed = t == c10::ScalarType::UInt32 || t == c10::ScalarType::UInt16;  // 4 K values per element
  check_dim(w, op, w_name, 3, packed ? "[L, K/4, N] (weight_layout='eio')" : "[L, K, N] (weight_layout='eio')");
  if (L < 0) L = w.size(0);
  if (N < 0) N = w.size(2);
  if (K < 0) K = packed ? checked_mul(4, w.size(1), op, "K = 4 * w.size(1)") : w.size(1);
  const bool has_scale = scale.has_value() && scale->defined();
  if (f == Format::BF16) {
    check_shape(w, op, w_name, {L, K, N}, "[L, K, N] (weight_layout='eio')");
    TORCH_CHECK_VALUE(!has_scale, op, ": ", scale_name, " must be None for bf16 ", w_name, ", got a tensor of shape ",
                      shape_str(scale->sizes()));
    return f;
  }
  const int64_t block = f == Format::FP8 ? 128 : 32;
  check_divisible(K, op, (std::string("K of ") + format_name(f) + " " + w_name).c_str(), block);
  if (t == c10::ScalarType::Float8_e4m3fn) {
    check_shape(w, op, w_name, {L, K, N}, "[L, K, N] (weight_layout='eio')");
    TORCH_CHECK_VALUE(has_scale, op, ": ", scale_name, " is required for fp8 ", w_name,
                      " (float32 [L, K/128, N] under weight_layout='eio'), got None");
    check_dtype(*scale, op, scale_name, c10::ScalarType::Float);
    check_shape(*scale, op, scale_name, {L, K / 128, N}, "[L, K/128, N] (weight_layout='eio')");
  } else {
    const char* what = t == c10::ScalarType::UInt32 ? "fp8 MX " : "fp4 ";
    check_shape(w, op, w_name, {L, K / 4, N}, "[L, K/4, N] (weight_layout='eio')");
    TORCH_CHECK_VALUE(has_scale, op, ": ", scale_name, " is required for ", what, w_name,
                      " (UE8M0 uint8 or float8_e8m0fnu [L, K/32, N] under weight_layout='eio'), got None");
    check_dtype_in(*scale, op, scale_name, {c10::ScalarType::Byte, c10::ScalarType::Float8_e8m0fnu});
    check_shape(*scale, op, scale_name, {L, K / 32, N}, "[L, K/32, N] (weight_layout='eio')");
  }
  check_same_device(*scale, op, scale_name, w, w_name);
  return f;
}

inline Format check_weight_in(WeightLayout l, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                              const char* op, const char* w_name, const char* scale_name, int64_t L, int64_t N,
                              int64_t K) {
  return l == WeightLayout::Eio ? check_weight_eio(w, scale, op, w_name, scale_name, L, N, K)
                                : check_weight(w, scale, op, w_name, scale_name, L, N, K);
}

// ---------------------------------------------------------------------------------------------------------------
// Value checks (read data; eager CPU bindings only)
// ---------------------------------------------------------------------------------------------------------------

// Index of the first UE8M0 NaN byte (255) in p[0, n), or -1. Torch-free, usable by kernels on any byte range.
inline int64_t ue8m0_find_nan(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (p[i] == 0xFF) return i;
  return -1;
}

// Rejects the NaN exponent byte 255 in a contiguous CPU UE8M0 tensor (SPEC §1.2). Tensors not on the CPU, or
// without storage (meta / fake), are left alone: a device scan would need a host sync.
inline void check_ue8m0_values(const at::Tensor& s, const char* op, const char* name) {
  if (!s.defined() || !s.device().is_cpu() || !s.has_storage() || s.numel() == 0) return;
  if (s.key_set().has(c10::DispatchKey::Python)) return;  // FakeTensor / other Python subclasses: no real data
  TORCH_CHECK_VALUE(s.is_contiguous(), op, ": ", name, " must be contiguous to be checked for NaN scale bytes");
  const int64_t i = ue8m0_find_nan(static_cast<const uint8_t*>(s.const_data_ptr()), s.numel());
  TORCH_CHECK_VALUE(i < 0, op, ": ", name, " holds the UE8M0 NaN byte 255 at flat index ", i,
                    "; scale bytes must be 0..254 (value 2^(b-127))");
}

}  // namespace checks
}  // namespace static_moe
