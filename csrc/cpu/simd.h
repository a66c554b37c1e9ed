// Run-time choice of the x86 instruction set used by the CPU kernels. Torch-free.
//
// The default build compiles for baseline x86-64 (no -march=native). Kernels that want SIMD keep one source file
// per instruction set, compiled under `#pragma GCC target(...)` (see csrc/cpu/kernels/expert_gemm_avx512.cpp), and
// pick one per call with select_isa():
//   Isa::Amx     Avx512Bf16 plus AMX-TILE + AMX-BF16 (tile dot products: 16 x 32 bf16 by 32 x 16 per instruction),
//                as on Sapphire / Emerald / Granite Rapids, where Linux grants the process the tile data state;
//                chosen only by STATIC_MOE_CPU_ISA=amx (select_isa says why)
//   Isa::Avx512Bf16  Avx512 plus AVX512_BF16 (vdpbf16ps: bf16 dot products with fp32 accumulation) and
//                    AVX512_VBMI (vpermi2b, vpmultishiftqb), as on Zen 4 / Zen 5 / Sapphire Rapids
//   Isa::Avx512  AVX-512 F+BW+DQ+VL (x86-64-v4)
//   Isa::Avx2    AVX2 + FMA + F16C (x86-64-v3 without the rest)
//   Isa::Scalar  portable C++
// STATIC_MOE_CPU_ISA=scalar|avx2|avx512|avx512bf16|amx|auto forces a path (tests use it to check every path on one
// machine).
// The variable is read on every call, so a test may switch paths between calls; nothing is cached but the CPU
// feature probe, which cannot change while the process runs.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace static_moe {
namespace cpu {

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3, Amx = 4 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar:
      return "scalar";
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx512Bf16:
      return "avx512bf16";
    case Isa::Amx:
      return "amx";
  }
  return "?";
}

// Whether this process may use the AMX tile registers. Linux (5.16+) keeps the 8 KiB tile data state off until
// the process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18, Linux's
// arch/x86/include/uapi/asm/prctl.h);
// a tile instruction before that raises SIGILL. The grant is for the whole process, threads started later included.
inline bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// The best instruction set this CPU (and OS: __builtin_cpu_supports checks XCR0) can run.
inline Isa detected_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vbmi")) return Isa::Avx512;
      return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted()
                 ? Isa::Amx
                 : Isa::Avx512Bf16;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::Avx2;
    return Isa::Scalar;
  }();
  return best;
#else
  return Isa::Scalar;
#endif
}

// The instruction set to use now: the detected one (but Amx, see below), or the one STATIC_MOE_CPU_ISA names. On a
// bad value, or a forced set this CPU cannot run, returns false and points *error at a message (a string
// literal); the caller turns it into its own error type.
inline bool select_isa(Isa* isa, const char** error) {
  const Isa best = detected_isa();
  const char* env = std::getenv("STATIC_MOE_CPU_ISA");
  // Amx is never the default: a row's bits may not depend on how many rows a call has (batch invariance), so one
  // kernel must serve every row count (TDPBF16PS sums a unit in an order no vdpbf16ps kernel reproduces:
  // bench/micro/amx_tiles.cpp), and the tiles are slower than avx512bf16 at decode sizes, one or two rows per
  // expert, and faster from 16 rows per expert (docs/backends/cpu.md). STATIC_MOE_CPU_ISA=amx chooses it for
  // batches that are large per expert.
  *isa = best == Isa::Amx ? Isa::Avx512Bf16 : best;
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return true;
  Isa want;
  if (std::strcmp(env, "scalar") == 0) {
    want = Isa::Scalar;
  } else if (std::strcmp(env, "avx2") == 0) {
    want = Isa::Avx2;
  } else if (std::strcmp(env, "avx512") == 0) {
    want = Isa::Avx512;
  } else if (std::strcmp(env, "avx512bf16") == 0) {
    want = Isa::Avx512Bf16;
  } else if (std::strcmp(env, "amx") == 0) {
    want = Isa::Amx;
  } else {
    *error = "STATIC_MOE_CPU_ISA must be one of scalar, avx2, avx512, avx512bf16, amx, auto";
    return false;
  }
  if (static_cast<int>(want) > static_cast<int>(best)) {
    *error =
        want == Isa::Amx ? "STATIC_MOE_CPU_ISA=amx but this CPU (or the OS) lacks AMX-TILE + AMX-BF16 or AVX-512 BF16"
        : want == Isa::Avx512Bf16 ? "STATIC_MOE_CPU_ISA=avx512bf16 but this CPU lacks AVX-512 F/BW/DQ/VL + BF16 + VBMI"
        : want == Isa::Avx512     ? "STATIC_MOE_CPU_ISA=avx512 but this CPU lacks AVX-512 F/BW/DQ/VL"
                                  : "STATIC_MOE_CPU_ISA=avx2 but this CPU lacks AVX2/FMA/F16C";
    return false;
  }
  *isa = want;
  return true;
}

}  // namespace cpu
}  // namespace static_moe
