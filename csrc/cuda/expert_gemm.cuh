// The CUDA expert GEMM (SPEC §1.6), device side: tile configuration, per-thread stage loaders and fragment code
// (__host__ __device__, so tests/cuda/host/ runs them on the CPU against the reference), and the kernel.
//
// Shape of the work: decode MoE, so A has few rows per expert (1..128) and the weights dominate the bytes. The
// kernel streams each weight tile through shared memory once per tile of 32 rows and is built to be bound by
// weight bandwidth, not by math.
//
// Tiling ("swap AB"): one CTA of 4 warps computes D[32 rows, 64 cols] for one expert. The MMA's M side is the
// weight rows (each warp owns 16 of the 64), its N side is the activation rows (4 MMA tiles of 8), so a single
// routed row wastes 7/8 of an MMA instead of 15/16, and each weight element is decoded exactly once per tile.
// K advances 128 at a time through a cp.async pipeline (3 to 6 stages, by weight format) in shared memory; rows of
// a stage are padded (by a quarter of their bytes) so every fragment load is free of bank conflicts.
//
// Operands and numerics (all exact until the fp32 accumulation):
//   bf16 activations:  bf16 MMA (m16n8k16). fp8 weights decode to bf16 exactly, fp4 weights decode to bf16 exactly.
//   fp8 activations:   on sm_89+ the e4m3 MMA (m16n8k32): fp8 weights as they are, fp4 weights moved into e4m3
//                      as value·2^-6 (exact); on sm_80 both sides decode to bf16 and use the bf16 MMA.
//   Scales are applied in registers per K block: the MMA accumulates one scale block (32 k for fp4 weights or
//   32-groups of activations, else 128 k) into a zeroed partial, then acc += partial · (s_w · s_a) in fp32
//   (fp4 weights in e4m3: the partial times 2^6 first).
//
// K permutation: inside each 32-k sub-block, thread t (= lane % 4) loads the 8 consecutive k of its rows at
// [8t, 8t+8) with one shared-memory load and feeds them to the MMA k slots that the PTX layout gives thread t.
// A dot product does not care which k sits in which slot as long as the A and B operands agree, and they do:
// weights and activations use the same mapping, and it never crosses a 32-k scale block.
//
// Batch invariance: a row's result is its own dot products over K in a fixed order (fixed stages, fixed
// sub-blocks, fixed partial sums); which other rows share its tile never enters its arithmetic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "cuda/expert_gemm.h"
#include "cuda/mma.cuh"
#include "cuda/numerics.cuh"

namespace static_moe {
namespace cuda {
namespace gemm {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBN = 16 * kWarps;    // weight rows (output columns) per tile
constexpr int kBM = kGemmTileRows;  // activation rows per tile
constexpr int kBK = 128;            // k per pipeline stage
constexpr int kSub = 32;            // k per sub-block (the finest scale block)
constexpr int kSubs = kBK / kSub;
constexpr int kNT = kBM / 8;  // MMA n-tiles of activation rows
static_assert(kBM % 8 == 0, "tile rows must be a multiple of the MMA n size");

// W: weight format; G: activation group (0 = bf16 activations, 32 / 128 = fp8 activations with that group).
template <WeightFmt W, int G>
struct Cfg {
  static constexpr WeightFmt kW = W;
  static constexpr int kG = G;
  static constexpr bool kActFp8 = G != 0;
  static constexpr int kWSub = W == WeightFmt::kBf16 ? 64 : (W == WeightFmt::kFp8 ? 32 : 16);  // bytes/row/sub
  static constexpr int kASub = kActFp8 ? 32 : 64;
  static constexpr int kWRow = kWSub * kSubs;  // bytes of one weight row in a stage
  static constexpr int kARow = kASub * kSubs;
  static constexpr int kWStride = kWRow + kWRow / 4;  // padded: conflict-free 16/8/4-byte fragment loads
  static constexpr int kAStride = kARow + kARow / 4;
  static constexpr int kWScaleBytes = W == WeightFmt::kBf16 ? 0 : kBN * 4;  // fp8: 1 float/row; fp4: 4 bytes/row
  static constexpr int kAScalesPerRow = kActFp8 ? kBK / G : 0;
  static constexpr int kAScaleBytes = kBM * kAScalesPerRow * 4;
  static constexpr int kWOff = 0;
  static constexpr int kWSOff = kWOff + kBN * kWStride;
  static constexpr int kAOff = kWSOff + kWScaleBytes;
  static constexpr int kASOff = kAOff + kBM * kAStride;
  static constexpr int kStageBytes = kASOff + kAScaleBytes;
  // Deeper pipelines for the narrower weights keep about as many weight bytes in flight per SM.
  static constexpr int kStages = W == WeightFmt::kBf16 ? 3 : (W == WeightFmt::kFp8 ? 4 : 6);
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr bool kScaled = W != WeightFmt::kBf16 || kActFp8;
  // Sub-blocks summed in one partial before scaling: fp4 weights and 32-groups of activations change scale every
  // 32 k; otherwise the scale block is the whole 128-k stage.
  static constexpr int kScaleSubs = (W == WeightFmt::kFp4 || G == 32) ? 1 : kSubs;
  static constexpr int kOutStride = kBN * 2 + 16;  // bytes per row of the bf16 epilogue tile
  static_assert(G == 0 || G == 32 || G == 128, "activation group must be 32 or 128");
  static_assert(!(W == WeightFmt::kBf16 && G != 0), "fp8 activations with bf16 weights is not a SPEC pair");
  static_assert(kStageBytes % 16 == 0 && kWSOff % 16 == 0 && kAOff % 16 == 0 && kASOff % 16 == 0, "alignment");
  static_assert(kBM * kOutStride <= kSmemBytes, "epilogue tile must fit in the pipeline buffers");
};

// Loads from shared memory (device) or host memory (CPU emulation) without aliasing trouble on the host.
template <typename T>
__host__ __device__ inline T ld(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const T*>(p);
#else
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Stage loader: thread `tid` of `nthreads` issues its share of the copies of k block `kb` into `stage`.
// a_rows[i] is the A row of tile row i (i < count); rows >= count and weight rows >= N are zero-filled.
// ---------------------------------------------------------------------------------------------------------------
template <class C>
__host__ __device__ inline void load_stage(uint8_t* stage, const ExpertGemmArgs& p, const uint8_t* b_e,
                                           const uint8_t* bs_e, int n0, const int* a_rows, int count, int kb, int tid,
                                           int nthreads) {
  const int64_t k0 = static_cast<int64_t>(kb) * kBK;
  // Weights: kBN rows of kWRow bytes, in 16-byte pieces.
  constexpr int kWChunks = C::kWRow / 16;
  const int64_t wk = k0 / kSub * C::kWSub;
  for (int c = tid; c < kBN * kWChunks; c += nthreads) {
    const int r = c / kWChunks, q = c % kWChunks;
    const bool valid = n0 + r < p.n;
    const uint8_t* src = valid ? b_e + (n0 + r) * p.b_row_stride + wk + q * 16 : b_e;
    cp_async_16(stage + C::kWOff + r * C::kWStride + q * 16, src, valid);
  }
  if constexpr (C::kWScaleBytes > 0) {
    for (int r = tid; r < kBN; r += nthreads) {
      const bool valid = n0 + r < p.n;
      const uint8_t* src = bs_e;
      if (valid) {
        if constexpr (C::kW == WeightFmt::kFp8)  // one float32 per row and 128 k
          src = bs_e + ((n0 + r) * p.b_scale_row_stride + kb) * 4;
        else  // fp4: four UE8M0 bytes per row and 128 k
          src = bs_e + (n0 + r) * p.b_scale_row_stride + kb * 4;
      }
      cp_async_4(stage + C::kWSOff + r * 4, src, valid);
    }
  }
  // Activations: kBM rows of kARow bytes.
  constexpr int kAChunks = C::kARow / 16;
  constexpr int kAElemBytes = C::kActFp8 ? 1 : 2;
  const uint8_t* a = static_cast<const uint8_t*>(p.a);
  for (int c = tid; c < kBM * kAChunks; c += nthreads) {
    const int r = c / kAChunks, q = c % kAChunks;
    const bool valid = r < count;
    const uint8_t* src = valid ? a + (static_cast<int64_t>(a_rows[r]) * p.a_row_stride + k0) * kAElemBytes + q * 16 : a;
    cp_async_16(stage + C::kAOff + r * C::kAStride + q * 16, src, valid);
  }
  if constexpr (C::kActFp8) {
    for (int c = tid; c < kBM * C::kAScalesPerRow; c += nthreads) {
      const int r = c / C::kAScalesPerRow, q = c % C::kAScalesPerRow;
      const bool valid = r < count;
      const float* src =
          valid ? p.a_scale + static_cast<int64_t>(a_rows[r]) * p.a_scale_row_stride + k0 / C::kG + q : p.a_scale;
      cp_async_4(stage + C::kASOff + c * 4, src, valid);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Per-thread fragments of sub-block j (32 k) of a stage. row = 16·warp + g is the thread's first weight row (the
// second is row + 8), t = lane % 4 picks k [8t, 8t+8) of the sub-block, tok = 8·nt + g the activation row.
// bf16 MMA: 4 registers = 8 bf16; e4m3 MMA: 2 registers = 8 e4m3 (the other two are zero).
// ---------------------------------------------------------------------------------------------------------------
template <class C, bool kFp8Mma>
__host__ __device__ inline void load_w_frag(const uint8_t* stage, int row, int t, int j, uint32_t (&wf)[2][4]) {
  STATIC_MOE_UNROLL
  for (int h = 0; h < 2; ++h) {
    const uint8_t* src = stage + C::kWOff + (row + 8 * h) * C::kWStride + j * C::kWSub + t * (C::kWSub / 4);
    if constexpr (C::kW == WeightFmt::kBf16) {
      const uint4 v = ld<uint4>(src);
      wf[h][0] = v.x;
      wf[h][1] = v.y;
      wf[h][2] = v.z;
      wf[h][3] = v.w;
    } else if constexpr (C::kW == WeightFmt::kFp8) {
      const uint2 v = ld<uint2>(src);
      if constexpr (kFp8Mma) {
        wf[h][0] = v.x;
        wf[h][1] = v.y;
        wf[h][2] = 0u;
        wf[h][3] = 0u;
      } else {
        e4m3x8_to_bf16x8(v.x, v.y, wf[h]);
      }
    } else {
      const uint32_t v = ld<uint32_t>(src);
      if constexpr (kFp8Mma) {
        e2m1x8_to_e4m3x8_scaled(v, wf[h][0], wf[h][1]);
        wf[h][2] = 0u;
        wf[h][3] = 0u;
      } else {
        e2m1x8_to_bf16x8(v, wf[h]);
      }
    }
  }
}

template <class C, bool kFp8Mma>
__host__ __device__ inline void load_a_frag(const uint8_t* stage, int tok, int t, int j, uint32_t (&af)[4]) {
  const uint8_t* src = stage + C::kAOff + tok * C::kAStride + j * C::kASub + t * (C::kASub / 4);
  if constexpr (!C::kActFp8) {
    const uint4 v = ld<uint4>(src);
    af[0] = v.x;
    af[1] = v.y;
    af[2] = v.z;
    af[3] = v.w;
  } else {
    const uint2 v = ld<uint2>(src);
    if constexpr (kFp8Mma) {
      af[0] = v.x;
      af[1] = v.y;
      af[2] = 0u;
      af[3] = 0u;
    } else {
      e4m3x8_to_bf16x8(v.x, v.y, af);
    }
  }
}

// Operands of MMA step s of a sub-block (bf16: s = 0, 1, each 16 k; e4m3: s = 0, all 32 k). In both layouts the
// A registers are {row g, row g+8} x {first k set, second k set} of thread t, and the B registers the same two k
// sets of activation row g, so slot-for-slot the same physical k meet (see the K permutation note above).
__host__ __device__ inline void mma_operands(const uint32_t (&wf)[2][4], const uint32_t (&af)[4], int s,
                                             uint32_t (&a)[4], uint32_t (&b)[2]) {
  a[0] = wf[0][2 * s];
  a[1] = wf[1][2 * s];
  a[2] = wf[0][2 * s + 1];
  a[3] = wf[1][2 * s + 1];
  b[0] = af[2 * s];
  b[1] = af[2 * s + 1];
}

constexpr int mma_steps(bool fp8_mma) { return fp8_mma ? 1 : 2; }

// acc += part · (s_w · s_a) for the scale block ending with sub-block j; part is zeroed. C fragment element c of
// n-tile nt is (weight row row + 8·(c/2), activation row 8·nt + 2t + c%2).
template <class C, bool kFp8Mma>
__host__ __device__ inline void apply_scales(const uint8_t* stage, int row, int t, int j, float (&part)[kNT][4],
                                             float (&acc)[kNT][4]) {
  float ws[2];
  STATIC_MOE_UNROLL
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
    if constexpr (C::kW == WeightFmt::kFp8) {
      ws[h] = ld<float>(stage + C::kWSOff + r * 4);
    } else if constexpr (C::kW == WeightFmt::kFp4) {
      ws[h] = ue8m0_to_float(stage[C::kWSOff + r * 4 + j]);
    } else {
      ws[h] = 1.0f;
    }
  }
  STATIC_MOE_UNROLL
  for (int nt = 0; nt < kNT; ++nt) {
    float as[2];
    STATIC_MOE_UNROLL
    for (int c = 0; c < 2; ++c) {
      const int tok = 8 * nt + 2 * t + c;
      if constexpr (C::kActFp8)
        as[c] = ld<float>(stage + C::kASOff + (tok * C::kAScalesPerRow + (C::kG == 32 ? j : 0)) * 4);
      else
        as[c] = 1.0f;
    }
    if constexpr (C::kW == WeightFmt::kFp4 && kFp8Mma) {
      // fp4 in e4m3 holds value·2^-6: undo it on the partial (exact: a power of two on a normal fp32 sum), not on
      // the scale, whose 2^(b-127)·2^6 overflows fp32 for UE8M0 bytes 253 and 254 where the SPEC §1.6 value is
      // finite.
      STATIC_MOE_UNROLL
      for (int c = 0; c < 4; ++c) part[nt][c] *= kE2m1InE4m3Factor;
    }
    acc[nt][0] += part[nt][0] * (ws[0] * as[0]);
    acc[nt][1] += part[nt][1] * (ws[0] * as[1]);
    acc[nt][2] += part[nt][2] * (ws[1] * as[0]);
    acc[nt][3] += part[nt][3] * (ws[1] * as[1]);
    STATIC_MOE_UNROLL
    for (int c = 0; c < 4; ++c) part[nt][c] = 0.0f;
  }
}

// Writes the thread's accumulators as bf16 (round-to-nearest-even) into the epilogue tile [kBM][kBN]. SPEC §1.9:
// with `bias` (the expert's bias from this tile's first weight row; `n_left` weight rows remain), each output first
// gets bias[col], or tok_scale[tok] · bias[col] with `tok_scale` (one fp32 product), added in fp32 (_rn on the
// device: no FMA contraction, the host's rounding).
template <class C>
__host__ __device__ inline void store_acc(uint8_t* tile, int row, int t, const float (&acc)[kNT][4],
                                          const float* bias = nullptr, int64_t n_left = 0,
                                          const float* tok_scale = nullptr) {
  STATIC_MOE_UNROLL
  for (int nt = 0; nt < kNT; ++nt) {
    STATIC_MOE_UNROLL
    for (int c = 0; c < 4; ++c) {
      const int tok = 8 * nt + 2 * t + (c & 1);
      const int col = row + 8 * (c >> 1);
      float x = acc[nt][c];
      if (bias != nullptr && col < n_left) {
        const float b = tok_scale != nullptr ? mul_rn(tok_scale[tok], bias[col]) : bias[col];
        x = add_rn(x, b);
      }
      const uint16_t v = float_to_bf16_bits(x);
#ifdef __CUDA_ARCH__
      *reinterpret_cast<uint16_t*>(tile + tok * C::kOutStride + col * 2) = v;
#else
      std::memcpy(tile + tok * C::kOutStride + col * 2, &v, 2);
#endif
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Device-only parts: block-wide row selection for mask mode, and the kernel.
// ---------------------------------------------------------------------------------------------------------------
#ifdef __CUDACC__

__device__ inline int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Number of set bytes of mask[0, rows); every thread of the block gets it.
__device__ inline int block_count(const uint8_t* mask, int64_t rows, int* s_red) {
  int c = 0;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads) c += mask[r] != 0 ? 1 : 0;
  c = warp_sum(c);
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = c;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += s_red[w];
  __syncthreads();
  return total;
}

// rows_out[i] = index of the set row of rank lo + i (ranks count set rows in increasing row order), for the ranks
// that exist below lo + kBM. Stops scanning once those ranks are found.
__device__ inline void block_collect(const uint8_t* mask, int64_t rows, int lo, int* rows_out, int* s_red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int base = 0;
  for (int64_t c0 = 0; c0 < rows; c0 += kThreads) {
    const int64_t r = c0 + threadIdx.x;
    const bool f = r < rows && mask[r] != 0;
    const unsigned bal = __ballot_sync(0xffffffffu, f);
    if (lane == 0) s_red[warp] = __popc(bal);
    __syncthreads();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int n = s_red[w];
      before += w < warp ? n : 0;
      total += n;
    }
    const int rank = base + before + __popc(bal & ((1u << lane) - 1u));
    if (f && rank >= lo && rank < lo + kBM) rows_out[rank - lo] = static_cast<int>(r);
    base += total;
    __syncthreads();
    if (base >= lo + kBM) break;  // block-uniform
  }
}

// Zeros the D rows whose mask byte is 0, a row per block in turn, 16 bytes per store.
__device__ inline void zero_masked_rows(const ExpertGemmArgs& p) {
  const int64_t chunks = p.n / 8;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    if (p.row_mask[r] != 0) continue;  // block-uniform
    uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.d) + r * p.d_row_stride);
    for (int64_t c = threadIdx.x; c < chunks; c += kThreads) dst[c] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Persistent kernel: block b takes tiles b, b + grid, ...; tile = (m tile, n tile) with the n tile fastest, so
// blocks running together share an m tile (its activation rows stay in L2) and split its weights between them.
template <WeightFmt W, int G>
__global__ void __launch_bounds__(kThreads) expert_gemm_kernel(const ExpertGemmArgs p) {
  using C = Cfg<W, G>;
  constexpr bool kFp8Mma = C::kActFp8 && STATIC_MOE_HAS_FP8_MMA;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_arow[kBM];
  __shared__ int s_drow[kBM];
  __shared__ float s_bscale[kBM];  // list mode with bias_row_scale: the scale of each tile row's bias
  __shared__ int s_red[kWarps];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wrow = 16 * warp + g;
  const bool mask_mode = p.row_mask != nullptr;
  const int num_nt = static_cast<int>((p.n + kBN - 1) / kBN);
  const int num_kb = static_cast<int>(p.k / kBK);

  int mask_count = 0;
  int num_mt = 0;
  if (mask_mode) {
    mask_count = block_count(p.row_mask, p.rows, s_red);
    zero_masked_rows(p);
    num_mt = (mask_count + kBM - 1) / kBM;
  } else {
    const int n = *p.num_tiles;
    num_mt = n < p.max_tiles ? n : static_cast<int>(p.max_tiles);
  }
  const int total = num_mt * num_nt;

  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int mt = tile / num_nt;
    const int n0 = (tile % num_nt) * kBN;
    int expert = 0, count = 0;
    if (mask_mode) {
      expert = static_cast<int>(p.expert);
      count = min(kBM, mask_count - mt * kBM);
      block_collect(p.row_mask, p.rows, mt * kBM, s_arow, s_red);
    } else {
      const GemmTile tl = p.tiles[mt];
      expert = tl.expert;
      count = tl.count;
      if (tid < kBM) {
        const int i = tl.start + (tid < count ? tid : 0);
        s_arow[tid] = p.row_index != nullptr ? p.row_index[i] : i;
        s_drow[tid] = tl.start + tid;
        if (p.bias_row_scale != nullptr) s_bscale[tid] = p.bias_row_scale[i];
      }
    }
    __syncthreads();
    const int* d_rows = mask_mode ? s_arow : s_drow;

    const uint8_t* b_e = static_cast<const uint8_t*>(p.b) + expert * p.b_expert_stride;
    const uint8_t* bs_e = nullptr;
    if constexpr (W == WeightFmt::kFp8)
      bs_e = static_cast<const uint8_t*>(p.b_scale) + expert * p.b_scale_expert_stride * 4;
    else if constexpr (W == WeightFmt::kFp4)
      bs_e = static_cast<const uint8_t*>(p.b_scale) + expert * p.b_scale_expert_stride;

    float acc[kNT][4];
    float part[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[nt][c] = part[nt][c] = 0.0f;
    }
    const int nt_active = (count + 7) / 8;  // n-tiles holding real rows; the rest are zeros, skipped

#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
      if (s < num_kb) load_stage<C>(smem + s * C::kStageBytes, p, b_e, bs_e, n0, s_arow, count, s, tid, kThreads);
      cp_async_commit();
    }
    for (int kb = 0; kb < num_kb; ++kb) {
      cp_async_wait<C::kStages - 2>();
      __syncthreads();  // stage kb landed for every thread; stage kb - 1 is free again
      const int nk = kb + C::kStages - 1;
      if (nk < num_kb)
        load_stage<C>(smem + (nk % C::kStages) * C::kStageBytes, p, b_e, bs_e, n0, s_arow, count, nk, tid, kThreads);
      cp_async_commit();
      const uint8_t* st = smem + (kb % C::kStages) * C::kStageBytes;
#pragma unroll
      for (int j = 0; j < kSubs; ++j) {
        uint32_t wf[2][4];
        load_w_frag<C, kFp8Mma>(st, wrow, t, j, wf);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          if (nt < nt_active) {
            uint32_t af[4];
            load_a_frag<C, kFp8Mma>(st, 8 * nt + g, t, j, af);
#pragma unroll
            for (int s = 0; s < mma_steps(kFp8Mma); ++s) {
              uint32_t a[4], b[2];
              mma_operands(wf, af, s, a, b);
              float (&dst)[4] = C::kScaled ? part[nt] : acc[nt];
              if constexpr (kFp8Mma)
                mma_e4m3_16832(dst, a, b);
              else
                mma_bf16_16816(dst, a, b);
            }
          }
        }
        if constexpr (C::kScaled) {
          if ((j + 1) % C::kScaleSubs == 0) apply_scales<C, kFp8Mma>(st, wrow, t, j, part, acc);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: reuse them for the epilogue tile

    const float* bias_e = p.bias != nullptr ? p.bias + expert * p.bias_expert_stride + n0 : nullptr;
    store_acc<C>(smem, wrow, t, acc, bias_e, p.n - n0, !mask_mode && p.bias_row_scale != nullptr ? s_bscale : nullptr);
    __syncthreads();
    constexpr int kOutChunks = kBN * 2 / 16;
    for (int c = tid; c < kBM * kOutChunks; c += kThreads) {
      const int i = c / kOutChunks, q = c % kOutChunks;
      const int64_t col = n0 + q * 8;
      if (i < count && col < p.n) {
        const uint4 v = *reinterpret_cast<const uint4*>(smem + i * C::kOutStride + q * 16);
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.d) + static_cast<int64_t>(d_rows[i]) * p.d_row_stride +
                                  col) = v;
      }
    }
    __syncthreads();  // the next tile overwrites smem, s_arow and s_drow
  }
}

#endif  // __CUDACC__

}  // namespace gemm
}  // namespace cuda
}  // namespace static_moe
