"""The file protocol of the repository's CPU emulation of the CUDA per-thread code (tests/cuda/host/emulate.cu):
build the emulator with nvcc, write a case's tensors and parameters into a folder, run one command on it, read
the results back. No GPU is involved; only nvcc is needed to build."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import torch


def build_emulator(nvcc: str, csrc: Path, source: Path, out: Path) -> Path:
    """Compile ``source`` (with ``csrc`` on the include path) for sm_80 with every warning an error; returns
    ``out``, the executable."""
    cmd = [nvcc, "-std=c++17", "-O2", "-arch=sm_80", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror"]
    cmd += ["-I", str(csrc), str(source), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"building the emulator failed:\n{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    return out


def run(emulator: Path, cmd: str, d: Path) -> None:
    """Run the emulator's command ``cmd`` on the case folder ``d``."""
    res = subprocess.run([str(emulator), cmd, str(d)], capture_output=True, text=True)
    assert res.returncode == 0, f"emulate {cmd} failed ({res.returncode}): {res.stderr}"


def write_meta(d: Path, **kv) -> None:
    """The case's scalar parameters, one ``name value`` line each, in ``d/meta.txt``."""
    (d / "meta.txt").write_text("".join(f"{k} {float(v)!r}\n" for k, v in kv.items()))


def tofile(d: Path, name: str, t: torch.Tensor | None) -> None:
    """``t``'s bytes (row-major; an empty file for None) as ``d/name``."""
    data = b"" if t is None else t.contiguous().view(torch.uint8).numpy().tobytes()
    (d / name).write_bytes(data)


def fromfile(d: Path, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
    """``d/name``'s bytes as a ``dtype`` tensor of ``shape``."""
    raw = np.frombuffer((d / name).read_bytes(), dtype=np.uint8).copy()
    return torch.from_numpy(raw).view(dtype).reshape(shape)
