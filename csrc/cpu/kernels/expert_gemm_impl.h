// The Float32 kernel of the expert GEMM (see expert_gemm.h; expert_gemm_plan.h picks it and its RowPath), written
// once over a SIMD traits class V and compiled once per instruction set: expert_gemm_<isa>.cpp includes this file
// AFTER its `#pragma GCC target`, then defines V and instantiates GemmKernels<V>. Everything here has internal
// linkage (anonymous namespace), so the AVX-512 copy of a helper can never be merged with, or called instead of, the
// baseline copy in another translation unit.
// Include every standard / project header this file needs BEFORE the target pragma (they must stay generic).
//
// V provides (W = lanes; a "unit" is U = 2W consecutive k of one weight row, decoded into two vectors lo, hi):
//   vec zero(); vec load(const float*); void store(float*, vec); vec fma(a, b, c) = a·b + c; float reduce(vec)
//   decode_bf16(row, k0, lo, hi); decode_fp8(row, k0, s, lo, hi); decode_fp4(row, k0, s, lo, hi), where s points
//     at the unit's scale in a chunk prepared by fp8_scales(src, nb, out) (out = src times whatever factor that
//     ISA's decode_fp8 expects) or
//     fp4_scales(src, nb, out, bad) (out = 2^(b-127), bad |= any b == 255), one chunk per kScaleChunk k of a row,
//     so the per-unit work is vector-only (no scalar scale decode in the hot loop)
//   kIsa (the instruction set it is compiled for), kMR, kNR (blocking: MR activation rows × NR weight rows of
//   accumulators), kNR1 (NR when there is one row), kPanelMR, kPanelNR (the blocking of rows read from a decoded
//   panel on RowPath::Panel; NR = 0: no panel)
// Lane layout of a unit: lanes 0..W-1 then W..2W-1 hold k0+0..W-1, k0+W..2W-1 (bf16, fp8), or the even columns
// k0+0,2,..,2W-2 then the odd ones k0+1,3,..,2W-1 (fp4: what a nibble split of W packed bytes gives).
#pragma once

namespace static_moe {
namespace cpu {
namespace {

// e4m3fn code -> float32, exactly (NaN codes 0x7F / 0xFF give NaN), as torch's .float().
inline float e4m3fn_to_float(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
  if (e == 15u && m == 7u) return bits_float(sign | 0x7FC00000u);
  if (e == 0u) return bits_float(sign | float_bits(static_cast<float>(m) * 0.001953125f));  // m · 2^-9
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

// UE8M0 byte -> 2^(b-127), exactly (b = 0 is the subnormal 2^-127; b = 255 gives +inf, callers flag it).
inline float ue8m0_to_float(uint8_t b) { return bits_float(b == 0 ? 0x00400000u : static_cast<uint32_t>(b) << 23); }

// C[i, n] = c (+ the bias, SPEC §1.9) through `out` (rounded to bf16 first, as the reference's GEMM output).
// Separate IEEE operations (the build does not contract them into an FMA), so every ISA adds the same bits.
inline void emit_output(const OutRows& out, int64_t i, int64_t n, float c) {
  if (out.bias != nullptr) {
    const float b = out.bias_scale != nullptr ? out.bias_scale[i] * out.bias[n] : out.bias[n];
    c = c + b;
  }
  const uint16_t h = float_to_bf16(c);
  if (out.kind == OutKind::StoreBf16) {
    static_cast<uint16_t*>(out.rows[i])[n - out.col0] = h;
  } else {
    static_cast<float*>(out.rows[i])[n - out.col0] += bf16_to_float(h);
  }
}

// Activation values -> float32 in the lane layout of W-lane units (see above; W = 1: natural order).
template <int W>
void prepare_activation_impl(WeightFormat wf, ActFormat af, const void* x, const float* x_scale, int64_t group,
                             int64_t k, float* out) {
  const bool permute = wf == WeightFormat::Fp4 && W > 1;
  if (af == ActFormat::Bf16) {
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    if (!permute) {
      for (int64_t c = 0; c < k; ++c) out[c] = bf16_to_float(xb[c]);
    } else {
      for (int64_t u = 0; u < k; u += 2 * W)
        for (int64_t r = 0; r < W; ++r) {
          out[u + r] = bf16_to_float(xb[u + 2 * r]);
          out[u + W + r] = bf16_to_float(xb[u + 2 * r + 1]);
        }
    }
    return;
  }
  const uint8_t* xq = static_cast<const uint8_t*>(x);
  if (!permute) {
    for (int64_t c = 0; c < k; ++c) out[c] = e4m3fn_to_float(xq[c]) * x_scale[c / group];
  } else {
    for (int64_t u = 0; u < k; u += 2 * W) {
      const float s = x_scale[u / group];  // a unit (2W <= 32 columns) never straddles a group (32 or 128)
      for (int64_t r = 0; r < W; ++r) {
        out[u + r] = e4m3fn_to_float(xq[u + 2 * r]) * s;
        out[u + W + r] = e4m3fn_to_float(xq[u + 2 * r + 1]) * s;
      }
    }
  }
}

template <class V>
struct GemmKernels {
  using vec = typename V::vec;
  static constexpr int W = V::W;
  static constexpr int U = 2 * W;
  static_assert(V::kMR == kFloat32BlockRows, "plan_expert_gemm compares the row count with this block");
  static_assert((V::kPanelNR > 0) == float32_has_panel(V::kIsa), "plan_expert_gemm knows which kernels have a panel");

  // Rows of one expert weight, resolved once per block of NR weight rows.
  struct RowPtrs {
    const uint8_t* q;
    const void* s;
  };

  template <WeightFormat F>
  static inline RowPtrs row_ptrs(const ExpertWeight& w, int64_t n) {
    RowPtrs r;
    r.q = w.data + n * w.row_stride;
    if (F == WeightFormat::Fp8)
      r.s = static_cast<const float*>(w.scale) + n * w.scale_row_stride;
    else if (F == WeightFormat::Fp4)
      r.s = static_cast<const uint8_t*>(w.scale) + n * w.scale_row_stride;
    else
      r.s = nullptr;
    return r;
  }

  static constexpr int64_t kChunk = V::kScaleChunk;  // k per prepared chunk of scales
  static_assert(kChunk % kFp8WeightBlock == 0 && kChunk % U == 0, "a scale chunk holds whole blocks and units");

  // Scales of k in [kc, kend) of one weight row into `out` (floats; nothing for bf16).
  template <WeightFormat F>
  static inline void chunk_scales(const RowPtrs& r, int64_t kc, int64_t kend, float* out, uint32_t& bad) {
    if constexpr (F == WeightFormat::Fp8) {
      V::fp8_scales(static_cast<const float*>(r.s) + kc / kFp8WeightBlock,
                    static_cast<int>((kend - kc) / kFp8WeightBlock), out);
    } else if constexpr (F == WeightFormat::Fp4) {
      V::fp4_scales(static_cast<const uint8_t*>(r.s) + kc / kFp4WeightBlock,
                    static_cast<int>((kend - kc) / kFp4WeightBlock), out, bad);
    }
  }

  // Unit [k0, k0 + U) of a row; s: the row's chunk of scales, prepared from column kc.
  template <WeightFormat F>
  static inline void decode(const RowPtrs& r, int64_t k0, int64_t kc, const float* s, vec& lo, vec& hi) {
    if constexpr (F == WeightFormat::Bf16) {
      V::decode_bf16(r.q, k0, lo, hi);
    } else if constexpr (F == WeightFormat::Fp8) {
      V::decode_fp8(r.q, k0, s + (k0 - kc) / kFp8WeightBlock, lo, hi);
    } else {
      V::decode_fp4(r.q, k0, s + (k0 - kc) / kFp4WeightBlock, lo, hi);
    }
  }

  static inline void emit(const OutRows& out, int64_t i, int64_t n, float c) { emit_output(out, i, n, c); }

  // k per 64-byte cache line of a weight row.
  template <WeightFormat F>
  static constexpr int64_t line_k() {
    return F == WeightFormat::Fp4 ? 128 : (F == WeightFormat::Fp8 ? 64 : 32);
  }

  // k per step of the unit loops: one cache line of a weight row, or one unit where a unit spans more.
  template <WeightFormat F>
  static constexpr int64_t step_k() {
    return line_k<F>() > U ? line_k<F>() : U;
  }

  // The byte of column k in a weight row (k a multiple of line_k<F>()).
  template <WeightFormat F>
  static constexpr int64_t row_byte(int64_t k) {
    return k * 64 / line_k<F>();
  }

  // Few rows: decode each unit of NR weight rows into registers and use it at once for all MR rows. With
  // `prefetch` (set when the next NR weight rows are in the caller's range), their same lines are requested one
  // block ahead: one core alone does not keep enough DRAM reads in flight to stream the weights at full bandwidth.
  // The weight lines go to L2 (prefetcht1), as in the avx512bf16 kernel: L2 keeps more misses in flight than L1;
  // the scales' small stream stays on prefetcht0.
  template <WeightFormat F, int MR, int NR>
  static void fused_block(const float* const* a, int64_t i0, const ExpertWeight& w, int64_t n, const OutRows& out,
                          bool prefetch, uint32_t& bad_out) {
    constexpr int64_t KL = step_k<F>();
    static_assert(kChunk % KL == 0, "a scale chunk holds whole cache lines");
    const float* ap[MR];
    for (int i = 0; i < MR; ++i) ap[i] = a[i0 + i];
    RowPtrs rp[NR];
    for (int j = 0; j < NR; ++j) rp[j] = row_ptrs<F>(w, n + j);
    const uint8_t* next = w.data + (n + NR) * w.row_stride;  // a hint only: never dereferenced
    alignas(64) float sc[NR][kChunk / kFp4WeightBlock];
    uint32_t bad = 0;
    vec acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
    const int64_t K = w.k;
    for (int64_t kc = 0; kc < K; kc += kChunk) {
      const int64_t kend = K - kc < kChunk ? K : kc + kChunk;
      for (int j = 0; j < NR; ++j) chunk_scales<F>(rp[j], kc, kend, sc[j], bad);
      if (prefetch && F != WeightFormat::Bf16) {  // the next rows' scales of this chunk: a stream of its own
        const RowPtrs nx = row_ptrs<F>(w, n + NR);
        for (int j = 0; j < NR; ++j) {
          const uint8_t* s = static_cast<const uint8_t*>(nx.s);
          if (F == WeightFormat::Fp8) {
            __builtin_prefetch(s + (j * w.scale_row_stride + kc / kFp8WeightBlock) * sizeof(float), 0, 3);
          } else {
            __builtin_prefetch(s + j * w.scale_row_stride + kc / kFp4WeightBlock, 0, 3);
          }
        }
      }
      for (int64_t kl = kc; kl < kend; kl += KL) {
        if (prefetch) {
          for (int j = 0; j < NR; ++j) __builtin_prefetch(next + j * w.row_stride + row_byte<F>(kl), 0, 2);
        }
        for (int64_t k0 = kl; k0 < kl + KL; k0 += U) {
          for (int j = 0; j < NR; ++j) {
            vec lo, hi;
            decode<F>(rp[j], k0, kc, sc[j], lo, hi);
            for (int i = 0; i < MR; ++i) {
              acc[i][j] = V::fma(V::load(ap[i] + k0), lo, acc[i][j]);
              acc[i][j] = V::fma(V::load(ap[i] + k0 + W), hi, acc[i][j]);
            }
          }
        }
      }
    }
    bad_out |= bad;
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) emit(out, i0 + i, n + j, V::reduce(acc[i][j]));
  }

  // NR weight rows from n for all m rows: blocks of MR rows, each decoding the NR rows' units again (from L1). On
  // RowPath::Panel (panel_rows below: one decode per chunk) only the column tails narrower than kPanelNR come here.
  // Only the first block asks for the next rows: every block asking, as avx512bf16's dot_row_blocks does, measured
  // the same here (docs/backends/cpu.md), the fp32 products being slower than the weight stream.
  template <WeightFormat F, int NR>
  static void row_blocks(const float* const* a, int64_t m, const ExpertWeight& w, int64_t n, const OutRows& out,
                         bool prefetch, uint32_t& bad) {
    constexpr int MR = V::kMR;
    static_assert(MR <= 4, "tails below cover MR <= 4");
    int64_t i = 0;
    for (; i + MR <= m; i += MR) fused_block<F, MR, NR>(a, i, w, n, out, prefetch && i == 0, bad);
    switch (m - i) {
      case 1:
        fused_block<F, 1, NR>(a, i, w, n, out, prefetch && i == 0, bad);
        break;
      case 2:
        fused_block<F, (MR > 2 ? 2 : 1), NR>(a, i, w, n, out, prefetch && i == 0, bad);
        break;
      case 3:
        fused_block<F, (MR > 3 ? 3 : 1), NR>(a, i, w, n, out, prefetch && i == 0, bad);
        break;
      default:
        break;
    }
  }

  // MR rows from i0 over one chunk of the panel (len k from kc): the accumulators come from and go back to `park`
  // ([MR][NR] vectors of W floats). Unit by unit, lo then hi, as fused_block.
  template <int MR, int NR>
  static inline void panel_block(const float* const* a, int64_t i0, int64_t kc, int64_t len, const float* panel,
                                 float* park) {
    const float* ap[MR];
    for (int i = 0; i < MR; ++i) ap[i] = a[i0 + i] + kc;
    vec acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = V::load(park + (i * NR + j) * W);
    for (int64_t u = 0; u < len; u += W) {  // the halves of the units in order: lo, hi, lo, hi, ...
      vec wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = V::load(panel + j * kChunk + u);
      for (int i = 0; i < MR; ++i) {
        const vec av = V::load(ap[i] + u);
        for (int j = 0; j < NR; ++j) acc[i][j] = V::fma(av, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) V::store(park + (i * NR + j) * W, acc[i][j]);
  }

  // Many rows: each chunk of NR weight rows is decoded once into a float panel (NR × kChunk floats: 12 KiB for
  // avx512's 6 rows, in L1) that every block of V::kPanelMR rows then reads, instead of every block of kMR rows
  // decoding the same units again (row_blocks: at 16 rows, four decodes of each unit). The accumulators wait in
  // `park` (m × NR vectors) between chunks. Each accumulator sees the fma sequence of fused_block, unit by unit,
  // so a row's bits are the same whichever of the two its row count takes. With `prefetch`, the next NR rows'
  // lines of the chunk are requested while it is decoded.
  template <WeightFormat F, int NR>
  static void panel_rows(const float* const* a, int64_t m, const ExpertWeight& w, int64_t n, const OutRows& out,
                         bool prefetch, float* park, uint32_t& bad_out) {
    constexpr int MR = V::kPanelMR;
    static_assert(MR <= 4, "tails below cover MR <= 4");
    constexpr int64_t KL = step_k<F>();
    RowPtrs rp[NR];
    for (int j = 0; j < NR; ++j) rp[j] = row_ptrs<F>(w, n + j);
    const uint8_t* next = w.data + (n + NR) * w.row_stride;  // a hint only: never dereferenced
    alignas(64) float sc[NR][kChunk / kFp4WeightBlock];
    alignas(64) float panel[NR * kChunk];
    uint32_t bad = 0;
    for (int64_t i = 0; i < m * NR; ++i) V::store(park + i * W, V::zero());
    const int64_t K = w.k;
    for (int64_t kc = 0; kc < K; kc += kChunk) {
      const int64_t kend = K - kc < kChunk ? K : kc + kChunk;
      for (int j = 0; j < NR; ++j) {
        chunk_scales<F>(rp[j], kc, kend, sc[j], bad);
        for (int64_t kl = kc; kl < kend; kl += KL) {
          if (prefetch) __builtin_prefetch(next + j * w.row_stride + row_byte<F>(kl), 0, 2);  // next block's row j
          for (int64_t k0 = kl; k0 < kl + KL; k0 += U) {
            vec lo, hi;
            decode<F>(rp[j], k0, kc, sc[j], lo, hi);
            V::store(panel + j * kChunk + (k0 - kc), lo);
            V::store(panel + j * kChunk + (k0 - kc) + W, hi);
          }
        }
      }
      const int64_t len = kend - kc;
      int64_t i = 0;
      for (; i + MR <= m; i += MR) panel_block<MR, NR>(a, i, kc, len, panel, park + i * NR * W);
      switch (m - i) {
        case 1:
          panel_block<1, NR>(a, i, kc, len, panel, park + i * NR * W);
          break;
        case 2:
          panel_block<(MR > 2 ? 2 : 1), NR>(a, i, kc, len, panel, park + i * NR * W);
          break;
        case 3:
          panel_block<(MR > 3 ? 3 : 1), NR>(a, i, kc, len, panel, park + i * NR * W);
          break;
        default:
          break;
      }
    }
    bad_out |= bad;
    for (int64_t i = 0; i < m; ++i)
      for (int j = 0; j < NR; ++j) emit(out, i, n + j, V::reduce(V::load(park + (i * NR + j) * W)));
  }

  // Blocks of NR weight rows from n while they fit before n1 (advances n): one row (OneRow) or blocks of MR rows.
  template <WeightFormat F, int NR, RowPath P>
  static void column_blocks(const float* const* a, int64_t m, const ExpertWeight& w, int64_t& n, int64_t n1,
                            const OutRows& out, uint32_t& bad) {
    static_assert(P == RowPath::OneRow || P == RowPath::Blocks, "panels go through panel_rows");
    for (; n + NR <= n1; n += NR) {
      const bool prefetch = n + 2 * NR <= n1;
      if constexpr (P == RowPath::OneRow) {
        fused_block<F, 1, NR>(a, 0, w, n, out, prefetch, bad);
      } else {
        row_blocks<F, NR>(a, m, w, n, out, prefetch, bad);
      }
    }
  }

  // Weight rows [n0, n1) for the m rows on path P: the widest blocks first (Panel: kPanelNR weight rows read from a
  // panel; OneRow: kNR1, so that one row keeps enough FMA chains in flight), then narrower blocks for the tail, so
  // that few weight rows never run as a single latency-bound chain.
  template <WeightFormat F, RowPath P>
  static bool run_path(const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
                       const OutRows& out) {
    constexpr RowPath tail = P == RowPath::OneRow ? RowPath::OneRow : RowPath::Blocks;
    uint32_t bad = 0;
    int64_t n = n0;
    if constexpr (P == RowPath::Panel) {
      constexpr int NR = V::kPanelNR;
      static_assert(NR > 0, "this V has no panel");
      std::vector<float> park(static_cast<size_t>(m) * NR * W);
      for (; n + NR <= n1; n += NR) panel_rows<F, NR>(a, m, w, n, out, n + 2 * NR <= n1, park.data(), bad);
    }
    if constexpr (P == RowPath::OneRow) column_blocks<F, V::kNR1, tail>(a, m, w, n, n1, out, bad);
    column_blocks<F, V::kNR, tail>(a, m, w, n, n1, out, bad);
    column_blocks<F, 2, tail>(a, m, w, n, n1, out, bad);
    column_blocks<F, 1, tail>(a, m, w, n, n1, out, bad);
    return bad == 0;
  }

  template <WeightFormat F>
  static bool run_format(RowPath path, const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
                         const OutRows& out) {
    if (path == RowPath::OneRow) return run_path<F, RowPath::OneRow>(a, m, w, n0, n1, out);
    if constexpr (V::kPanelNR > 0) {
      if (path == RowPath::Panel) return run_path<F, RowPath::Panel>(a, m, w, n0, n1, out);
    }
    return run_path<F, RowPath::Blocks>(a, m, w, n0, n1, out);
  }

  // The plan's path (expert_gemm_plan.h) over m > 0 rows and weight rows n0 < n1.
  static bool run(RowPath path, const float* const* a, int64_t m, const ExpertWeight& w, int64_t n0, int64_t n1,
                  const OutRows& out) {
    switch (w.format) {
      case WeightFormat::Bf16:
        return run_format<WeightFormat::Bf16>(path, a, m, w, n0, n1, out);
      case WeightFormat::Fp8:
        return run_format<WeightFormat::Fp8>(path, a, m, w, n0, n1, out);
      case WeightFormat::Fp4:
        return run_format<WeightFormat::Fp4>(path, a, m, w, n0, n1, out);
    }
    return true;
  }
};

}  // namespace
}  // namespace cpu
}  // namespace static_moe
