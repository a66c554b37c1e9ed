// CPU emulation of the CUDA kernels' per-thread code, for tests/cuda/test_cuda_host.py (no GPU needed).
//
// The stage loaders, fragment loaders, decoders, scale application and epilogue of csrc/cuda/expert_gemm.cuh are
// __host__ __device__: this program runs them for every thread of a CTA, and replaces the two things only a GPU
// does (mma.sync across 32 lanes, cp.async) by an emulation written from the PTX fragment layouts, independently
// of the kernel's own code. The Python side feeds inputs and compares the outputs with the reference ops.
//
// Usage:
//   emulate numerics <dir>   writes the decoder / encoder tables (see write_numerics) into <dir>
//   emulate gemm <dir>       reads meta.txt + a.bin, a_scale.bin, b.bin, b_scale.bin, mask.bin from <dir>,
//                            emulates the expert GEMM in mask mode, writes d.bin (bf16 [R, N])
//   emulate swiglu <dir>     reads meta.txt + gate_up.bin (fp32 [R, 2I]) and weight.bin (fp32 [R]), runs the
//                            swiglu_and_cast row code, writes q.bin and s.bin
//   emulate local_experts <dir>  reads meta.txt + x, x_scale, idx, weights, w13(_scale), w2(_scale) .bin, runs
//                            route, GEMM1, swiglu, GEMM2, combine over a workspace, writes out.bin (fp32 [R, H])
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <algorithm>

#include "cuda/local_experts.cuh"
#include "cuda/expert_gemm.cuh"
#include "cuda/numerics.cuh"
#include "cuda/swiglu_and_cast.cuh"

using namespace static_moe::cuda;

namespace {

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return {};
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(2);
  }
}

std::map<std::string, double> read_meta(const std::string& dir) {
  std::map<std::string, double> m;
  std::ifstream f(dir + "/meta.txt");
  std::string k;
  double v;
  while (f >> k >> v) m[k] = v;
  return m;
}

// ---------------------------------------------------------------------------------------------------------------
// Independent decoders (not the kernel's) and the warp MMA, from the PTX ISA fragment layouts.
// ---------------------------------------------------------------------------------------------------------------
double e4m3_value(uint32_t b) {
  const int s = (b >> 7) & 1, e = (b >> 3) & 15, m = b & 7;
  double v;
  if (e == 15 && m == 7)
    v = NAN;
  else if (e == 0)
    v = std::ldexp(m / 8.0, -6);
  else
    v = std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}

double bf16_value(uint32_t h) {
  const uint32_t u = (h & 0xFFFFu) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// d[lane] += A·B for m16n8k16 (bf16) or m16n8k32 (e4m3), fragments given per lane.
void warp_mma(bool e4m3, float (*d)[4], const uint32_t (*a)[4], const uint32_t (*b)[2]) {
  double A[16][32] = {}, B[32][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    if (!e4m3) {
      for (int i = 0; i < 2; ++i) {
        A[g][2 * t + i] = bf16_value(a[lane][0] >> (16 * i));
        A[g + 8][2 * t + i] = bf16_value(a[lane][1] >> (16 * i));
        A[g][2 * t + 8 + i] = bf16_value(a[lane][2] >> (16 * i));
        A[g + 8][2 * t + 8 + i] = bf16_value(a[lane][3] >> (16 * i));
        B[2 * t + i][g] = bf16_value(b[lane][0] >> (16 * i));
        B[2 * t + 8 + i][g] = bf16_value(b[lane][1] >> (16 * i));
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        A[g][4 * t + i] = e4m3_value((a[lane][0] >> (8 * i)) & 0xFF);
        A[g + 8][4 * t + i] = e4m3_value((a[lane][1] >> (8 * i)) & 0xFF);
        A[g][4 * t + 16 + i] = e4m3_value((a[lane][2] >> (8 * i)) & 0xFF);
        A[g + 8][4 * t + 16 + i] = e4m3_value((a[lane][3] >> (8 * i)) & 0xFF);
        B[4 * t + i][g] = e4m3_value((b[lane][0] >> (8 * i)) & 0xFF);
        B[4 * t + 16 + i][g] = e4m3_value((b[lane][1] >> (8 * i)) & 0xFF);
      }
    }
  }
  const int kk = e4m3 ? 32 : 16;
  double D[16][8] = {};
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < kk; ++k) D[m][n] += A[m][k] * B[k][n];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    d[lane][0] = static_cast<float>(d[lane][0] + D[g][2 * t]);
    d[lane][1] = static_cast<float>(d[lane][1] + D[g][2 * t + 1]);
    d[lane][2] = static_cast<float>(d[lane][2] + D[g + 8][2 * t]);
    d[lane][3] = static_cast<float>(d[lane][3] + D[g + 8][2 * t + 1]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The expert GEMM: the kernel's tile loop (expert_gemm_kernel) with each thread block emulated thread by thread, in
// mask mode or list mode as the arguments say. Only the block-wide glue (row scans, waits, barriers) is rewritten.
// ---------------------------------------------------------------------------------------------------------------
template <WeightFmt W, int G, bool kFp8Mma>
void emulate_gemm_cfg(const ExpertGemmArgs& p) {
  using C = gemm::Cfg<W, G>;
  using gemm::kBM;
  using gemm::kBN;
  using gemm::kNT;
  struct Tile {
    int expert, count;
    int a_rows[kBM], d_rows[kBM];
  };
  std::vector<Tile> tiles;
  if (p.row_mask != nullptr) {
    std::vector<int> active;
    for (int64_t r = 0; r < p.rows; ++r) {
      if (p.row_mask[r])
        active.push_back(static_cast<int>(r));
      else
        std::memset(static_cast<uint16_t*>(p.d) + r * p.d_row_stride, 0, p.n * 2);
    }
    for (size_t m0 = 0; m0 < active.size(); m0 += kBM) {
      Tile t{static_cast<int>(p.expert), static_cast<int>(std::min<size_t>(kBM, active.size() - m0)), {}, {}};
      for (int i = 0; i < t.count; ++i) t.a_rows[i] = t.d_rows[i] = active[m0 + i];
      tiles.push_back(t);
    }
  } else {
    const int n = std::min<int64_t>(*p.num_tiles, p.max_tiles);
    for (int mt = 0; mt < n; ++mt) {
      const GemmTile g = p.tiles[mt];
      Tile t{g.expert, g.count, {}, {}};
      for (int i = 0; i < g.count; ++i) {
        t.a_rows[i] = p.row_index ? p.row_index[g.start + i] : g.start + i;
        t.d_rows[i] = g.start + i;
      }
      tiles.push_back(t);
    }
  }

  std::vector<uint8_t> stage(static_cast<size_t>(C::kSmemBytes));
  const int num_kb = static_cast<int>(p.k / gemm::kBK);
  for (const Tile& tl : tiles) {
    const uint8_t* b_e = static_cast<const uint8_t*>(p.b) + tl.expert * p.b_expert_stride;
    const uint8_t* bs_e = nullptr;
    if (W == WeightFmt::kFp8) bs_e = static_cast<const uint8_t*>(p.b_scale) + tl.expert * p.b_scale_expert_stride * 4;
    if (W == WeightFmt::kFp4) bs_e = static_cast<const uint8_t*>(p.b_scale) + tl.expert * p.b_scale_expert_stride;
    const int nt_active = (tl.count + 7) / 8;
    for (int64_t n0 = 0; n0 < p.n; n0 += kBN) {
      static float acc[gemm::kWarps][32][kNT][4], part[gemm::kWarps][32][kNT][4];
      std::memset(acc, 0, sizeof acc);
      std::memset(part, 0, sizeof part);
      for (int kb = 0; kb < num_kb; ++kb) {
        std::memset(stage.data(), 0xAB, stage.size());  // poison: the loaders must fill what is read
        gemm::load_stage<C>(stage.data(), p, b_e, bs_e, static_cast<int>(n0), tl.a_rows, tl.count, kb, 0, 1);
        for (int j = 0; j < gemm::kSubs; ++j) {
          for (int w = 0; w < gemm::kWarps; ++w) {
            uint32_t wf[32][2][4];
            for (int lane = 0; lane < 32; ++lane)
              gemm::load_w_frag<C, kFp8Mma>(stage.data(), 16 * w + lane / 4, lane % 4, j, wf[lane]);
            for (int nt = 0; nt < nt_active; ++nt) {
              uint32_t af[32][4];
              for (int lane = 0; lane < 32; ++lane)
                gemm::load_a_frag<C, kFp8Mma>(stage.data(), 8 * nt + lane / 4, lane % 4, j, af[lane]);
              for (int s = 0; s < gemm::mma_steps(kFp8Mma); ++s) {
                uint32_t a[32][4], b[32][2];
                float dst[32][4];
                for (int lane = 0; lane < 32; ++lane) {
                  gemm::mma_operands(wf[lane], af[lane], s, a[lane], b[lane]);
                  for (int c = 0; c < 4; ++c) dst[lane][c] = C::kScaled ? part[w][lane][nt][c] : acc[w][lane][nt][c];
                }
                warp_mma(kFp8Mma, dst, a, b);
                for (int lane = 0; lane < 32; ++lane)
                  for (int c = 0; c < 4; ++c) (C::kScaled ? part[w][lane][nt][c] : acc[w][lane][nt][c]) = dst[lane][c];
              }
            }
            if (C::kScaled && (j + 1) % C::kScaleSubs == 0)
              for (int lane = 0; lane < 32; ++lane)
                gemm::apply_scales<C, kFp8Mma>(stage.data(), 16 * w + lane / 4, lane % 4, j, part[w][lane],
                                               acc[w][lane]);
          }
        }
      }
      // The bias epilogue as the kernel wires it: the expert's bias from weight row n0; in list mode each tile
      // row's scale is bias_row_scale of its D row.
      const float* bias_e = p.bias ? p.bias + tl.expert * p.bias_expert_stride + n0 : nullptr;
      float tok_scale[kBM] = {};
      const bool scaled = p.row_mask == nullptr && p.bias_row_scale != nullptr;
      for (int i = 0; scaled && i < kBM; ++i) tok_scale[i] = p.bias_row_scale[tl.d_rows[i < tl.count ? i : 0]];
      for (int w = 0; w < gemm::kWarps; ++w)
        for (int lane = 0; lane < 32; ++lane)
          gemm::store_acc<C>(stage.data(), 16 * w + lane / 4, lane % 4, acc[w][lane], bias_e, p.n - n0,
                             scaled ? tok_scale : nullptr);
      for (int i = 0; i < tl.count; ++i)
        for (int64_t c = 0; c < kBN && n0 + c < p.n; ++c)
          std::memcpy(static_cast<uint16_t*>(p.d) + tl.d_rows[i] * p.d_row_stride + n0 + c,
                      stage.data() + i * C::kOutStride + c * 2, 2);
    }
  }
}

void emulate_gemm(const ExpertGemmArgs& p, bool fp8_mma) {
  const int g = p.a_group;
  switch (p.b_fmt) {
    case WeightFmt::kBf16:
      return emulate_gemm_cfg<WeightFmt::kBf16, 0, false>(p);
    case WeightFmt::kFp8:
      if (g == 0) return emulate_gemm_cfg<WeightFmt::kFp8, 0, false>(p);
      if (g == 32)
        return fp8_mma ? emulate_gemm_cfg<WeightFmt::kFp8, 32, true>(p)
                       : emulate_gemm_cfg<WeightFmt::kFp8, 32, false>(p);
      return fp8_mma ? emulate_gemm_cfg<WeightFmt::kFp8, 128, true>(p)
                     : emulate_gemm_cfg<WeightFmt::kFp8, 128, false>(p);
    case WeightFmt::kFp4:
      if (g == 0) return emulate_gemm_cfg<WeightFmt::kFp4, 0, false>(p);
      if (g == 32)
        return fp8_mma ? emulate_gemm_cfg<WeightFmt::kFp4, 32, true>(p)
                       : emulate_gemm_cfg<WeightFmt::kFp4, 32, false>(p);
      return fp8_mma ? emulate_gemm_cfg<WeightFmt::kFp4, 128, true>(p)
                     : emulate_gemm_cfg<WeightFmt::kFp4, 128, false>(p);
  }
}

// Weight arguments of ExpertGemmArgs for contiguous [L, N, K] weights (fp4: K/2 bytes per row) and scales.
void set_weights(ExpertGemmArgs& p, WeightFmt f, const uint8_t* b, const uint8_t* bs, int64_t n, int64_t k) {
  p.b_fmt = f;
  p.b = b;
  p.b_row_stride = f == WeightFmt::kBf16 ? 2 * k : (f == WeightFmt::kFp8 ? k : k / 2);
  p.b_expert_stride = p.b_row_stride * n;
  p.b_scale = bs;
  p.b_scale_row_stride = f == WeightFmt::kFp8 ? k / 128 : k / 32;
  p.b_scale_expert_stride = p.b_scale_row_stride * n;
}

int cmd_gemm(const std::string& dir) {
  auto meta = read_meta(dir);
  const int64_t rows = static_cast<int64_t>(meta["rows"]), k = static_cast<int64_t>(meta["k"]);
  const int64_t n = static_cast<int64_t>(meta["n"]);
  const int group = static_cast<int>(meta["group"]);
  const std::vector<uint8_t> a = read_file(dir + "/a.bin"), as = read_file(dir + "/a_scale.bin");
  const std::vector<uint8_t> b = read_file(dir + "/b.bin"), bs = read_file(dir + "/b_scale.bin");
  const std::vector<uint8_t> mask = read_file(dir + "/mask.bin");
  const std::vector<uint8_t> bias = meta["has_bias"] != 0 ? read_file(dir + "/bias.bin") : std::vector<uint8_t>();
  std::vector<uint16_t> d(static_cast<size_t>(rows * n), 0x7FC0);  // NaN: every row must be written
  ExpertGemmArgs p;
  p.a = a.data();
  p.a_row_stride = k;
  p.a_group = group;
  p.a_scale = group ? reinterpret_cast<const float*>(as.data()) : nullptr;
  p.a_scale_row_stride = group ? k / group : 0;
  set_weights(p, static_cast<WeightFmt>(static_cast<int>(meta["wfmt"])), b.data(), bs.data(), n, k);
  p.n = n;
  p.k = k;
  p.d = d.data();
  p.d_row_stride = n;
  p.row_mask = mask.data();
  p.rows = rows;
  p.expert = static_cast<int64_t>(meta["expert"]);
  p.bias = bias.empty() ? nullptr : reinterpret_cast<const float*>(bias.data());
  p.bias_expert_stride = n;
  emulate_gemm(p, meta["fp8_mma"] != 0);
  write_file(dir + "/d.bin", d.data(), d.size() * 2);
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Numerics tables.
//   e4m3_bf16.bin   uint16 [256]: e4m3x2_to_bf16x2 of each code (as the low element)
//   e2m1_bf16.bin   uint16 [16]:  e2m1_to_bf16_bits
//   fp4_bf16.bin    uint16 [256 * 2]: e2m1x8_to_bf16x8 of byte b repeated in all 4 bytes (elements 0, 1)
//   fp4_e4m3.bin    uint8 [256 * 8]: e2m1x8_to_e4m3x8_scaled of the word (b, b+1, b+2, b+3 mod 256)
//   ue8m0.bin       float [256]
//   f32_in.bin (input) float [n] -> f32_e4m3.bin uint8 [n], f32_bf16.bin uint16 [n], f32_pow2.bin float [n]
// ---------------------------------------------------------------------------------------------------------------
int cmd_numerics(const std::string& dir) {
  std::vector<uint16_t> e4(256), e2(16), f4b(512);
  std::vector<uint8_t> f4e(256 * 8);
  std::vector<float> ue(256);
  for (uint32_t c = 0; c < 256; ++c) {
    e4[c] = static_cast<uint16_t>(e4m3x2_to_bf16x2(c | (c << 8)) & 0xFFFFu);
    const uint32_t hi = e4m3x2_to_bf16x2(c | (c << 8)) >> 16;
    if (hi != e4[c]) {
      std::fprintf(stderr, "e4m3x2_to_bf16x2: lanes disagree for code %u\n", c);
      return 4;
    }
    uint32_t r[4];
    e2m1x8_to_bf16x8(c * 0x01010101u, r);
    f4b[2 * c] = static_cast<uint16_t>(r[0] & 0xFFFF);
    f4b[2 * c + 1] = static_cast<uint16_t>(r[0] >> 16);
    for (int i = 1; i < 4; ++i)
      if (r[i] != r[0]) {
        std::fprintf(stderr, "e2m1x8_to_bf16x8: byte lanes disagree for byte %u\n", c);
        return 4;
      }
    const uint32_t word = c | (((c + 1) & 0xFF) << 8) | (((c + 2) & 0xFF) << 16) | (((c + 3) & 0xFF) << 24);
    uint32_t lo, hi2;
    e2m1x8_to_e4m3x8_scaled(word, lo, hi2);
    for (int i = 0; i < 4; ++i) {
      f4e[8 * c + i] = static_cast<uint8_t>(lo >> (8 * i));
      f4e[8 * c + 4 + i] = static_cast<uint8_t>(hi2 >> (8 * i));
    }
    ue[c] = ue8m0_to_float(c);
  }
  for (uint32_t c = 0; c < 16; ++c) e2[c] = static_cast<uint16_t>(e2m1_to_bf16_bits(c));
  write_file(dir + "/e4m3_bf16.bin", e4.data(), 512);
  write_file(dir + "/e2m1_bf16.bin", e2.data(), 32);
  write_file(dir + "/fp4_bf16.bin", f4b.data(), 1024);
  write_file(dir + "/fp4_e4m3.bin", f4e.data(), f4e.size());
  write_file(dir + "/ue8m0.bin", ue.data(), 1024);
  const std::vector<uint8_t> in = read_file(dir + "/f32_in.bin");
  const size_t n = in.size() / 4;
  std::vector<uint8_t> q(n);
  std::vector<uint16_t> bf(n);
  std::vector<float> p2(n);
  for (size_t i = 0; i < n; ++i) {
    float f;
    std::memcpy(&f, in.data() + 4 * i, 4);
    q[i] = float_to_e4m3(f);
    bf[i] = float_to_bf16_bits(f);
    p2[i] = round_up_pow2(f);
  }
  write_file(dir + "/f32_e4m3.bin", q.data(), n);
  write_file(dir + "/f32_bf16.bin", bf.data(), 2 * n);
  write_file(dir + "/f32_pow2.bin", p2.data(), 4 * n);
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// swiglu_and_cast: the kernel's unit loop (swiglu_kernel) with 32 lanes per warp, over SwigluArgs.
// ---------------------------------------------------------------------------------------------------------------
void emulate_swiglu(const SwigluArgs& a) {
  const int epl = (!a.out_fp8 || a.group == 128) ? 4 : 1;
  const int64_t chunk = 32 * epl;
  const int64_t rows = a.rows_dev ? std::min<int64_t>(a.rows, *a.rows_dev) : a.rows;
  for (int64_t r = 0; r < rows; ++r) {
    float w = 1.0f;
    if (a.row_weight)
      w = a.row_weight_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(a.row_weight)[r])
                            : static_cast<const float*>(a.row_weight)[r];
    for (int64_t c0 = 0; c0 < a.inter; c0 += chunk) {
      float v[32][4] = {};
      uint32_t m = 0;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < epl; ++e) {
          const int64_t col = c0 + lane + 32 * e;
          if (col >= a.inter) continue;
          const int64_t i0 = r * a.gate_up_row_stride + col, i1 = i0 + a.inter;
          float g, u;
          if (a.gate_up_bf16) {
            g = bf16_bits_to_float(static_cast<const uint16_t*>(a.gate_up)[i0]);
            u = bf16_bits_to_float(static_cast<const uint16_t*>(a.gate_up)[i1]);
          } else {
            g = static_cast<const float*>(a.gate_up)[i0];
            u = static_cast<const float*>(a.gate_up)[i1];
          }
          v[lane][e] = swiglu_value(g, u, w, a.has_limit, a.limit, static_cast<Act>(a.act), a.alpha);
          const uint32_t bits = f32_bits(v[lane][e]) & 0x7FFFFFFFu;
          m = bits > m ? bits : m;
        }
      if (!a.out_fp8) {
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < epl; ++e) {
            const int64_t col = c0 + lane + 32 * e;
            if (col < a.inter)
              static_cast<uint16_t*>(a.out)[r * a.out_row_stride + col] = float_to_bf16_bits(v[lane][e]);
          }
        continue;
      }
      const float sc = group_scale(m, a.fp8_max, a.pow2_scale);
      a.scale[r * a.scale_row_stride + c0 / chunk] = sc;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < epl; ++e)
          static_cast<uint8_t*>(a.out)[r * a.out_row_stride + c0 + lane + 32 * e] =
              quantize_e4m3(v[lane][e], sc, a.fp8_max);
    }
  }
}

int cmd_swiglu(const std::string& dir) {
  auto meta = read_meta(dir);
  const int64_t rows = static_cast<int64_t>(meta["rows"]), inter = static_cast<int64_t>(meta["inter"]);
  const std::vector<uint8_t> gu = read_file(dir + "/gate_up.bin"), wt = read_file(dir + "/weight.bin");
  SwigluArgs a;
  a.gate_up = gu.data();
  a.gate_up_bf16 = false;
  a.gate_up_row_stride = 2 * inter;
  a.rows = rows;
  a.inter = inter;
  a.row_weight = meta["has_weight"] != 0 ? wt.data() : nullptr;
  a.has_limit = meta["has_limit"] != 0;
  a.limit = static_cast<float>(meta["limit"]);
  a.out_fp8 = meta["out_fp8"] != 0;
  a.group = static_cast<int>(meta["group"]);
  a.fp8_max = static_cast<float>(meta["fp8_max"]);
  a.pow2_scale = meta["pow2"] != 0;
  a.act = static_cast<int>(meta["act"]);
  a.alpha = meta.count("alpha") ? static_cast<float>(meta["alpha"]) : 1.702f;
  std::vector<uint8_t> q(static_cast<size_t>(rows * inter * (a.out_fp8 ? 1 : 2)));
  std::vector<float> s(static_cast<size_t>(a.out_fp8 ? rows * (inter / a.group) : 0));
  a.out = q.data();
  a.out_row_stride = inter;
  a.scale = s.data();
  a.scale_row_stride = a.out_fp8 ? inter / a.group : 0;
  emulate_swiglu(a);
  write_file(dir + "/q.bin", q.data(), q.size());
  write_file(dir + "/s.bin", s.data(), s.size() * 4);
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// local_experts: the five stages over a workspace laid out by local_experts_layout, wired by the same le_*_args
// helpers as the launcher. The route's block-wide glue is rewritten sequentially (one valid pair order).
// ---------------------------------------------------------------------------------------------------------------
template <typename IdxT, bool kBf16W>
void emulate_route(const RouteArgs& r) {
  for (int64_t e = 0; e < r.num_local; ++e) r.cursor[e] = 0;
  for (int64_t row = 0; row < r.rows; ++row)
    for (int64_t j = 0; j < r.topk; ++j) {
      int64_t id;
      const int64_t e = first_local_expert<IdxT>(r, row, j, &id);
      if (e >= 0) ++r.cursor[e];
    }
  int p0 = 0, t0 = 0;
  for (int64_t e = 0; e < r.num_local; ++e) {
    const int c = r.cursor[e];
    t0 += write_expert_tiles(r.tiles, t0, static_cast<int>(e), p0, c);
    r.cursor[e] = p0;
    p0 += c;
  }
  r.counters[0] = p0;
  r.counters[1] = t0;
  for (int64_t row = 0; row < r.rows; ++row)
    for (int64_t j = 0; j < r.topk; ++j) {
      int64_t id;
      const int64_t e = first_local_expert<IdxT>(r, row, j, &id);
      int pos = -1;
      if (e >= 0) {
        pos = r.cursor[e]++;
        r.pair_row[pos] = static_cast<int>(row);
        r.pair_w[pos] = routed_weight<IdxT, kBf16W>(r, row, j, id);
      }
      r.slot_pos[row * r.topk + j] = pos;
      r.slot_e[row * r.topk + j] = static_cast<int>(e);
    }
}

int cmd_local_experts(const std::string& dir) {
  auto meta = read_meta(dir);
  LocalExpertsArgs a;
  a.rows = static_cast<int64_t>(meta["rows"]);
  a.topk = static_cast<int64_t>(meta["topk"]);
  a.expert_offset = static_cast<int64_t>(meta["offset"]);
  a.num_local = static_cast<int64_t>(meta["num_local"]);
  a.hidden = static_cast<int64_t>(meta["hidden"]);
  a.inter = static_cast<int64_t>(meta["inter"]);
  a.x_group = static_cast<int>(meta["group"]);
  a.w_fmt = static_cast<WeightFmt>(static_cast<int>(meta["wfmt"]));
  a.idx_int64 = meta["idx_int64"] != 0;
  a.has_limit = meta["has_limit"] != 0;
  a.limit = static_cast<float>(meta["limit"]);
  a.fp8_max = static_cast<float>(meta["fp8_max"]);
  a.act = static_cast<int>(meta["act"]);
  a.alpha = meta.count("alpha") ? static_cast<float>(meta["alpha"]) : 1.702f;
  const bool fp8_mma = meta["fp8_mma"] != 0;
  const bool has_bias = meta["has_bias"] != 0;
  const std::vector<uint8_t> b13 = has_bias ? read_file(dir + "/w13_bias.bin") : std::vector<uint8_t>();
  const std::vector<uint8_t> b2 = has_bias ? read_file(dir + "/w2_bias.bin") : std::vector<uint8_t>();
  a.w13_bias = has_bias ? reinterpret_cast<const float*>(b13.data()) : nullptr;
  a.w2_bias = has_bias ? reinterpret_cast<const float*>(b2.data()) : nullptr;
  const std::vector<uint8_t> x = read_file(dir + "/x.bin"), xs = read_file(dir + "/x_scale.bin");
  const std::vector<uint8_t> idx = read_file(dir + "/idx.bin"), wts = read_file(dir + "/weights.bin");
  const std::vector<uint8_t> w13 = read_file(dir + "/w13.bin"), w13s = read_file(dir + "/w13_scale.bin");
  const std::vector<uint8_t> w2 = read_file(dir + "/w2.bin"), w2s = read_file(dir + "/w2_scale.bin");
  a.x = x.data();
  a.x_row_stride = a.hidden;
  a.x_scale = a.x_group ? reinterpret_cast<const float*>(xs.data()) : nullptr;
  a.x_scale_row_stride = a.x_group ? a.hidden / a.x_group : 0;
  a.topk_idx = idx.data();
  a.idx_row_stride = a.topk;
  a.topk_weights = wts.data();
  a.weights_row_stride = a.topk;
  ExpertGemmArgs w;
  set_weights(w, a.w_fmt, w13.data(), w13s.data(), 2 * a.inter, a.hidden);
  a.w13 = w.b;
  a.w13_expert_stride = w.b_expert_stride;
  a.w13_row_stride = w.b_row_stride;
  a.w13_scale = w.b_scale;
  a.w13_scale_expert_stride = w.b_scale_expert_stride;
  a.w13_scale_row_stride = w.b_scale_row_stride;
  set_weights(w, a.w_fmt, w2.data(), w2s.data(), a.hidden, a.inter);
  a.w2 = w.b;
  a.w2_expert_stride = w.b_expert_stride;
  a.w2_row_stride = w.b_row_stride;
  a.w2_scale = w.b_scale;
  a.w2_scale_expert_stride = w.b_scale_expert_stride;
  a.w2_scale_row_stride = w.b_scale_row_stride;
  std::vector<float> out(static_cast<size_t>(a.rows * a.hidden), NAN);
  a.out = out.data();

  const LocalExpertsLayout l = local_experts_layout(a.rows, a.topk, a.num_local, a.hidden, a.inter, a.x_group);
  std::vector<uint8_t> ws(static_cast<size_t>(l.bytes), 0xCD);  // poison
  const RouteArgs r = le_route_args(a, l, ws.data());
  a.weights_bf16 = meta["weights_bf16"] != 0;
  if (a.idx_int64)
    a.weights_bf16 ? emulate_route<int64_t, true>(r) : emulate_route<int64_t, false>(r);
  else
    a.weights_bf16 ? emulate_route<int32_t, true>(r) : emulate_route<int32_t, false>(r);
  emulate_gemm(le_gemm1_args(a, l, ws.data()), fp8_mma);
  emulate_swiglu(le_swiglu_args(a, l, ws.data()));
  emulate_gemm(le_gemm2_args(a, l, ws.data()), fp8_mma);
  const uint16_t* d = reinterpret_cast<const uint16_t*>(ws.data() + l.hd);
  for (int64_t row = 0; row < a.rows; ++row)
    for (int64_t col = 0; col < a.hidden; col += 8) {
      float acc[8];
      combine_row(d, a.hidden, r.slot_pos + row * a.topk, r.slot_e + row * a.topk, a.topk, col, acc);
      std::memcpy(out.data() + row * a.hidden + col, acc, sizeof acc);
    }
  write_file(dir + "/out.bin", out.data(), out.size() * 4);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s numerics|gemm|swiglu <dir>\n", argv[0]);
    return 2;
  }
  const std::string cmd = argv[1], dir = argv[2];
  if (cmd == "numerics") return cmd_numerics(dir);
  if (cmd == "gemm") return cmd_gemm(dir);
  if (cmd == "swiglu") return cmd_swiglu(dir);
  if (cmd == "local_experts") return cmd_local_experts(dir);
  std::fprintf(stderr, "unknown command %s\n", cmd.c_str());
  return 2;
}
