#!/usr/bin/env bash
# One-command GPU check of the CUDA backend (about 3-5 minutes on one H200):
#   1. environment: nvidia-smi, a CUDA build of torch that sees the GPU
#   2. build static_moe._C in place against that torch, for this GPU's architecture only (sm_90a on Hopper)
#   3. parity tests: tests/cuda/gpu/test_cuda_parity.py (a missing CUDA kernel is a failure here, not a skip)
#   4. microbenchmark: bench/bench_cuda.py --quick (table + bench/results/bench_cuda.json)
# Every step prints a banner; the first failure stops the script with "GPU CHECK FAILED: <why>" and exit code 1.
#
# Knobs: PYTHON (default python3), STATIC_MOE_CUDA_ARCH (default: from the GPU, e.g. 90a), MAX_JOBS (default
# nproc), BENCH_ARGS (default --quick; "" for the full sweep).
# No network is needed: the build uses the installed torch, setuptools and ninja (no pip install).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
T0=$(date +%s)

banner() { printf '\n=== %s (%ss) ===\n' "$*" "$(( $(date +%s) - T0 ))"; }
fail() { printf '\nGPU CHECK FAILED: %s\n' "$*" >&2; exit 1; }

banner "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || fail "nvidia-smi failed (no GPU?)"
"$PY" - <<'EOF' || fail "this python's torch cannot run CUDA (see above)"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
assert torch.version.cuda is not None, "torch is a CPU-only build"
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}: sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
EOF

if [[ -z "${STATIC_MOE_CUDA_ARCH:-}" ]]; then
  # Hopper gets the arch-specific target (sm_90a); other GPUs their plain compute capability.
  STATIC_MOE_CUDA_ARCH=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}a' if m == 9 else f'{m}{n}')")
fi
export STATIC_MOE_CUDA_ARCH MAX_JOBS=${MAX_JOBS:-$(nproc)}

mkdir -p build
banner "build static_moe._C for sm_${STATIC_MOE_CUDA_ARCH} (log: build/gpu_check_build.log)"
if ! "$PY" setup.py build_ext --inplace >build/gpu_check_build.log 2>&1; then
  tail -n 60 build/gpu_check_build.log
  fail "the build failed (full log: build/gpu_check_build.log)"
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF' || fail "the built extension has no CUDA kernels (was torch.version.cuda / nvcc found by setup.py?)"
import torch
import static_moe
missing = [op for op in ("pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts")
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"static_moe::{op}", "CUDA")]
print("static_moe from", static_moe.__file__)
assert not missing, f"no CUDA kernel registered for {missing}"
print("CUDA kernels registered for every op")
EOF

banner "parity tests (tests/cuda/gpu/test_cuda_parity.py)"
STATIC_MOE_REQUIRE_CUDA=1 "$PY" -m pytest -q -x -p no:cacheprovider tests/cuda/gpu/test_cuda_parity.py \
  || fail "CUDA parity tests failed"

banner "microbenchmark (bench/bench_cuda.py ${BENCH_ARGS---quick})"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
"$PY" bench/bench_cuda.py ${BENCH_ARGS---quick} || fail "the benchmark failed or its sanity check did"

banner "GPU CHECK PASSED"
