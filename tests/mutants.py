"""The mutant table of ``tests/mutate.py``: small, plausible bugs, one at a time, each with the tests that must
catch it. Every op (pack/unpack, swiglu_and_cast, expert_gemm, local_experts, forward), every CPU ISA level,
the shared casts, the workspace, the NKI kernels and the NKI interpreter.

A mutant replaces ``old`` (which must occur exactly once in ``file``) by ``new``. ``tests`` are pytest
arguments run from the repository root of the scratch copy; ``asan`` also runs the pack/unpack driver under
AddressSanitizer (for bugs no value comparison can see). Keep ``old`` long enough to be unique, and the test
selection as narrow as still kills the mutant (the whole table runs with one rebuild per C++ mutant).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    asan: bool = False
    why: str = ""


EG = "tests/ops/test_expert_gemm.py"
LE = "tests/ops/test_local_experts.py"
SW = "tests/ops/test_swiglu_and_cast.py"
PK = "tests/ops/test_pack_rows.py"
BL = "tests/ops/test_expert_gemm_blocking.py"
TE = "tests/integrations/test_transformers_experts.py"
TE_FILE = "python/static_moe/integrations/transformers_experts.py"
EDGE = "tests/ops/test_edge_cases.py"
QP = "tests/formats/test_quantiser_properties.py"
LIFE = "tests/layer/test_lifecycle_state.py"
VERDICT = "tests/layer/test_step_verdict.py"
CUDA_CASES = "tests/cuda/test_cuda_host_cases.py"
FMT = "python/static_moe/formats.py"
WS = "python/static_moe/workspace.py"
SS = "python/static_moe/ops/step_status.py"

MUTANTS = [
    # ---------------------------------------------------------------- local_experts (csrc/cpu/local_experts.cpp)
    Mutant(
        "local_experts: experts summed in decreasing id",
        "csrc/cpu/local_experts.cpp",
        "    for (int64_t e = 0; e < L; ++e) {\n      const int64_t b = rt.begin[e], m = rt.begin[e + 1] - b;",
        "    for (int64_t e = L - 1; e >= 0; --e) {\n      const int64_t b = rt.begin[e], m = rt.begin[e + 1] - b;",
        (LE, "-k", "summed_in_increasing"),
        why="SPEC §1.7 order; random inputs round the same either way",
    ),
    Mutant(
        "local_experts: kernel ignores fp8_max",
        "csrc/cpu/local_experts.cpp",
        "sp.fp8_max = static_cast<float>(fp8_max);",
        "sp.fp8_max = 448.0f;",
        (LE, "-k", "fp8_max_240"),
    ),
    Mutant(
        "local_experts: duplicate ids keep the last weight",
        "csrc/cpu/local_experts.cpp",
        "if (ip[r * k + jj] == id) w += wp[r * k + jj];",
        "if (ip[r * k + jj] == id) w = wp[r * k + jj];",
        (LE, "-k", "duplicates_and_other_ranks or matches_reference"),
    ),
    # ---------------------------------------------------------------- swiglu_and_cast (cpu/kernels/swiglu_and_cast.h)
    Mutant(
        "swiglu: NaN dropped from the amax",
        "csrc/cpu/kernels/swiglu_and_cast.h",
        "        m = a > m ? a : m;",
        "        m = (a > m && a <= 0x7F800000) ? a : m;",
        (SW, "-k", "nonfinite"),
    ),
    Mutant(
        "swiglu: kernel ignores fp8_max",
        "csrc/cpu/kernels/swiglu_and_cast.h",
        "    const float fmax = p.fp8_max;",
        "    const float fmax = 448.0f;",
        (SW, "-k", "matches_reference"),
    ),
    Mutant(
        "swiglu: up clamped from above only (bf16 input, the local_experts path)",
        "csrc/cpu/kernels/swiglu_and_cast.h",
        "      float u = bf16_to_float(u_row[i]);\n      if (kLimit) {\n        g = g > lim ? lim : g;\n"
        "        u = u > lim ? lim : (u < -lim ? -lim : u);",
        "      float u = bf16_to_float(u_row[i]);\n      if (kLimit) {\n        g = g > lim ? lim : g;\n"
        "        u = u > lim ? lim : u;",
        (SW, "-k", "matches_reference"),
    ),
    Mutant(
        "swiglu: routing weight not applied",
        "csrc/cpu/kernels/swiglu_and_cast.h",
        "  const float w = p.row_weight ? p.row_weight[r] : 1.0f;",
        "  const float w = 1.0f;",
        (SW, "-k", "matches_reference"),
    ),
    # ---------------------------------------------------------------- shared casts (csrc/cpu/kernels/cast.h)
    Mutant(
        "cast: bf16 rounds toward zero",
        "csrc/cpu/kernels/cast.h",
        "  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;",
        "  const uint32_t r = u >> 16;",
        (EG, "-k", "test_matches_reference"),
        why="every output within the loose bound; ~50 % of bits change",
    ),
    Mutant(
        "cast: e4m3fn ties round half up",
        "csrc/cpu/kernels/cast.h",
        "  const uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);",
        "  const uint32_t rounded = a + 0x80000u;",
        ("tests/formats/test_formats.py", "-k", "e4m3fn_encode"),
    ),
    # ---------------------------------------------------------------- expert GEMM, per ISA level
    Mutant(
        "scalar: fp4 decode drops the sign of even k",
        "csrc/cpu/kernels/expert_gemm_scalar.cpp",
        "    lo = kE2m1[q & 0xF] * *s;",
        "    lo = kE2m1[q & 0x7] * *s;",
        (EG, "-k", "test_matches_reference and scalar"),
    ),
    Mutant(
        "avx2: scale byte 254 decoded as 253",
        "csrc/cpu/kernels/expert_gemm_avx2.cpp",
        "      out[i] = ue8m0_to_float(s[i]);",
        "      out[i] = ue8m0_to_float(s[i] == 254 ? 253 : s[i]);",
        (EG, "-k", "extreme_scale_bytes_bitwise and avx2"),
        why="one scale byte on one ISA",
    ),
    Mutant(
        "avx512: scale byte 0 decoded as 2^-126",
        "csrc/cpu/kernels/expert_gemm_avx512.cpp",
        "_mm512_set1_epi32(0x00400000)",
        "_mm512_set1_epi32(0x00800000)",
        (EG, "-k", "extreme_scale_bytes_bitwise and avx512"),
        why="one scale byte on one ISA",
    ),
    Mutant(
        "avx512: fp8 NaN codes given the exponent of a finite fp16 number",
        "csrc/cpu/kernels/expert_gemm_avx512.cpp",
        "t = _mm512_mask_add_epi16(t, nan, t, _mm512_set1_epi16(0x4000));",
        "t = _mm512_mask_add_epi16(t, nan, t, _mm512_set1_epi16(0x3C00));",
        ("tests/ops/test_expert_gemm_codes.py", "-k", "weight_code and avx512 and not avx512bf16"),
        why="0x3F80 + 0x3C00 = 0x7B80: 61440, finite, where NaN is due",
    ),
    Mutant(
        "avx512bf16: fp4 table entry -6 reads -5",
        "csrc/cpu/kernels/bf16_units.h",
        "                                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,",
        "                                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0A0,",
        (EG, "-k", "test_matches_reference and avx512bf16"),
    ),
    Mutant(
        "avx512bf16: a block of fp8 weight rows of both kinds all on the fold path",
        "csrc/cpu/kernels/expert_gemm_avx512bf16.cpp",
        "  } else if (pow2 == 0) {\n    dot_columns<F, NR, MR, P, false>",
        "  } else if (pow2 != (1u << NR) - 1) {\n    dot_columns<F, NR, MR, P, false>",
        (BL, "-k", "own_path and avx512bf16"),
        why="the path must follow each row's own scales, not its block's: blocks differ by row count",
    ),
    Mutant(
        "avx512bf16: a 6-row fp8 panel's second fold half computes the first half's weight rows",
        "csrc/cpu/kernels/expert_gemm_avx512bf16.cpp",
        "dot_fp8_rows<kNRFp8, MR, P>(a, m, w, n + kNRFp8, out,",
        "dot_fp8_rows<kNRFp8, MR, P>(a, m, w, n, out,",
        (BL, "-k", "many_rows and avx512bf16"),
    ),
    Mutant(
        "avx512/avx2: the decoded panel's units summed from the last one",
        "csrc/cpu/kernels/expert_gemm_impl.h",
        "for (int64_t u = 0; u < len; u += W) {",
        "for (int64_t u = len - W; u >= 0; u -= W) {",
        (BL, "-k", "own_path and (avx2 or (avx512 and not avx512bf16))"),
        why="many rows read a panel, few decode in registers: both must keep one K order",
    ),
    Mutant(
        "avx512/avx2: the panel's tail of 3 rows left out",
        "csrc/cpu/kernels/expert_gemm_impl.h",
        "        case 3:\n          panel_block<(MR > 3 ? 3 : 1), NR>(a, i, kc, len, panel, park + i * NR * W);\n          break;\n",
        "",
        (BL, "-k", "many_rows and (avx2 or (avx512 and not avx512bf16))"),
    ),
    Mutant(
        "avx512bf16: fp8 activation codes 0x01-0x07 (subnormal) decoded as normal ones",
        "csrc/cpu/kernels/expert_gemm_avx512bf16.cpp",
        "_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8))",
        "_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(1))",
        ("tests/ops/test_expert_gemm_codes.py", "-k", "activation_code and avx512bf16"),
    ),
    Mutant(
        "avx512bf16: fp8 pow2 range one exponent too low",
        "csrc/cpu/kernels/bf16_units.h",
        "constexpr uint32_t kFp8Pow2Low = 10;",
        "constexpr uint32_t kFp8Pow2Low = 9;",
        ("tests/ops/test_expert_gemm_codes.py", "-k", "few_row_paths and avx512bf16"),
        why="2^-118 makes the subnormal codes bf16 subnormals, which vdpbf16ps reads as zero",
    ),
    Mutant(
        "avx512bf16: fp8 NaN code scaled like a number",
        "csrc/cpu/kernels/bf16_units.h",
        "const bool keep = v == 0 || c == 0x7F;",
        "const bool keep = v == 0;",
        ("tests/ops/test_expert_gemm_codes.py", "-k", "avx512bf16"),
    ),
    Mutant(
        "amx: fp4 weight rows with scale bytes 0, 1 or 253 taken by the tiles",
        "csrc/cpu/kernels/expert_gemm_amx.cpp",
        "static_cast<unsigned>(rows_fast<1>(&s, w.k / kFp4WeightBlock))",
        "static_cast<unsigned>(true)",
        (EG, "-k", "extreme_scale_bytes_bitwise and amx"),
        why="TDPBF16PS reads bf16 subnormals as zero; such rows must go to the avx512bf16 kernel",
    ),
    Mutant(
        "amx: the fp8 fold reads the first block's scale for every block",
        "csrc/cpu/kernels/expert_gemm_amx.cpp",
        "blk.n * w.scale_row_stride + kb / kFp8WeightBlock;",
        "blk.n * w.scale_row_stride + 0 * kb;",
        (EG, "-k", "test_matches_reference and amx"),
    ),
    Mutant(
        "amx: a second pass over the rows (past 80) writes the first pass's outputs",
        "csrc/cpu/kernels/expert_gemm_amx.cpp",
        "const int64_t r0 = (g0 + g) * kTile;",
        "const int64_t r0 = g * kTile;",
        ("tests/ops/test_expert_gemm_blocking.py", "-k", "past_one_tile_pass and amx"),
    ),
    Mutant(
        "all ISAs: second chunk of fp8 weight scales read from the first",
        "csrc/cpu/kernels/expert_gemm_impl.h",
        "V::fp8_scales(static_cast<const float*>(r.s) + kc / kFp8WeightBlock,",
        "V::fp8_scales(static_cast<const float*>(r.s),",
        (EG, "-k", "test_matches_reference and avx2"),
        why="needs K > 512 in the strategy",
    ),
    Mutant(
        "expert_gemm: masked row 0 computed anyway",
        "csrc/cpu/expert_gemm.cpp",
        "    if (mp[r]) rows.push_back(r);",
        "    if (mp[r] || r == 0) rows.push_back(r);",
        (EG, "-k", "test_matches_reference and scalar"),
    ),
    Mutant(
        "expert_gemm: each column chunk stops one column short",
        "csrc/cpu/expert_gemm.cpp",
        "a_bf16.data(), w, bounds[c], bounds[c + 1], o, &tiles)",
        "a_bf16.data(), w, bounds[c], bounds[c + 1] - 1, o, &tiles)",
        (EG, "-k", "test_matches_reference and scalar"),
        why="csrc/cpu/column_chunks.h bounds, used off by one",
    ),
    # ---------------------------------------------------------------- pack / unpack (csrc/cpu/kernels/pack_rows.h)
    Mutant(
        "pack: part copy one byte too long",
        "csrc/cpu/kernels/pack_rows.h",
        "std::memcpy(dst + s.offset, s.src + r * s.src_row_stride, static_cast<size_t>(s.nbytes));",
        "std::memcpy(dst + s.offset, s.src + r * s.src_row_stride, static_cast<size_t>(s.nbytes + 1));",
        (PK, "-k", "match_reference"),
        asan=True,
    ),
    Mutant(
        "unpack: row copy one byte too long",
        "csrc/cpu/kernels/pack_rows.h",
        "packed + r * packed_row_stride + offset, static_cast<size_t>(nbytes));",
        "packed + r * packed_row_stride + offset, static_cast<size_t>(nbytes + 1));",
        (PK, "-k", "full_capacity"),
        asan=True,
        why="the extra byte lands where the next row is written later (or past the end): only ASan sees it",
    ),
    Mutant(
        "pack: padding byte 0xFE",
        "csrc/cpu/kernels/pack_rows.h",
        "constexpr uint8_t kPadByte = 0xFF;",
        "constexpr uint8_t kPadByte = 0xFE;",
        (PK, "-k", "match_reference"),
    ),
    # ---------------------------------------------------------------- forward (python/static_moe/ops/forward.py)
    Mutant(
        "forward: shared expert output dropped",
        "python/static_moe/ops/forward.py",
        "            out = out + as_dtype(shared_output, torch.float32)",
        "            out = out + 0 * as_dtype(shared_output, torch.float32)",
        ("tests/ops/test_forward.py", "-k", "s1_matches_reference"),
    ),
    # ---------------------------------------------------------------- dispatch / combine (SPEC §7)
    Mutant(
        "dispatch: inclusive cumsum slots (slot 0 never used, one row too many overflows)",
        "python/static_moe/ops/dispatch.py",
        "    slot = torch.cumsum(mask, dim=0) - mask  # exclusive: rows before t that go to the same rank",
        "    slot = torch.cumsum(mask, dim=0)",
        ("tests/layer/test_expert_parallel.py", "-k", "slot_rows"),
    ),
    Mutant(
        "forward: an all-to-all overflow is not recomputed (rows past Cd silently dropped)",
        "python/static_moe/ops/forward.py",
        "            overflowed = bool(_status.overflow_ranks(host))",
        "            overflowed = False",
        ("tests/layer/test_expert_parallel.py", "-k", "three_combinations"),
    ),
    Mutant(
        "forward: under graph capture an overflowing step is not poisoned (rows past Cd silently dropped)",
        "python/static_moe/ops/forward.py",
        "            poison = poison | flag",
        "            poison = poison",
        ("tests/layer/test_expert_parallel.py", "-k", "three_combinations"),
    ),
    # ---------------------------------------------------------------- workspace (python/static_moe/workspace.py)
    Mutant(
        "workspace: manifest compared on the first and last rank only",
        "python/static_moe/workspace.py",
        "        values = [m[key] for m in manifests]",
        "        values = [m[key] for m in (manifests[0], manifests[-1])]",
        ("tests/layer/test_workspace.py", "-k", "middle_rank"),
        why="only rank 1 of 3 differs",
    ),
    Mutant(
        "workspace: held-workspace flag left out of the manifest",
        "python/static_moe/workspace.py",
        '            "holds workspace": key in self._by_key,',
        '            "holds workspace": False,',
        ("tests/layer/test_workspace.py", "-k", "middle_rank"),
    ),
    # ---------------------------------------------------------------- transformers experts interface
    Mutant(
        "experts interface: interleaved gate/up rows swapped",
        TE_FILE,
        "            gu = torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1)",
        "            gu = torch.cat((gu[:, 1::2], gu[:, 0::2]), dim=1)",
        (TE, "-k", "layouts"),
    ),
    Mutant(
        "experts interface: the probe clamps the gate both ways",
        TE_FILE,
        "        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)",
        "        gate, up = gate.clamp(-limit, limit), up.clamp(-limit, limit)",
        (TE, "-k", "clamp"),
        why="DeepSeek-V4's clamp would no longer be recognised",
    ),
    Mutant(
        "experts interface: no-expert slots passed on",
        TE_FILE,
        "    ids = torch.where((ids >= layer.num_experts) | (ids < 0), torch.full_like(ids, -1), ids)",
        "    ids = torch.where(ids < 0, torch.full_like(ids, -1), ids)",
        (TE, "-k", "chunks"),
    ),
    # ---------------------------------------------------------------- NKI kernels
    Mutant(
        "nki swiglu: NaN amax turned into a finite scale again",
        "nki_kernels/swiglu_and_cast.py",
        "    nisa.tensor_tensor(dst=s_t[0:p, :], data1=s_t[0:p, :], data2=poison[0:p, :], op=nl.add)\n",
        "",
        ("tests/nki/test_nki_swiglu_and_cast.py", "-k", "nonfinite"),
    ),
    Mutant(
        "nki local_experts: kernel ignores fp8_max",
        "nki_kernels/local_experts.py",
        "            fp8_max,",
        "            240.0,",
        ("tests/nki/test_nki_local_experts.py", "-k", "trn3"),
    ),
    Mutant(
        "nki lnc: core 1 drops its share of the tiles",
        "nki_kernels/lnc.py",
        "    lo, hi = (0, first) if rank == 0 else (first, tiles)",
        "    lo, hi = (0, first) if rank == 0 else (first, first)",
        ("tests/nki/test_nki_lnc.py", "-k", "pack or swiglu"),
    ),
    Mutant(
        "nki expert_gemm: both cores compute and store every column at LNC = 2",
        "nki_kernels/expert_gemm.py",
        '    c0, nc = core_share(n, unit, "expert_gemm")',
        "    c0, nc = 0, n",
        ("tests/nki/test_nki_lnc.py", "-k", "expert_gemm"),
        why="the bits stay right; only the per-core HBM bytes show the weights streamed twice",
    ),
    # ---------------------------------------------------------------- NKI interpreter
    Mutant(
        "interpreter: float -> int rounds half up",
        "tools/nki_interpreter/isa.py",
        "        v = np.where(np.isnan(v), 0.0, np.rint(v))",
        "        v = np.where(np.isnan(v), 0.0, np.floor(v + 0.5))",
        ("tests/nki_interpreter/test_nki_casts.py",),
    ),
    Mutant(
        "interpreter: float -> int wraps instead of saturating",
        "tools/nki_interpreter/isa.py",
        "        return np.clip(v, info.min, info.max).astype(dtype)",
        "        return v.astype(np.int64).astype(dtype)",
        ("tests/nki_interpreter/test_nki_casts.py",),
    ),
    Mutant(
        "interpreter: max reduction drops NaN",
        "tools/nki_interpreter/isa.py",
        '        "maximum": np.maximum,',
        '        "maximum": np.fmax,',
        ("tests/nki/test_nki_swiglu_and_cast.py", "-k", "nonfinite"),
    ),
    # ---------------------------------------------------------------- quantisers' edges (python/static_moe/formats.py)
    Mutant(
        "formats: round_up_pow2 doubles a power of two",
        FMT,
        "    exponent = exponent + (mantissa != 0).to(torch.int32)",
        "    exponent = exponent + 1",
        (QP, "-k", "quantize_activation"),
    ),
    Mutant(
        "formats: activation amax floor dropped",
        FMT,
        "    amax = v.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)",
        "    amax = v.abs().amax(dim=-1)",
        (EDGE, "-k", "quantisers"),
        why="an all-zero group gets scale 0 and NaN codes",
    ),
    Mutant(
        "formats: fp4 nibbles unpacked high first",
        FMT,
        "    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)",
        "    return torch.stack((packed >> 4, packed & 0x0F), dim=-1).flatten(-2)",
        (QP, "-k", "fp4"),
    ),
    Mutant(
        "formats: UE8M0 bias 126",
        FMT,
        "b.to(torch.int32) - 127)",
        "b.to(torch.int32) - 126)",
        (EDGE, "-k", "quantisers"),
    ),
    Mutant(
        "formats: e2m1 tie at 0.25 rounds away from the even code",
        FMT,
        "    code = torch.where(a <= 0.25, 0, code).to(torch.uint8)",
        "    code = torch.where(a < 0.25, 0, code).to(torch.uint8)",
        ("tests/formats/test_formats.py",),
    ),
    Mutant(
        "formats: fp4 scale of an amax that is 6 times a power of two one step too big",
        FMT,
        "    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp)",
        "    ceil_log2 = exp",
        (EDGE, "-k", "quantisers"),
        why="the edge inputs' blocks of 6·2^k (the midpoints case) sit exactly on the boundary",
    ),
    Mutant(
        "formats: fp4 scale byte 127 for a block whose amax / 6 underflows",
        FMT,
        "    e = torch.where(y == 0, torch.full_like(exp, -127), ceil_log2.clamp(-127, 127))",
        "    e = torch.where(amax == 0, torch.full_like(exp, -127), ceil_log2.clamp(-127, 127))",
        (EDGE, "-k", "quantisers"),
        why="a lone 2^-149 in a block (the zeros edge input)",
    ),
    # ---------------------------------------------------------------- packed layout (python/static_moe/packed_layout.py)
    Mutant(
        "packed layout: a part of a multiple of 16 bytes takes 16 more",
        "python/static_moe/packed_layout.py",
        "    return -(-nbytes // ALIGN) * ALIGN",
        "    return (nbytes // ALIGN + 1) * ALIGN",
        (QP, "-k", "packed_layout"),
    ),
    Mutant(
        "packed layout: padding byte 0xFE (Python side)",
        "python/static_moe/packed_layout.py",
        "PAD_BYTE = 0xFF",
        "PAD_BYTE = 0xFE",
        (QP, "-k", "packed_layout"),
    ),
    # ---------------------------------------------------------------- the reference's expert order
    Mutant(
        "reference local_experts: experts summed in decreasing id",
        "python/static_moe/reference/local_experts.py",
        "    for e in range(num_local):",
        "    for e in reversed(range(num_local)):",
        (EDGE, "-k", "local_experts and scalar and bf16xbf16"),
        why="the shared case's exact result (0) holds the reference too",
    ),
    # ---------------------------------------------------------------- workspace lifecycle (python/static_moe/workspace.py)
    Mutant(
        "workspace: a closed workspace keeps its buffers",
        WS,
        "            ws._buffers.clear()\n",
        "",
        (LIFE, "-k", "failed_allocation"),
    ),
    Mutant(
        "workspace: a closed workspace stays registered",
        WS,
        "                del self._by_key[ws.key]",
        "                pass",
        (LIFE, "-k", "failed_allocation"),
    ),
    Mutant(
        "workspace: a failed allocation's last buffer lives on in the error's traceback",
        WS,
        "            t = None  # noqa: F841",
        "            pass",
        (LIFE, "-k", "failed_allocation"),
    ),
    Mutant(
        "workspace: close() leaves the count to garbage collection",
        WS,
        "        self._finalizer()  # runs _release exactly once",
        "        pass",
        (LIFE, "-k", "static_moe_close"),
    ),
    # ---------------------------------------------------------------- the collective verdict (ops/step_status.py)
    Mutant(
        "verdict: configurations compared without the last rank",
        SS,
        "known = {r: headers[r][_CONFIG0 + i] for r in good if",
        "known = {r: headers[r][_CONFIG0 + i] for r in good[:-1] if",
        (VERDICT, "-k", "differing_rank"),
    ),
    Mutant(
        "verdict: id E accepted",
        SS,
        "            if lo < -1 or hi >= e:",
        "            if lo < -1 or hi > e:",
        (VERDICT, "-k", "id_out_of_range"),
    ),
    Mutant(
        "verdict: the first x_scale never checked",
        SS,
        "first = torch.where(bad.any(), bad.to(torch.int32).argmax(), -1).to(torch.int32)",
        "first = torch.where(bad[1:].any(), bad[1:].to(torch.int32).argmax() + 1, -1).to(torch.int32)",
        (VERDICT, "-k", "bad_activation_scale"),
    ),
    Mutant(
        "verdict: device verdict misses a bad first x_scale",
        SS,
        "| (h[:, 5] >= 0)",
        "| (h[:, 5] > 0)",
        (VERDICT, "-k", "bad_activation_scale"),
        why="the host and device verdicts must agree (CUDA graph replay reads the device one)",
    ),
    Mutant(
        "verdict: device verdict accepts id -2",
        SS,
        "(h[:, 3] < -1)",
        "(h[:, 3] < -2)",
        (VERDICT, "-k", "id_out_of_range"),
    ),
    Mutant(
        "verdict: header column of row 1 left unpadded",
        SS,
        "    send[1:, parts_width:].fill_(0xFF)",
        "    send[2:, parts_width:].fill_(0xFF)",
        (VERDICT, "-k", "message_travels"),
    ),
    Mutant(
        "verdict: a padding header from the last rank goes unnoticed",
        SS,
        "    bad_magic = [r for r in range(s) if headers[r][0] != MAGIC]",
        "    bad_magic = [r for r in range(s - 1) if headers[r][0] != MAGIC]",
        (VERDICT, "-k", "padding_header"),
    ),
    # ---------------------------------------------------------------- pack / unpack edges (cpu/kernels/pack_rows.h)
    Mutant(
        "pack: row T copied instead of padded",
        "csrc/cpu/kernels/pack_rows.h",
        "    if (r >= rows) {",
        "    if (r > rows) {",
        (QP, "-k", "packed_layout"),
        asan=True,
    ),
    Mutant(
        "pack: last byte of a row's trailing gap left unwritten",
        "csrc/cpu/kernels/pack_rows.h",
        "    if (width > col) std::memset(dst + col, kPadByte, static_cast<size_t>(width - col));",
        "    if (width > col + 1) std::memset(dst + col, kPadByte, static_cast<size_t>(width - col - 1));",
        (EDGE, "-k", "pack_rows"),
    ),
    Mutant(
        "unpack: the first row not copied",
        "csrc/cpu/kernels/pack_rows.h",
        "  for (int64_t r = 0; r < rows; ++r)\n    std::memcpy(out + r * nbytes,",
        "  for (int64_t r = 1; r < rows; ++r)\n    std::memcpy(out + r * nbytes,",
        (EDGE, "-k", "pack_rows"),
    ),
    # ---------------------------------------------------------------- expert GEMM decode (scalar ISA)
    Mutant(
        "scalar: fp4 decode drops the sign of odd k",
        "csrc/cpu/kernels/expert_gemm_scalar.cpp",
        "    hi = kE2m1[q >> 4] * *s;",
        "    hi = kE2m1[(q >> 4) & 0x7] * *s;",
        (EDGE, "-k", "expert_gemm and scalar and bf16xfp4"),
    ),
    Mutant(
        "scalar: scale byte 0 decoded as byte 1",
        "csrc/cpu/kernels/expert_gemm_scalar.cpp",
        "      out[i] = ue8m0_to_float(s[i]);",
        "      out[i] = ue8m0_to_float(s[i] == 0 ? 1 : s[i]);",
        (EDGE, "-k", "expert_gemm and scalar and bf16xfp4"),
        why="the shared case puts byte 0 at the first and last block",
    ),
    # ---------------------------------------------------------------- swiglu's quantiser (cpu/kernels/swiglu_and_cast.h)
    Mutant(
        "swiglu: a group's first value left out of its amax",
        "csrc/cpu/kernels/swiglu_and_cast.h",
        "      for (int64_t j = 0; j < G; ++j) {\n        const int32_t a",
        "      for (int64_t j = 1; j < G; ++j) {\n        const int32_t a",
        (EDGE, "-k", "swiglu"),
    ),
    Mutant(
        "swiglu: a group's last value left out of its amax",
        "csrc/cpu/kernels/swiglu_and_cast.h",
        "      for (int64_t j = 0; j < G; ++j) {\n        const int32_t a",
        "      for (int64_t j = 0; j < G - 1; ++j) {\n        const int32_t a",
        (EDGE, "-k", "swiglu"),
    ),
    # ---------------------------------------------------------------- CUDA per-thread code (host emulation)
    Mutant(
        "cuda: scale byte 0 decoded as 2^-126",
        "csrc/cuda/numerics.cuh",
        "b == 0u ? 0x00400000u : (b << 23)",
        "b == 0u ? 0x00800000u : (b << 23)",
        (CUDA_CASES, "-k", "expert_gemm and bf16xfp4"),
    ),
    Mutant(
        "cuda: a row's experts combined in decreasing id",
        "csrc/cuda/local_experts.cuh",
        "  int prev = -1;\n  while (true) {\n    int best_e = INT_MAX, best_p = -1;\n"
        "    for (int64_t j = 0; j < topk; ++j) {\n      const int p = sp[j], e = se[j];\n"
        "      if (p >= 0 && e > prev && e < best_e) {",
        "  int prev = INT_MAX;\n  while (true) {\n    int best_e = -1, best_p = -1;\n"
        "    for (int64_t j = 0; j < topk; ++j) {\n      const int p = sp[j], e = se[j];\n"
        "      if (p >= 0 && e < prev && e > best_e) {",
        (CUDA_CASES, "-k", "local_experts and bf16xbf16"),
        why="the CUDA path's order was invisible to its own cases before the shared ones",
    ),
    Mutant(
        "cuda: fp4's e4m3 2^6 on the scale instead of the partial",
        "csrc/cuda/expert_gemm.cuh",
        "      for (int c = 0; c < 4; ++c) part[nt][c] *= kE2m1InE4m3Factor;\n    }\n"
        "    acc[nt][0] += part[nt][0] * (ws[0] * as[0]);\n    acc[nt][1] += part[nt][1] * (ws[0] * as[1]);\n"
        "    acc[nt][2] += part[nt][2] * (ws[1] * as[0]);\n    acc[nt][3] += part[nt][3] * (ws[1] * as[1]);\n",
        "      for (int h = 0; h < 2; ++h) ws[h] *= kE2m1InE4m3Factor;\n    }\n"
        "    acc[nt][0] += part[nt][0] * (ws[0] * as[0]);\n    acc[nt][1] += part[nt][1] * (ws[0] * as[1]);\n"
        "    acc[nt][2] += part[nt][2] * (ws[1] * as[0]);\n    acc[nt][3] += part[nt][3] * (ws[1] * as[1]);\n"
        "    if constexpr (C::kW == WeightFmt::kFp4 && kFp8Mma)\n      for (int h = 0; h < 2; ++h) ws[h] /= "
        "kE2m1InE4m3Factor;\n",
        (CUDA_CASES, "-k", "expert_gemm and fp8xfp4 and e4m3mma"),
        why="the ordering the bytes 253 / 254 case needs: ordinary bytes give the same bits either way",
    ),
    Mutant(
        "cuda: local_experts' GEMM2 reads expert 0's fp4 / fp8 scales for every expert",
        "csrc/cuda/local_experts.cuh",
        "  g.b_scale_expert_stride = a.w2_scale_expert_stride;",
        "  g.b_scale_expert_stride = 0;",
        (CUDA_CASES, "-k", "local_experts and fp4"),
        why="the fp4 local_experts cases once gave the emulator I / 2 for I and were xfailed, hiding such bugs",
    ),
    Mutant(
        "cuda: swiglu's float scales rounded up to a power of two",
        "csrc/cuda/swiglu_and_cast.cuh",
        "  return pow2_scale ? round_up_pow2(s) : s;",
        "  return round_up_pow2(s);",
        (CUDA_CASES, "-k", "swiglu and fp8-32-False"),
        why="the float-scale case was xfailed (held bitwise; SPEC §6.2 bounds it at 2^-20 relative)",
    ),
    Mutant(
        "nki expert_gemm: fp4's e4m3 2^6 folded into the UE8M0 scale (bytes 249 … 254 overflow)",
        "nki_kernels/expert_gemm.py",
        "        scale = ue8m0_to_scale(s_i32, s_raw.reshape((P, nblk * nsc)))\n        fold_scales(\n"
        "            w_nat.reshape((P, nblk * k)),\n            even.view(nl.float8_e4m3),\n"
        "            odd.view(nl.float8_e4m3),\n            scale,\n            32,\n            pre_scale=64.0,\n",
        "        nisa.tensor_scalar(dst=s_i32, data=s_raw.reshape((P, nblk * nsc)), op0=nl.add, operand0=6.0)\n"
        "        nisa.tensor_scalar(dst=s_i32, data=s_i32, op0=nl.left_shift, operand0=23)\n"
        "        scale = s_i32.view(nl.float32)\n        fold_scales(\n"
        "            w_nat.reshape((P, nblk * k)),\n            even.view(nl.float8_e4m3),\n"
        "            odd.view(nl.float8_e4m3),\n            scale,\n            32,\n",
        ("tests/nki/test_nki_cases.py", "-k", "expert_gemm and bf16xfp4"),
        why="the scale the kernel had before: exact for bytes 0 … 248, so ordinary cases pass with it",
    ),
    Mutant(
        "nki expert_gemm: UE8M0 byte 0 decoded as 0 (the subnormal 2^-127 lost)",
        "nki_kernels/expert_gemm.py",
        "op0=nl.multiply, operand0=float(1 << 23), op1=nl.maximum, operand1=float(1 << 22)",
        "op0=nl.multiply, operand0=float(1 << 23)",
        ("tests/nki/test_nki_cases.py", "-k", "expert_gemm and bf16xfp4"),
    ),
]
