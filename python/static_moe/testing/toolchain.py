"""The CUDA toolkit on this machine, for the tests and benchmarks that compile CUDA without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

_HOME_VARS = ("CUDA_HOME", "CUDA_PATH")


def find_nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc`` or ``$CUDA_PATH/bin/nvcc`` when it exists, else nvcc on PATH, else
    None."""
    for var in _HOME_VARS:
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def find_cuda_include(nvcc: str) -> Path | None:
    """The directory holding cuda_runtime_api.h (nvcc on PATH may be a wrapper script outside the toolkit)."""
    candidates = []
    for var in _HOME_VARS:
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates += [Path(nvcc).resolve().parents[1] / "include", Path("/usr/local/cuda/include")]
    try:  # ask nvcc where its toolkit is (works through wrapper scripts)
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stderr
        for line in out.splitlines():
            if line.startswith("#$ TOP="):
                candidates.insert(0, Path(line.split("=", 1)[1].strip()) / "include")
    except (OSError, subprocess.SubprocessError):
        pass
    for c in candidates:
        if (c / "cuda_runtime_api.h").exists():
            return c
    return None
