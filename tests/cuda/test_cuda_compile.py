"""Compile check of the CUDA backend, runnable without a GPU.

* Every csrc/cuda/*.cu is compiled by nvcc (found through CUDA_HOME / CUDA_PATH or PATH) for sm_90a and for sm_80,
  with the flags torch's extension build uses plus warnings as errors (nvcc's and the host compiler's).
* The CUDA bindings (csrc/cuda/*.cpp) are checked by the host C++ compiler against the installed torch headers and
  the CUDA headers (syntax and warnings, -Wall -Wextra -Werror), all in one translation unit so the torch headers
  are parsed once. A CPU-only torch ships the c10/cuda headers but not the generated cuda_cmake_macros.h, which
  C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips.
The compiles run in parallel; without nvcc (or the CUDA headers) the tests skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from static_moe.testing.toolchain import find_cuda_include, find_nvcc

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
KERNELS = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
BINDINGS = sorted(p.name for p in CUDA_DIR.glob("*.cpp"))
ARCHS = ["90a", "80"]


NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None,
    reason="nvcc not found (set CUDA_HOME or put nvcc on PATH): the CUDA compile check needs the CUDA toolkit",
)


def nvcc_flags() -> list[str]:
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what torch's extension build passes to nvcc

    return list(COMMON_NVCC_FLAGS) + [
        "-std=c++17",
        "-O3",
        "--expt-relaxed-constexpr",
        "-DSTATIC_MOE_WITH_CUDA",
        "-Xcompiler",
        "-fPIC",
        "-Werror",
        "all-warnings",
        "-Xcompiler",
        "-Wall,-Werror",
        "-I",
        str(ROOT / "csrc"),
    ]


def run(cmd: list[str]) -> tuple[int, str]:
    res = subprocess.run(cmd, capture_output=True, text=True)
    return res.returncode, " ".join(cmd) + "\n" + res.stdout + res.stderr


@pytest.fixture(scope="module")
def kernel_builds(tmp_path_factory) -> dict[tuple[str, str], tuple[int, str]]:
    out = tmp_path_factory.mktemp("cuda_objs")
    flags = nvcc_flags()
    jobs = {
        (name, arch): [
            NVCC,
            *flags,
            "-gencode",
            f"arch=compute_{arch},code=sm_{arch}",
            "-c",
            str(CUDA_DIR / name),
            "-o",
            str(out / f"{name}.{arch}.o"),
        ]
        for name in KERNELS
        for arch in ARCHS
    }
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = dict(zip(jobs, pool.map(run, jobs.values())))
    return results


def test_there_are_kernels():
    assert KERNELS, "no csrc/cuda/*.cu found"
    assert {f"{op}.cu" for op in ("pack_rows", "swiglu_and_cast", "expert_gemm", "local_experts")} <= set(KERNELS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_without_warnings(kernel_builds, name, arch):
    rc, log = kernel_builds[(name, arch)]
    assert rc == 0, f"nvcc failed for {name} (sm_{arch}):\n{log}"


def test_kernels_do_not_include_torch():
    """Kernel files take raw pointers, sizes and strides; torch appears only in the *_binding.cpp files."""
    for p in list(CUDA_DIR.glob("*.cu")) + list(CUDA_DIR.glob("*.cuh")) + list(CUDA_DIR.glob("*.h")):
        if p.name == "weight_view.h":  # binding-side helper
            continue
        text = p.read_text()
        for needle in ("#include <torch", "#include <ATen", "#include <c10"):
            assert needle not in text, f"{p.name} includes torch headers ({needle})"


def test_bindings_compile_against_torch_headers(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    cuda_inc = find_cuda_include(NVCC)
    if cuda_inc is None:
        pytest.skip("CUDA headers (cuda_runtime_api.h) not found next to nvcc")
    from torch.utils.cpp_extension import include_paths

    unit = tmp_path / "all_bindings.cpp"
    unit.write_text("".join(f'#include "cuda/{b}"\n' for b in BINDINGS))
    cmd = [
        cxx,
        "-fsyntax-only",
        "-std=c++17",
        "-Wall",
        "-Wextra",
        "-Wno-unused-function",
        "-Werror",
        "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
        "-DSTATIC_MOE_WITH_CUDA",
        "-I",
        str(ROOT / "csrc"),
    ]
    for inc in include_paths():  # torch's own headers are system headers: their warnings are not ours
        cmd += ["-isystem", inc]
    cmd += ["-isystem", str(cuda_inc), str(unit)]
    rc, log = run(cmd)
    assert rc == 0, f"the CUDA bindings do not compile:\n{log}"
