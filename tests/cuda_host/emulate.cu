// CPU emulation of the CUDA kernels' per-thread code, for tests/test_cuda_host.py (no GPU needed).
//
// The stage loaders, fragment loaders, decoders, scale application and epilogue of csrc/cuda/moe_gemm.cuh are
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
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "cuda/moe_gemm.cuh"
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
  if (e == 15 && m == 7) v = NAN;
  else if (e == 0) v = std::ldexp(m / 8.0, -6);
  else v = std::ldexp(1.0 + m / 8.0, e - 7);
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
// The expert GEMM, mask mode: the kernel's tile loop with one thread block emulated thread by thread.
// ---------------------------------------------------------------------------------------------------------------
struct GemmProblem {
  int64_t rows = 0, k = 0, n = 0, experts = 0, expert = 0;
  int group = 0;
  std::vector<uint8_t> a, a_scale, b, b_scale, mask;
};

template <WeightFmt W, int G, bool kFp8Mma>
std::vector<uint16_t> run_gemm(const GemmProblem& pr) {
  using C = gemm::Cfg<W, G>;
  using gemm::kBM;
  using gemm::kBN;
  using gemm::kNT;
  MoeGemmArgs p;
  p.a = pr.a.data();
  p.a_row_stride = pr.k;
  p.a_group = G;
  p.a_scale = G ? reinterpret_cast<const float*>(pr.a_scale.data()) : nullptr;
  p.a_scale_row_stride = G ? pr.k / G : 0;
  p.b_fmt = W;
  p.b = pr.b.data();
  const int64_t row_bytes = W == WeightFmt::kBf16 ? 2 * pr.k : (W == WeightFmt::kFp8 ? pr.k : pr.k / 2);
  p.b_row_stride = row_bytes;
  p.b_expert_stride = row_bytes * pr.n;
  p.b_scale = pr.b_scale.data();
  p.b_scale_row_stride = W == WeightFmt::kFp8 ? pr.k / 128 : pr.k / 32;
  p.b_scale_expert_stride = p.b_scale_row_stride * pr.n;
  p.n = pr.n;
  p.k = pr.k;
  p.row_mask = pr.mask.data();
  p.rows = pr.rows;
  p.expert = pr.expert;
  std::vector<uint16_t> d(static_cast<size_t>(pr.rows * pr.n), 0);
  std::vector<int> active;
  for (int64_t r = 0; r < pr.rows; ++r)
    if (pr.mask[r]) active.push_back(static_cast<int>(r));

  std::vector<uint8_t> stage(static_cast<size_t>(C::kSmemBytes), 0xAB);  // poison: the loaders must fill it all
  const uint8_t* b_e = static_cast<const uint8_t*>(p.b) + pr.expert * p.b_expert_stride;
  const uint8_t* bs_e = nullptr;
  if (W == WeightFmt::kFp8) bs_e = pr.b_scale.data() + pr.expert * p.b_scale_expert_stride * 4;
  if (W == WeightFmt::kFp4) bs_e = pr.b_scale.data() + pr.expert * p.b_scale_expert_stride;
  const int num_kb = static_cast<int>(pr.k / gemm::kBK);

  for (size_t m0 = 0; m0 < active.size(); m0 += kBM) {
    const int count = static_cast<int>(std::min<size_t>(kBM, active.size() - m0));
    int rows[kBM] = {};
    for (int i = 0; i < count; ++i) rows[i] = active[m0 + i];
    const int nt_active = (count + 7) / 8;
    for (int64_t n0 = 0; n0 < pr.n; n0 += kBN) {
      static float acc[gemm::kWarps][32][kNT][4], part[gemm::kWarps][32][kNT][4];
      std::memset(acc, 0, sizeof acc);
      std::memset(part, 0, sizeof part);
      for (int kb = 0; kb < num_kb; ++kb) {
        gemm::load_stage<C>(stage.data(), p, b_e, bs_e, static_cast<int>(n0), rows, count, kb, 0, 1);
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
      for (int w = 0; w < gemm::kWarps; ++w)
        for (int lane = 0; lane < 32; ++lane) gemm::store_acc<C>(stage.data(), 16 * w + lane / 4, lane % 4, acc[w][lane]);
      for (int i = 0; i < count; ++i)
        for (int64_t c = 0; c < kBN && n0 + c < pr.n; ++c)
          std::memcpy(&d[rows[i] * pr.n + n0 + c], stage.data() + i * C::kOutStride + c * 2, 2);
    }
  }
  return d;
}

int cmd_gemm(const std::string& dir) {
  auto meta = read_meta(dir);
  GemmProblem pr;
  pr.rows = static_cast<int64_t>(meta["rows"]);
  pr.k = static_cast<int64_t>(meta["k"]);
  pr.n = static_cast<int64_t>(meta["n"]);
  pr.experts = static_cast<int64_t>(meta["experts"]);
  pr.expert = static_cast<int64_t>(meta["expert"]);
  pr.group = static_cast<int>(meta["group"]);
  const int wfmt = static_cast<int>(meta["wfmt"]);
  const bool fp8_mma = meta["fp8_mma"] != 0;
  pr.a = read_file(dir + "/a.bin");
  pr.a_scale = read_file(dir + "/a_scale.bin");
  pr.b = read_file(dir + "/b.bin");
  pr.b_scale = read_file(dir + "/b_scale.bin");
  pr.mask = read_file(dir + "/mask.bin");
  std::vector<uint16_t> d;
  const int g = pr.group;
  if (wfmt == 0) d = run_gemm<WeightFmt::kBf16, 0, false>(pr);
  else if (wfmt == 1 && g == 0) d = run_gemm<WeightFmt::kFp8, 0, false>(pr);
  else if (wfmt == 2 && g == 0) d = run_gemm<WeightFmt::kFp4, 0, false>(pr);
  else if (wfmt == 1 && g == 32) d = fp8_mma ? run_gemm<WeightFmt::kFp8, 32, true>(pr) : run_gemm<WeightFmt::kFp8, 32, false>(pr);
  else if (wfmt == 1 && g == 128) d = fp8_mma ? run_gemm<WeightFmt::kFp8, 128, true>(pr) : run_gemm<WeightFmt::kFp8, 128, false>(pr);
  else if (wfmt == 2 && g == 32) d = fp8_mma ? run_gemm<WeightFmt::kFp4, 32, true>(pr) : run_gemm<WeightFmt::kFp4, 32, false>(pr);
  else if (wfmt == 2 && g == 128) d = fp8_mma ? run_gemm<WeightFmt::kFp4, 128, true>(pr) : run_gemm<WeightFmt::kFp4, 128, false>(pr);
  else {
    std::fprintf(stderr, "bad format pair wfmt=%d group=%d\n", wfmt, g);
    return 3;
  }
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
// swiglu_and_cast: the kernel's per-lane row code, emulated with 32 lanes per warp.
// ---------------------------------------------------------------------------------------------------------------
int cmd_swiglu(const std::string& dir) {
  auto meta = read_meta(dir);
  const int64_t rows = static_cast<int64_t>(meta["rows"]), inter = static_cast<int64_t>(meta["inter"]);
  const bool out_fp8 = meta["out_fp8"] != 0, has_limit = meta["has_limit"] != 0, has_weight = meta["has_weight"] != 0;
  const bool pow2 = meta["pow2"] != 0;
  const int group = static_cast<int>(meta["group"]);
  const float limit = static_cast<float>(meta["limit"]), fp8_max = static_cast<float>(meta["fp8_max"]);
  const std::vector<uint8_t> gu = read_file(dir + "/gate_up.bin"), wt = read_file(dir + "/weight.bin");
  const float* g = reinterpret_cast<const float*>(gu.data());
  const float* w = has_weight ? reinterpret_cast<const float*>(wt.data()) : nullptr;
  std::vector<uint8_t> q(static_cast<size_t>(rows * inter * (out_fp8 ? 1 : 2)));
  std::vector<float> s(static_cast<size_t>(out_fp8 ? rows * (inter / group) : 0));
  const int chunk = out_fp8 ? group : 128;
  for (int64_t r = 0; r < rows; ++r) {
    const float rw = w ? w[r] : 1.0f;
    for (int64_t c0 = 0; c0 < inter; c0 += chunk) {
      // lanes: each holds elements c0 + lane + 32 e
      const int epl = chunk / 32;
      float v[32][4] = {};
      uint32_t m = 0;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < epl; ++e) {
          const int64_t col = c0 + lane + 32 * e;
          if (col >= inter) continue;
          v[lane][e] = swiglu_value(g[r * 2 * inter + col], g[r * 2 * inter + inter + col], rw, has_limit, limit);
          const uint32_t a = f32_bits(v[lane][e]) & 0x7FFFFFFFu;
          m = a > m ? a : m;
        }
      if (!out_fp8) {
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < epl; ++e) {
            const int64_t col = c0 + lane + 32 * e;
            if (col >= inter) continue;
            const uint16_t b = float_to_bf16_bits(v[lane][e]);
            std::memcpy(q.data() + 2 * (r * inter + col), &b, 2);
          }
        continue;
      }
      const float sc = group_scale(m, fp8_max, pow2);
      s[r * (inter / group) + c0 / group] = sc;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < epl; ++e) q[r * inter + c0 + lane + 32 * e] = quantize_e4m3(v[lane][e], sc, fp8_max);
    }
  }
  write_file(dir + "/q.bin", q.data(), q.size());
  write_file(dir + "/s.bin", s.data(), s.size() * 4);
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
  std::fprintf(stderr, "unknown command %s\n", cmd.c_str());
  return 2;
}
