"""Build static_moe: the Python package (python/static_moe), the NKI kernel sources (nki_kernels/, installed as
``static_moe.nki_kernels``) and the C++ extension ``static_moe._C`` from csrc/. The NKI interpreter in tools/ is
a development tool and is not installed.

A CPU-only torch builds the CPU backend alone.  When torch is a CUDA build and nvcc is found, the CUDA kernels
in csrc/cuda/ are compiled into the same extension and registered for the CUDA dispatch key.

The default build never uses ``-march=native``: SIMD kernels pick their instruction set at run time
(see csrc/cpu/simd.h), so one wheel runs on every x86-64 CPU.
"""

import glob
import os
import re

import setuptools
from setuptools import setup


def _check_build_environment() -> None:
    """With --no-build-isolation pip installs none of pyproject.toml's build requirements: say which are missing
    instead of setuptools' "invalid command 'bdist_wheel'" (setuptools < 70.1 builds wheels only with `wheel`)."""
    version = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
    if version < (70, 1):
        try:
            import wheel  # noqa: F401
        except ImportError:
            raise SystemExit(
                f"static_moe: setuptools {setuptools.__version__} needs the 'wheel' package to build; "
                "install the build requirements first (pip install 'setuptools>=70.1' ninja "
                "torch==2.13.0), or drop --no-build-isolation"
            ) from None


_check_build_environment()
try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    raise SystemExit(
        "static_moe: the build needs torch (the extension compiles against it): pip install . "
        "installs it from pyproject.toml's build requirements; with --no-build-isolation install "
        "torch==2.13.0 first"
    ) from None

ROOT = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    """``__version__`` from python/static_moe/_version.py, read as text: importing the package needs the extension
    this script is about to build."""
    with open(os.path.join(ROOT, "python", "static_moe", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _want_cuda() -> bool:
    if os.environ.get("STATIC_MOE_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


cpu_sources = _rel(
    glob.glob(os.path.join(ROOT, "csrc", "*.cpp"))
    + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp"))
    + glob.glob(os.path.join(ROOT, "csrc", "cpu", "kernels", "*.cpp"))
)
cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
link_flags = ["-fopenmp"]
define_macros = []

if _want_cuda():
    cuda_sources = _rel(
        glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")) + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp"))
    )
    arch = os.environ.get("STATIC_MOE_CUDA_ARCH", "90a;80")
    gencode = []
    for a in arch.split(";"):
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    ext = CUDAExtension(
        "static_moe._C",
        cpu_sources + cuda_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros + [("STATIC_MOE_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"] + gencode},
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension(
        "static_moe._C",
        cpu_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


def _reuse_extension() -> bool:
    if os.environ.get("STATIC_MOE_REUSE_EXTENSION", "0") != "1":
        return False
    if not glob.glob(os.path.join(ROOT, "python", "static_moe", "_C*.so")):
        raise SystemExit(
            "static_moe: STATIC_MOE_REUSE_EXTENSION=1 but no python/static_moe/_C*.so was built in place: "
            "run `make build` first"
        )
    return True


setup(
    name="static_moe",
    version=_version(),
    description="Static-shape expert-parallel MoE decode ops for NKI, CUDA and CPU",
    packages=[
        "static_moe",
        "static_moe.reference",
        "static_moe.ops",
        "static_moe.testing",
        "static_moe.nki",
        "static_moe.nki_kernels",
        "static_moe.integrations",
        "static_moe.loaders",
    ],
    package_dir={"static_moe": "python/static_moe", "static_moe.nki_kernels": "nki_kernels"},
    # STATIC_MOE_REUSE_EXTENSION=1: install the package around an extension already built in place
    # (python/static_moe/_C*.so, by the editable install of the main venv against the same torch) instead of
    # compiling it again: `make venv-vllm` installs static_moe into vLLM's venv so.
    ext_modules=[] if _reuse_extension() else [ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    license="Apache-2.0",
    # The extension is built against one torch release (pyproject.toml pins the build's); its C++ ABI holds
    # within that minor release only.
    install_requires=["torch>=2.13,<2.14", "numpy", "ml_dtypes"],
    extras_require={"transformers": ["transformers>=5"]},
    # vLLM loads every general plugin in each of its processes; static_moe's is inert unless STATIC_MOE_VLLM=1
    # (static_moe.integrations.vllm).
    entry_points={"vllm.general_plugins": ["static_moe = static_moe.integrations.vllm:register"]},
)
